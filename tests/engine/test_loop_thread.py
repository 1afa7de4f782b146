"""The engine is built on the thread that then steps it (engine/loop_thread.py): no OpenMP
pool is left on another thread to slow the stepping thread's kernels down."""

from __future__ import annotations

import threading

import pytest

from engine.loop_thread import BuiltOnThread


def test_the_value_is_built_and_the_loop_run_on_one_thread():
    seen: dict[str, int] = {}
    done = threading.Event()

    def build() -> str:
        seen["build"] = threading.get_ident()
        return "engine"

    loop = BuiltOnThread("t", build)
    assert loop.value == "engine" and seen["build"] != threading.get_ident()

    def run() -> None:
        seen["run"] = threading.get_ident()
        done.set()

    loop.run(run)
    assert done.wait(30)
    assert seen["run"] == seen["build"] == loop.thread.ident


def test_a_failed_build_raises_in_the_caller_and_the_thread_ends():
    def build() -> None:
        raise ValueError("bad model path")

    with pytest.raises(ValueError, match="bad model path"):
        BuiltOnThread("t", build)


def test_run_none_lets_the_thread_exit():
    loop = BuiltOnThread("t", lambda: 1)
    loop.run(None)
    loop.thread.join(30)
    assert not loop.thread.is_alive()
