"""`appliance serve` at tensor_parallel_size 2 (rank 0 in the server process, one worker
process, gloo), as a user starts it.

- It answers the official `openai` client, plain and streamed, with the same greedy text as
  the offline engine at TP=1; SIGTERM drains, exits 0 and stops the worker.
- A worker killed with SIGKILL while a request is in flight turns the engine unhealthy:
  the server exits 3 (so a supervisor restarts it) with the rank named in its log, rather
  than hang or answer 503 forever. The request is held by a step gate
  (`tests.support.fault_launcher`), so it is in flight by construction when the kill lands.
- The server killed with SIGKILL takes its worker with it (the worker watches its parent).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import openai

from engine import LLM, SamplingParams
from tests.support.processes import is_running
from tests.support.served_stack import ServeProcess, gauges, spawn_serve, tiny_serve_sets
from tests.support.waiting import HANG_S, wait_for

PROMPT = "Once upon a time"
TP2 = {"parallel.tensor_parallel_size": 2, "model.dtype": "float32"}


def _serve(model_dir: Path, *launcher: str, **sets: Any) -> tuple[ServeProcess, int]:
    """The server (through `launcher`, e.g. the fault launcher's gate) and its worker's pid."""
    args = [*launcher, "serve", *tiny_serve_sets(model_dir, grpc=False, **TP2, **sets)]
    module = "tests.support.fault_launcher" if launcher else "appliance"
    sp = spawn_serve(args, module=module)
    (started,) = sp.logged("tensor-parallel workers started")
    (pid,) = started["pids"]
    return sp, pid


def test_served_tp2_answers_the_openai_client_and_sigterm_stops_every_rank(
    tiny_llama_dir,
) -> None:
    with LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128) as tp1:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        expected = tp1.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text
    sp, worker = _serve(tiny_llama_dir)
    try:
        client = openai.OpenAI(base_url=f"{sp.url}/v1", api_key="unused", max_retries=0)
        greedy = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
        done = client.completions.create(model="tiny", prompt=PROMPT, **greedy)
        assert done.choices[0].text == expected and done.usage.completion_tokens == 12
        chunks = client.completions.create(model="tiny", prompt=PROMPT, stream=True, **greedy)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], **greedy
        )
        assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 12
        assert httpx.get(f"{sp.url}/health", timeout=HANG_S).status_code == 200
        sp.proc.send_signal(signal.SIGTERM)
        code = sp.proc.wait(HANG_S)
    finally:
        sp.kill()
    assert code == 0, sp.records[-5:]
    assert sp.logged("tensor-parallel workers stopped")
    assert not is_running(worker)


def _stream(url: str, results: dict) -> None:
    body = {"prompt": PROMPT, "max_tokens": 50, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=HANG_S) as r:
            results["body"] = "".join(r.iter_text())
    except httpx.HTTPError as e:  # cut when the server goes down
        results["body"] = f"cut: {e!r}"


def test_a_worker_killed_mid_request_makes_serve_exit_3(tiny_llama_dir, tmp_path) -> None:
    gate = tmp_path / "steps"
    gate.write_text("1")  # one step: the request starts generating, then is held
    sp, worker = _serve(tiny_llama_dir, "gate", str(gate), "--")
    results: dict[str, str] = {}
    client = threading.Thread(target=_stream, args=(sp.url, results))
    try:
        client.start()
        wait_for(lambda: gauges(sp.url)["appliance_requests_running"] == 1, "request running")
        os.kill(worker, signal.SIGKILL)
        code = sp.proc.wait(HANG_S)
        client.join(HANG_S)
    finally:
        sp.kill()
    assert code == 3, sp.records[-5:]
    (died,) = sp.logged("engine died; shutting down")
    assert "rank 1" in died["reason"] and "SIGKILL" in died["reason"], died
    # Held after its first token, it cannot have finished: it was cut or ended in an error.
    assert '"finish_reason":"length"' not in results["body"], results


def test_a_killed_server_takes_its_worker_with_it(tiny_llama_dir) -> None:
    sp, worker = _serve(tiny_llama_dir)
    try:
        sp.proc.kill()  # SIGKILL: no clean-up runs in the server
        sp.proc.wait(HANG_S)
        wait_for(lambda: not is_running(worker), "the worker to exit after its parent")
    finally:
        sp.kill()
        if is_running(worker):
            os.kill(worker, signal.SIGKILL)
