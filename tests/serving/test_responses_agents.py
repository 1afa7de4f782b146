"""The OpenAI Agents SDK against a real `appliance serve` (the tiny checkpoint, its ChatML
template): an agent with one function tool, run through the SDK's default model provider,
whose default model class speaks the Responses API. `tool_choice: required` makes the
grammar engine enforce the call, so the random model's call is well formed and its
arguments validate against the tool's schema; the run then goes back to the server with
the tool's output (a `function_call_output` item) for the final answer. The test asserts
structure (items, arguments, the server's stored responses), not the model's wording."""

from __future__ import annotations

import asyncio
from typing import Literal

import httpx
import pydantic
import pytest

from tests.support.served_stack import spawn_serve, tiny_serve_sets
from tests.support.waiting import HANG_S

agents = pytest.importorskip("agents")


class Answer(pydantic.BaseModel):
    weather: Literal["sunny", "rainy"]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    # The tools' fallback system prompt is long in the tiny tokenizer: a longer context.
    model_dir = tiny_checkpoint("llama", max_position_embeddings=2048)
    store = tmp_path_factory.mktemp("responses") / "store.sqlite3"
    sp = spawn_serve(
        ["serve", *tiny_serve_sets(model_dir, grpc=False,
                                   **{"responses.store_path": str(store), "model.max_model_len": 2048})]
    )  # fmt: skip
    try:
        yield sp
    finally:
        sp.kill()


def test_an_agent_calls_its_function_tool_through_the_responses_api(server):
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
    from agents.items import ToolCallItem, ToolCallOutputItem
    from agents.models.openai_provider import OpenAIProvider
    from openai import AsyncOpenAI

    calls: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "London", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    async def main():
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        agent = Agent(
            name="weather",
            instructions="Answer with the weather tool.",
            tools=[get_weather],
            model="tiny",
            # One forced call, then an answer of the output type: both are grammars that end
            # (EOS), however random the model.
            output_type=Answer,
            model_settings=ModelSettings(
                tool_choice="required", parallel_tool_calls=False, max_tokens=200, temperature=0
            ),
        )
        config = RunConfig(model_provider=OpenAIProvider(openai_client=client),
                           tracing_disabled=True)  # fmt: skip
        try:
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=3,
                                    run_config=config)  # fmt: skip
        finally:
            await client.close()

    result = asyncio.run(asyncio.wait_for(main(), HANG_S))
    assert len(calls) == 1 and calls[0] in ("Paris", "London", "Rome")
    (call,) = [i for i in result.new_items if isinstance(i, ToolCallItem)]
    (output,) = [i for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    assert call.raw_item.name == "get_weather" and call.raw_item.call_id.startswith("call_")
    assert output.output == f"It is sunny in {calls[0]}."
    assert isinstance(result.final_output, Answer)
    # two model calls, both answered by the Responses route and stored
    responses = [r.response_id for r in result.raw_responses]
    assert len(responses) == 2 and all(r.startswith("resp_") for r in responses)
    for rid in responses:
        got = httpx.get(f"{server.url}/v1/responses/{rid}", timeout=HANG_S).json()
        assert got["id"] == rid and got["status"] == "completed"
    second = httpx.get(f"{server.url}/v1/responses/{responses[1]}/input_items",
                       params={"order": "asc"}, timeout=HANG_S).json()  # fmt: skip
    kinds = [i["type"] for i in second["data"]]
    assert kinds == ["message", "function_call", "function_call_output"]
    assert second["data"][2]["call_id"] == call.raw_item.call_id
