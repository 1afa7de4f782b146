"""KServe v2 / Triton compatibility, driven by the real `tritonclient[grpc]` client.

Requests follow Triton's vLLM backend convention (text_input, stream, sampling_parameters
in; text_output out). tritonclient (a dev dependency) is blocking, so it runs on the test
thread while the server runs on the harness loop.
"""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.support.grpc_harness import (
    PROMPTS,
    Harness,
    offline_greedy,
    start_harness,
    tiny_llm_engine,
)
from tests.support.waiting import HANG_S, StepGate, wait_for

MODEL = "tiny"
MAX_TOKENS = 10
GREEDY = {"temperature": "0", "max_tokens": str(MAX_TOKENS), "ignore_eos": "true"}


@pytest.fixture(scope="module")
def served(
    tiny_llama_dir: Path,
) -> Iterator[tuple[Harness, list, grpcclient.InferenceServerClient]]:
    llm_engine = tiny_llm_engine(tiny_llama_dir)
    expected = offline_greedy(llm_engine, PROMPTS, MAX_TOKENS)
    h = start_harness(llm_engine, model_name=MODEL)
    client = grpcclient.InferenceServerClient(url=h.address)
    yield h, expected, client
    client.close()
    h.close()


def _inputs(prompt: str, stream: bool, sampling: dict | None = None, **flags: bool) -> list:
    def tensor(name: str, datatype: str, value) -> grpcclient.InferInput:
        t = grpcclient.InferInput(name, [1], datatype)
        t.set_data_from_numpy(np.array([value], dtype=object if datatype == "BYTES" else bool))
        return t

    out = [tensor("text_input", "BYTES", prompt.encode()), tensor("stream", "BOOL", stream)]
    if sampling is not None:
        out.append(tensor("sampling_parameters", "BYTES", json.dumps(sampling).encode()))
    out += [tensor(name, "BOOL", value) for name, value in flags.items()]
    return out


def _stream(client, requests: list[tuple[str, list]], **kw) -> dict[str, list]:
    """Sends every (id, inputs) on one ModelStreamInfer stream; results (or errors) by id."""
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    for rid, inputs in requests:
        client.async_stream_infer(MODEL, inputs, request_id=rid, **kw)
    client.stop_stream()  # half-closes, then waits for the server to finish them all
    by_id: dict[str, list] = {rid: [] for rid, _ in requests}
    while not results.empty():
        result, error = results.get()
        if error is not None:
            by_id.setdefault("errors", []).append(error)
        else:
            by_id[result.get_response().id].append(result)
    return by_id


def _text(result, name: str = "text_output") -> list[str]:
    return [x.decode() for x in result.as_numpy(name)]


def test_health_and_metadata_answer_like_triton(served) -> None:
    h, _, client = served
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, "1")
    assert not client.is_model_ready("nope")
    meta = client.get_model_metadata(MODEL, as_json=True)
    assert meta["name"] == MODEL and meta["versions"] == ["1"]
    assert {i["name"]: i["datatype"] for i in meta["inputs"]}["text_input"] == "BYTES"
    assert [o["name"] for o in meta["outputs"]][0] == "text_output"
    assert client.get_server_metadata(as_json=True)["name"] == "appliance"
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("nope")
    assert "NOT_FOUND" in str(info.value.status())


def test_model_stream_infer_streams_interleaved_requests_matched_by_id(served) -> None:
    _, expected, client = served
    by_id = _stream(
        client,
        [
            (f"r{i}", _inputs(p, True, GREEDY, return_finish_reason=True,
                              return_num_output_tokens=True))
            for i, p in enumerate(PROMPTS)
        ],
    )  # fmt: skip
    assert "errors" not in by_id
    for i, (ids, text) in enumerate(expected):
        results = by_id[f"r{i}"]
        assert len(results) > 1  # one per step, not one blob
        assert "".join(_text(r)[0] for r in results) == text
        assert sum(int(r.as_numpy("num_output_tokens")[0]) for r in results) == len(ids)
        assert [_text(r, "finish_reason")[0] for r in results][-1] == "length"


def test_non_streaming_requests_return_prompt_plus_text_unless_excluded(served) -> None:
    _, expected, client = served
    by_id = _stream(client, [
        ("whole", _inputs(PROMPTS[0], False, GREEDY)),
        ("bare", _inputs(PROMPTS[0], False, GREEDY, exclude_input_in_output=True)),
    ])  # fmt: skip
    assert [_text(r)[0] for r in by_id["whole"]] == [PROMPTS[0] + expected[0][1]]
    assert [_text(r)[0] for r in by_id["bare"]] == [expected[0][1]]
    unary = client.infer(MODEL, _inputs(PROMPTS[1], False, GREEDY), request_id="u1")
    assert _text(unary) == [PROMPTS[1] + expected[1][1]]
    assert unary.get_response().id == "u1"


def test_errors_arrive_in_the_stream_and_the_stream_goes_on(served) -> None:
    _, expected, client = served
    by_id = _stream(client, [
        ("bad-temp", _inputs("hi", True, {"temperature": -2})),
        ("bad-key", _inputs("hi", True, {"beam_width": 2})),
        ("good", _inputs(PROMPTS[0], True, GREEDY)),
    ])  # fmt: skip
    messages = sorted(e.message() for e in by_id["errors"])
    assert messages[0].startswith("sampling_parameters.beam_width:")
    assert messages[1].startswith("sampling_parameters.temperature:")
    assert "".join(_text(r)[0] for r in by_id["good"]) == expected[0][1]
    with pytest.raises(InferenceServerException) as info:
        client.infer("nope", _inputs("hi", False, GREEDY))
    assert "NOT_FOUND" in str(info.value.status())
    with pytest.raises(InferenceServerException) as info:
        client.infer(MODEL, _inputs("hi", False, {"top_p": "zero"}))
    assert "INVALID_ARGUMENT" in str(info.value.status())
    assert "sampling_parameters.top_p" in info.value.message()


def test_empty_final_response_flag_marks_only_the_last_response(served) -> None:
    _, _, client = served
    by_id = _stream(client, [("f", _inputs(PROMPTS[1], True, GREEDY))],
                    enable_empty_final_response=True)  # fmt: skip
    flags = [r.get_response().parameters["triton_final_response"].bool_param for r in by_id["f"]]
    assert flags == [False] * (len(flags) - 1) + [True]


def test_cancelling_the_stream_aborts_its_requests_and_frees_their_blocks(served) -> None:
    h, _, client = served
    before = h.engine.stats().num_free_blocks
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    long = {**GREEDY, "max_tokens": "400"}
    with StepGate(h.engine.engine) as gate:  # held until both are in: then one step, no more
        for rid in ("c1", "c2"):
            client.async_stream_infer(MODEL, _inputs(PROMPTS[0], True, long), request_id=rid)
        wait_for(lambda: h.engine.num_in_flight == 2, "both requests in the engine")
        gate.allow(1)
        results.get(timeout=HANG_S)
        wait_for(lambda: h.engine.stats().num_free_blocks < before, "the requests holding blocks")
        client.stop_stream(cancel_requests=True)
        wait_for(
            lambda: h.engine.num_in_flight == 0 and h.engine.stats().num_free_blocks == before,
            "both requests aborted and their blocks freed",
        )
