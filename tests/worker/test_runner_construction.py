"""ModelRunner builds itself: the model's EOS ids for min_tokens, no engine wiring after it."""

from __future__ import annotations

import torch

from engine.config import ModelConfig, RuntimeConfig
from engine.core.step_io import NewRequestData, SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.worker.models.loader import load_model
from engine.worker.runner import ModelRunner

PROMPT = [3, 17, 42, 9, 11]


def _first_token(model, eos: tuple[int, ...], min_tokens: int) -> int:
    runner = ModelRunner(
        model, torch.device("cpu"), torch.float32, 4, RuntimeConfig(), eos_token_ids=eos
    )
    runner.allocate_kv_cache(8)
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=min_tokens)
    new = NewRequestData("r", PROMPT, [], params, [0, 1], 0)
    so = SchedulerOutput(
        scheduled_new_reqs=[new],
        num_scheduled_tokens={"r": len(PROMPT)},
        total_num_scheduled_tokens=len(PROMPT),
    )
    return runner.execute(so).sampled_token_ids[0][0]


def test_eos_ids_given_at_construction_are_masked_until_min_tokens(tiny_llama_dir):
    model = load_model(ModelConfig(path=str(tiny_llama_dir)), torch.device("cpu")).model
    greedy = _first_token(model, (), 0)
    assert _first_token(model, (greedy,), 0) == greedy  # EOS may end a reply at once
    assert _first_token(model, (greedy,), 1) != greedy  # ... but not before min_tokens


def test_engine_passes_the_tokenizers_eos_ids_to_the_runner(tiny_llama_dir):
    from engine import LLM

    llm = LLM(str(tiny_llama_dir), num_kv_blocks=16, block_size=4, max_model_len=64)
    runner = llm.engine.runner
    assert runner.eos_token_ids == tuple(sorted(llm.engine.tokenizer.eos_token_ids))
    assert runner.eos_token_ids  # the tiny tokenizer has one, so the check is not vacuous
