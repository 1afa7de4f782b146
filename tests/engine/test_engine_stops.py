"""Who ends a request and why: EOS sets, stop strings, and the one owner of status.

The scheduler owns `Request.status` and `stop_reason`; the output processor only reports the
stop strings its detokenizer finds. Every EOS id of the model (the tokenizer's and the
generation config's) ends a request with finish_reason "stop" and stop_reason None.
"""

from __future__ import annotations

import json
import shutil

import pytest

from engine import LLM, SamplingParams
from engine.core.request import Request, RequestStatus
from engine.core.step_io import RunnerOutput
from engine.output.processor import OutputProcessor
from engine.output.tokenizer import Tokenizer
from tests.support.scheduler_helpers import make_scheduler

# The tokenizer's eos (<|endoftext|>) plus two more only the generation config lists, like
# Llama-3-Instruct's <|eot_id|>: <|im_end|> (2) and "%" (7).
EOS_IDS = [0, 2, 7]


@pytest.fixture(scope="module")
def multi_eos_llm(tiny_llama_dir, tmp_path_factory) -> LLM:
    model_dir = tmp_path_factory.mktemp("multi_eos") / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    gen = model_dir / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), "eos_token_id": EOS_IDS}))
    return LLM(str(model_dir), num_kv_blocks=64, block_size=4, dtype="float32", max_model_len=64)


@pytest.mark.parametrize("eos", EOS_IDS)
def test_every_eos_id_of_the_model_stops_with_no_stop_reason(multi_eos_llm, eos):
    assert multi_eos_llm.tokenizer.eos_token_ids == set(EOS_IDS)
    params = SamplingParams(temperature=0.0, max_tokens=5, logit_bias={eos: 100.0})
    comp = multi_eos_llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
    assert comp.token_ids == [eos]
    assert comp.finish_reason == "stop" and comp.stop_reason is None
    assert comp.text == ""


def test_eos_ids_are_not_stop_token_ids_and_ignore_eos_ignores_all(multi_eos_llm):
    eng = multi_eos_llm.engine
    (req,) = eng.prepare_request("r", "Hello", SamplingParams()).requests
    assert req.eos_token_ids == frozenset(EOS_IDS)
    assert req.sampling_params.stop_token_ids == frozenset()
    params = SamplingParams(temperature=0.0, max_tokens=3, logit_bias={7: 100.0}, ignore_eos=True)
    comp = multi_eos_llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
    assert comp.token_ids == [7, 7, 7] and comp.finish_reason == "length"


def test_a_stop_token_id_that_is_no_eos_keeps_its_stop_reason(multi_eos_llm):
    params = SamplingParams(
        temperature=0.0, max_tokens=5, logit_bias={9: 100.0}, stop_token_ids=[9, 2]
    )
    comp = multi_eos_llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == 9


def test_processor_reports_a_stop_string_and_the_scheduler_sets_status(tiny_llama_dir):
    """The last allowed token completes a stop string: the scheduler already finished the
    request by length; the processor leaves that alone and reports the string, and the
    scheduler re-marks the request stopped by it (the string came first in the text)."""
    tok = Tokenizer.from_pretrained(tiny_llama_dir)
    sched = make_scheduler()
    req = Request("r", [5, 6], SamplingParams(max_tokens=1, stop=["%"]))
    sched.add_request(req)
    processor = OutputProcessor(tok)
    processor.add_group("r", None, [req])
    (updated,) = sched.update_from_output(sched.schedule(), RunnerOutput(["r"], [[7]]))
    assert req.status is RequestStatus.FINISHED_LENGTH
    _, stops = processor.process([updated], RunnerOutput(["r"], [[7]]))
    assert stops == [(req, "%", 1)]
    assert req.status is RequestStatus.FINISHED_LENGTH and req.stop_reason is None
    sched.stop_on_string(req, "%")
    processor.finalize_stop("r")
    out = processor.delta_for("r").outputs[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", "%", "")


def test_stop_on_string_leaves_an_aborted_request_aborted():
    sched = make_scheduler()
    req = Request("r", [5, 6], SamplingParams(max_tokens=4))
    sched.add_request(req)
    sched.abort("r")
    sched.stop_on_string(req, "x")
    assert req.status is RequestStatus.FINISHED_ABORTED and req.stop_reason is None
