"""The openai SDK's async client on the fake engine, in process (httpx's ASGI transport): what
the route suites that script the engine's answers share (no tests)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import openai

from appliance.config import ServerConfig
from appliance.http.app import build_app
from engine.async_engine import AsyncEngine
from tests.support.fake_engine import FakeLLMEngine
from tests.support.waiting import HANG_S


def run_with_fake(
    fn: Callable[[openai.AsyncOpenAI, FakeLLMEngine], Awaitable[Any]],
    replies: list[str],
    server: ServerConfig | None = None,
    **app_kw: Any,
) -> Any:
    """`fn(client, fake)` against an app on a fake engine that answers `replies` in order;
    `app_kw` go to `build_app`."""

    async def main() -> Any:
        fake = FakeLLMEngine()
        fake.replies = list(replies)
        aeng = AsyncEngine(fake)
        app = build_app(aeng, server or ServerConfig(), **app_kw)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/v1")
        client = openai.AsyncOpenAI(
            base_url="http://t/v1", api_key="x", http_client=http, max_retries=0
        )
        try:
            return await fn(client, fake)
        finally:
            await http.aclose()
            await aeng.shutdown()

    return asyncio.run(asyncio.wait_for(main(), HANG_S))


def prompt_text(fake: FakeLLMEngine, i: int) -> str:
    """The i-th engine request's prompt, as text."""
    return fake.tokenizer.decode(fake.requests[i].ids)
