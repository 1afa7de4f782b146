"""The Responses API on the native gRPC service: `Respond` streams the same events as HTTP
(numbered, ending with the whole response), `GetResponse` / `DeleteResponse` read and
delete what it stored, another API key gets NOT_FOUND, and refusals are INVALID_ARGUMENT
naming the field, as HTTP's 400s do."""

from __future__ import annotations

import json

import grpc

from appliance.grpc.proto.appliance.v1 import appliance_pb2 as pb
from appliance.grpc.proto.appliance.v1 import appliance_pb2_grpc as pb_grpc
from tests.support.fake_engine import FakeLLMEngine
from tests.support.grpc_harness import start_harness

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "name": "get_weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]  # fmt: skip


def _meta(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def test_respond_get_delete_and_ownership():
    fake = FakeLLMEngine()
    fake.replies = [CALL, "It is 22 C."]
    h = start_harness(fake, api_keys=("key-a", "key-b"))

    async def main() -> None:
        async with h.channel() as ch:
            stub = pb_grpc.ApplianceStub(ch)
            body = {"model": "fake-model", "input": "Weather?", "tools": TOOLS}
            events = [e async for e in stub.Respond(
                pb.RespondRequest(body_json=json.dumps(body)), metadata=_meta("key-a"))]  # fmt: skip
            assert [e.sequence_number for e in events] == list(range(len(events)))
            assert events[0].type == "response.created" and events[-1].type == "response.completed"
            assert all(json.loads(e.event_json)["type"] == e.type for e in events)
            final = json.loads(events[-1].event_json)["response"]
            (call,) = final["output"]
            assert call["type"] == "function_call" and json.loads(call["arguments"]) == {
                "city": "Paris"
            }
            # continue it by id, with the tool's output
            body2 = {"model": "fake-model", "previous_response_id": final["id"], "tools": TOOLS,
                     "input": [{"type": "function_call_output", "call_id": call["call_id"],
                                "output": "22 C"}]}  # fmt: skip
            events2 = [e async for e in stub.Respond(
                pb.RespondRequest(body_json=json.dumps(body2)), metadata=_meta("key-a"))]  # fmt: skip
            second = json.loads(events2[-1].event_json)["response"]
            assert second["output"][0]["content"][0]["text"] == "It is 22 C."
            got = await stub.GetResponse(pb.ResponseRef(response_id=second["id"]),
                                         metadata=_meta("key-a"))  # fmt: skip
            assert json.loads(got.response_json) == second
            for call_ in (
                stub.GetResponse(pb.ResponseRef(response_id=second["id"]), metadata=_meta("key-b")),
                stub.DeleteResponse(
                    pb.ResponseRef(response_id=second["id"]), metadata=_meta("key-b")
                ),
            ):
                try:
                    await call_
                    raise AssertionError("another key read the response")
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.NOT_FOUND
            deleted = await stub.DeleteResponse(pb.ResponseRef(response_id=second["id"]),
                                                metadata=_meta("key-a"))  # fmt: skip
            assert deleted.deleted
            for body_json, field in (
                (json.dumps({"input": "x", "background": True}), "background"),
                (
                    json.dumps(
                        {
                            "input": [
                                {"type": "function_call_output", "call_id": "c9", "output": "1"}
                            ]
                        }
                    ),
                    "input.0.call_id",
                ),  # fmt: skip
                (json.dumps({"input": "x", "tools": [{"type": "web_search"}]}), "tools.0.type"),
                ("{not json", "body_json"),
            ):
                try:
                    [e async for e in stub.Respond(pb.RespondRequest(body_json=body_json),
                                                  metadata=_meta("key-a"))]  # fmt: skip
                    raise AssertionError(f"{body_json} was served")
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert e.details().startswith(f"{field}: "), e.details()
            try:
                [e async for e in stub.Respond(
                    pb.RespondRequest(body_json=json.dumps(
                        {"input": "x", "previous_response_id": "resp_gone"})),
                    metadata=_meta("key-a"))]  # fmt: skip
                raise AssertionError("an unknown previous response was served")
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.NOT_FOUND

    try:
        h.run(main())
    finally:
        h.close()
    assert len(fake.requests) == 2
