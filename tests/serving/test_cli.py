"""The `appliance` command: config show, config errors, generate, serve + SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import yaml

from appliance.cli import main
from tests.support.waiting import HANG_S

ROOT = Path(__file__).resolve().parents[2]


def _tiny_sets(model_dir: Path) -> list[str]:
    sets = [
        f"model.path={model_dir}",
        "model.max_model_len=128",
        "cache.num_kv_blocks=32",
        "runtime.device=cpu",
        "runtime.num_threads=1",
    ]
    return [a for s in sets for a in ("--set", s)]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def test_config_show_prints_the_effective_config(capsys, monkeypatch):
    monkeypatch.setenv("APPLIANCE_SERVER__HTTP_PORT", "9100")
    assert main(["config", "show", "--set", "scheduler.max_num_seqs=5"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["scheduler"]["max_num_seqs"] == 5
    assert shown["server"]["http_port"] == 9100
    assert shown["graphs"]["cuda_graphs"] is True


def test_bad_config_exits_2_naming_the_key(capsys):
    assert main(["config", "show", "--set", "cache.block_size=3"]) == 2
    assert "cache.block_size: must be a power of two" in capsys.readouterr().err


def test_serve_refuses_to_start_when_one_max_length_request_cannot_fit_the_kv_cache(
    tiny_llama_dir,
):
    # 8 blocks of 16 tokens; one 512-token request needs ceil(511 / 16) = 32.
    sets = [f"model.path={tiny_llama_dir}", "model.max_model_len=512", "cache.num_kv_blocks=8",
            "runtime.device=cpu", "runtime.num_threads=1", "server.http_port=0",
            "server.grpc_port=null"]  # fmt: skip
    r = subprocess.run(
        [sys.executable, "-m", "appliance", "serve", *(a for s in sets for a in ("--set", s))],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=HANG_S,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert (
        "appliance: config error: cache.num_kv_blocks: cache.num_kv_blocks=8 gives 8 KV blocks "
        "of 16 tokens, but one model.max_model_len=512 request needs 32"
    ) in r.stderr


def test_python_dash_m_appliance_runs():
    r = subprocess.run(
        [sys.executable, "-m", "appliance", "config", "show"],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=HANG_S,
    )  # fmt: skip
    assert r.returncode == 0 and "scheduler:" in r.stdout


def test_generate_prints_a_completion(tiny_llama_dir):
    r = subprocess.run(
        [sys.executable, "-m", "appliance", "generate", "Hello", "--max-tokens", "4",
         *_tiny_sets(tiny_llama_dir)],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=HANG_S,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n") and r.stdout.strip()


def test_serve_logs_startup_and_exits_0_on_sigterm_after_finishing_in_flight(tiny_llama_dir):
    proc = subprocess.Popen(
        [sys.executable, "-m", "appliance", "serve", *_tiny_sets(tiny_llama_dir),
         "--set", "server.http_port=0", "--set", "server.grpc_port=null",
         "--set", f"server.shutdown_grace_s={HANG_S}", "--set", "telemetry.log_format=json"],
        stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
    )  # fmt: skip
    lines: list[dict] = []
    port_seen = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            lines.append(rec)
            if rec.get("msg") == "http listening":
                port_seen.set()

    t = threading.Thread(target=read, daemon=True)
    t.start()
    try:
        assert port_seen.wait(HANG_S), lines
        port = next(r["port"] for r in lines if r.get("msg") == "http listening")
        ready = next(r for r in lines if r.get("msg") == "engine ready")
        assert ready["device"] == "cpu" and ready["kv_blocks"] == 32 and ready["model"]
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/health").status_code == 200
        body = {"prompt": "hi", "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=HANG_S) as r:
            it = r.iter_lines()
            next(it)
            proc.send_signal(signal.SIGTERM)
            rest = list(it)
        assert "data: [DONE]" in rest
        events = [json.loads(x[6:]) for x in rest if x.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(HANG_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    t.join(HANG_S)  # the reader ends at EOF: every line is in
    assert any(r.get("msg") == "shutdown requested" for r in lines)
    assert not any("prompt" in r or "output" in r for r in lines)  # log_prompts is off
