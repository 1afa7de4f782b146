"""A sample ended by its own constraints, as every frontend answers it (docs/serving.md).

One rule (`engine.request_stream.sole_choice_error`): a whole answer with one choice that
failed is that choice's error (HTTP 400, gRPC INVALID_ARGUMENT, naming the field); with
several choices the failed one carries `finish_reason: "error"` and an error object and the
others are answered as usual; a stream marks the failed choice and goes on.

Two triggers: a real one (a grammar whose Earley-row limit llguidance hits only once the
model took the branch a logit bias steers it into), and, for n > 1, a stand-in runner that
reports one chosen sample's grammar as broken, so which choice fails is known in advance.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from appliance.grpc.errors import field_violation
from appliance.grpc.kserve_tensors import encode_bytes
from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc
from appliance.grpc.proto.inference import grpc_service_pb2 as kpb
from appliance.grpc.proto.inference import grpc_service_pb2_grpc as kpb_grpc
from tests.engine.test_structured_errors import LATE_LIMIT
from tests.support.served_stack import Stack, served, tiny_engine, wait_idle_and_free
from tests.support.waiting import HANG_S

CHOICES = ["alpha", "beta", "gamma"]


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path) -> Iterator[Stack]:
    # Context 512: room for the fallback tools prompt.
    with served(tiny_engine(tiny_llama_dir, max_model_len=512)) as s:
        yield s


@pytest.fixture()
def s(stack: Stack) -> Iterator[Stack]:
    yield stack
    wait_idle_and_free(stack.aeng)


@pytest.fixture()
def fail_sample_1(stack: Stack) -> Iterator[None]:
    """The runner reports the grammar of every request's sample 1 (`...#1`) as broken at
    its first sampled token."""
    runner = stack.aeng.engine.runner
    real = runner.execute

    def execute(so: Any) -> Any:
        out = real(so)
        for i, rid in enumerate(list(out.req_ids)):
            if rid.endswith("#1"):
                out.req_ids.pop(i)
                out.sampled_token_ids.pop(i)
                out.failed[rid] = "structured_outputs.choice: the grammar engine stopped: test"
        return out

    runner.execute = execute
    yield
    runner.execute = real


def _late_limit(s: Stack) -> dict:
    (x,) = s.aeng.tokenizer.encode("x")
    return {"structured_outputs": {"grammar": LATE_LIMIT}, "logit_bias": {str(x): 100},
            "temperature": 0, "max_tokens": 8}  # fmt: skip


def _post(s: Stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{s.url}{path}", json=body, timeout=HANG_S)


def _events(r: httpx.Response) -> list[Any]:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
            for line in r.text.splitlines() if line.startswith("data: ")]  # fmt: skip


def test_one_choice_that_fails_is_a_400_naming_the_field(s) -> None:
    r = _post(s, "/v1/completions", {"prompt": "Hello", **_late_limit(s)})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "structured_outputs.grammar", err
    assert err["message"].startswith("structured_outputs.grammar: the grammar engine stopped"), err


def test_several_choices_each_carry_their_own_outcome(s, fail_sample_1) -> None:
    body = {"prompt": "Hello", "n": 2, "max_tokens": 8, "seed": 1,
            "structured_outputs": {"choice": CHOICES}}  # fmt: skip
    r = _post(s, "/v1/completions", body)
    assert r.status_code == 200, r.text
    c0, c1 = r.json()["choices"]
    assert c0["finish_reason"] == "stop" and c0["text"] in CHOICES and c0["error"] is None
    assert c1["finish_reason"] == "error", c1
    assert c1["error"]["param"] == "structured_outputs.choice", c1
    assert c1["error"]["type"] == "invalid_request_error"


def test_several_prompts_are_several_choices(s) -> None:
    r = _post(s, "/v1/completions", {"prompt": ["Hello", "Hi"], **_late_limit(s)})
    assert r.status_code == 200, r.text
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["error", "error"]


def test_a_stream_marks_the_failed_choice_and_goes_on(s, fail_sample_1) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "max_tokens": 8,
            "seed": 1, "stream": True, "guided_choice": CHOICES}  # fmt: skip
    r = _post(s, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    events = _events(r)
    assert events[-1] == "[DONE]" and not any(
        "error" in e for e in events[:-1] if "choices" not in e
    )
    finishes = {c["index"]: c for e in events[:-1] for c in e["choices"] if c.get("finish_reason")}
    assert finishes[0]["finish_reason"] == "stop" and "error" not in finishes[0]
    assert finishes[1]["finish_reason"] == "error"
    assert finishes[1]["error"]["param"] == "guided_choice", finishes[1]


def test_a_forced_call_that_cannot_be_honored_is_a_400_naming_tools(s) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "^a{400000}$"}},
        "required": ["x"]}}}  # fmt: skip
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": [tool],
            "tool_choice": "required", "max_tokens": 8}  # fmt: skip
    r = _post(s, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools", r.text


def _generate(s: Stack, sampling: pb.SamplingParams) -> tuple[list[Any], grpc.StatusCode, Any]:
    async def call() -> tuple[list[Any], grpc.StatusCode, Any]:
        got: list[Any] = []
        async with grpc.aio.insecure_channel(s.grpc_address) as ch:
            try:
                async for r in pb_grpc.ApplianceStub(ch).Generate(
                    pb.GenerateRequest(text="Hello", sampling=sampling)
                ):
                    got.append(r)
            except grpc.aio.AioRpcError as e:
                return got, e.code(), e
        return got, grpc.StatusCode.OK, None

    return s.run(call())


def test_grpc_one_sample_ends_invalid_argument_after_its_error_response(s) -> None:
    (x,) = s.aeng.tokenizer.encode("x")
    sampling = pb.SamplingParams(temperature=0, max_tokens=8, grammar=LATE_LIMIT,
                                 logit_bias={x: 100.0})  # fmt: skip
    got, code, e = _generate(s, sampling)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, got
    assert field_violation(e) == "sampling.grammar"
    assert got and got[-1].finish_reason == "error"
    assert got[-1].error.startswith("sampling.grammar: the grammar engine stopped"), got[-1]


def test_grpc_several_samples_end_ok_with_the_failed_one_marked(s, fail_sample_1) -> None:
    sampling = pb.SamplingParams(n=2, max_tokens=8, seed=1, choice=pb.Choices(choices=CHOICES))
    got, code, _ = _generate(s, sampling)
    assert code == grpc.StatusCode.OK
    last = {r.index: r for r in got if r.finish_reason}
    assert last[0].finish_reason == "stop" and not last[0].error
    assert last[1].finish_reason == "error" and last[1].error.startswith("sampling.choice:")


def test_kserve_one_sample_is_invalid_argument(s) -> None:
    (x,) = s.aeng.tokenizer.encode("x")
    sampling = {"temperature": 0, "max_tokens": 8, "logit_bias": {str(x): 100},
                "guided_grammar": LATE_LIMIT}  # fmt: skip
    req = kpb.ModelInferRequest(model_name="tiny", id="1")
    for name, value in (
        ("text_input", b"Hello"),
        ("sampling_parameters", json.dumps(sampling).encode()),
    ):
        req.inputs.add(name=name, datatype="BYTES", shape=[1])
        req.raw_input_contents.append(encode_bytes([value]))

    async def call() -> tuple[grpc.StatusCode, str]:
        async with grpc.aio.insecure_channel(s.grpc_address) as ch:
            try:
                await kpb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req)
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details() or ""
        return grpc.StatusCode.OK, ""

    code, details = s.run(call())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert details.startswith("sampling_parameters.guided_grammar: the grammar engine"), details
