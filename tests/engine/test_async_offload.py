"""AsyncEngine keeps input-sized and blocking admission work off the event loop (issue 28).

B6: a request's grammar is compiled while it is admitted, which may block for seconds (a
slow compile, llguidance's tokenizer built on first use). A compile held by a stand-in
must leave another request's stream flowing on the same event loop: proven by the order
of events (a delta of the other stream arrives while the compile is held), never by time.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from engine import SamplingParams, StructuredOutputsParams
from engine.async_engine import AsyncEngine
from tests.support.served_stack import tiny_engine
from tests.support.waiting import HANG_S, StepGate

# A held compile gives up after this long so that a broken run fails instead of hanging;
# a healthy run releases it at once (a hang guard, not a verdict).
GUARD_S = 20.0


def test_a_blocked_grammar_compile_leaves_other_streams_flowing(tiny_llama_dir: Path) -> None:
    eng = tiny_engine(tiny_llama_dir)
    events: list[str] = []
    started, release = threading.Event(), threading.Event()
    real = eng.grammars.compile

    def held_compile(spec):
        events.append("compile started")
        started.set()
        release.wait(GUARD_S)
        events.append("compile finished")
        return real(spec)

    eng.grammars.compile = held_compile
    gate = StepGate(eng, permits=None, hold_while=lambda: not started.is_set())  # A waits
    aeng = AsyncEngine(eng)

    async def main() -> None:
        free = await aeng.add_request("Hello", SamplingParams(max_tokens=40, ignore_eos=True))
        spec = StructuredOutputsParams(regex="[a-z]+")
        constrained = asyncio.ensure_future(
            aeng.add_request("Hi", SamplingParams(max_tokens=4, structured_outputs=spec))
        )
        async for _ in free:
            events.append("other stream delta")
            release.set()
            break
        free.abort()
        stream = await constrained
        async for _ in stream:
            pass

    try:
        asyncio.run(asyncio.wait_for(main(), HANG_S))
    finally:
        release.set()
        gate.remove()
        asyncio.run(aeng.shutdown())
    assert events[:3] == ["compile started", "other stream delta", "compile finished"], events
