"""The greedy screen of an fp32 LM head (engine/worker/models/greedy_screen.py).

Its token must be the argmax of the fp32 logits, also where the bf16 approximation alone
picks another (near-ties below bf16's resolution), and it must give up (None) where it
cannot decide, so the engine computes the logits in full. Engine level: greedy output with
the screen on still equals transformers', and rows that need logits (logprobs, sampling)
never take it.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.worker.kernels import fused
from engine.worker.models.cpu_linear import packing_available
from engine.worker.models.greedy_screen import CAP, GreedyScreen

pytestmark = pytest.mark.skipif(
    not (packing_available(torch.bfloat16) and fused.usable(torch.empty(0))),
    reason="needs oneDNN bf16 packing and the kernel library",
)


def _weight(vocab: int = 3000, k: int = 96, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, k, generator=g) * 0.05


def test_tokens_are_the_fp32_argmax_at_every_scale_and_row_count():
    w = _weight()
    screen = GreedyScreen(w)
    g = torch.Generator().manual_seed(1)
    for rows in (1, 3, 64):
        for scale in (0.01, 1.0, 40.0):
            hidden = torch.randn(rows, w.shape[1], generator=g) * scale
            got = screen.token_ids(hidden)
            assert got is not None
            assert got.tolist() == (hidden @ w.T).argmax(dim=1).tolist()
    assert screen.token_ids(torch.empty(0, w.shape[1])) is None


def test_a_near_tie_below_bf16_resolution_is_decided_in_fp32():
    w = _weight(seed=2)
    hidden = torch.randn(1, w.shape[1], generator=torch.Generator().manual_seed(3))
    base = (hidden[0] / hidden[0].norm() * 3.0).bfloat16().float()  # far above the rest
    w[10] = base
    w[20] = base * (1 + 2.0**-12)  # the same bf16 row, a larger fp32 logit
    assert torch.equal(w[10].bfloat16(), w[20].bfloat16())
    screen = GreedyScreen(w)
    approx = torch.ops.mkldnn._linear_pointwise(
        hidden.bfloat16(), screen.packed, None, "none", [], ""
    )
    assert int(fused.argmax_rows_bf16(approx)[0]) == 10  # bf16 alone gets it wrong
    assert screen.token_ids(hidden).tolist() == [20]
    w[20] = base * (1 - 2.0**-12)  # now row 10's logit is the larger
    assert GreedyScreen(w).token_ids(hidden).tolist() == [10]


def test_exact_ties_take_the_first_index_like_the_full_path():
    w = _weight(seed=4)
    hidden = torch.randn(2, w.shape[1], generator=torch.Generator().manual_seed(5))
    top = hidden[0] / hidden[0].norm() * 3.0
    w[7] = w[1500] = w[2999] = top
    assert GreedyScreen(w).token_ids(hidden[:1]).tolist() == [7]


def test_it_gives_up_on_nan_inf_and_too_many_candidates():
    w = _weight(seed=6)
    screen = GreedyScreen(w)
    hidden = torch.randn(4, w.shape[1], generator=torch.Generator().manual_seed(7))
    bad = hidden.clone()
    bad[2, 5] = float("nan")
    assert screen.token_ids(bad) is None
    bad[2, 5] = float("inf")
    assert screen.token_ids(bad) is None
    crowded = w.clone()
    crowded[: CAP + 1] = hidden[0] / hidden[0].norm() * 3.0  # CAP + 1 equal leaders
    assert GreedyScreen(crowded).token_ids(hidden[:1]) is None


def test_the_engine_screens_greedy_rows_and_still_equals_transformers(
    tiny_checkpoint, hf_greedy, monkeypatch
):
    monkeypatch.setenv("APPLIANCE_CPU_BF16", "1")  # the screen is built on any CPU
    model_dir = tiny_checkpoint("llama", tie_word_embeddings=True)
    prompts = [[(7 * i + 3 * j) % 400 + 3 for j in range(5 + 3 * i)] for i in range(12)]
    ref = hf_greedy(model_dir, prompts, 10, ignore_eos=True)
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=256, block_size=4)
    screen = llm.engine.runner.model.greedy_screen
    assert screen is not None
    calls = []
    original = screen.token_ids
    screen.token_ids = lambda h: calls.append(h.shape[0]) or original(h)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert calls, "no greedy step took the screen"

    calls.clear()  # rows that need the logits: never screened, same tokens
    with_lp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": prompts[0]}], with_lp, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == ref[0]
    assert len(outs[0].outputs[0].logprobs) == 10
    assert calls == []
