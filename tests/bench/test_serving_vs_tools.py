"""The pieces of bench/serving_vs.py that decide what is compared: arrival times, the summary
of a run, the two servers' command lines, and the table. No server is started here."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from bench import plot_serving_vs
from bench.servers import ServerSettings, ours_command, vllm_command
from bench.serving_stats import Sample, poisson_offsets, run_arrivals, summarize

SETTINGS = ServerSettings(model="/m", dtype="bfloat16", kv_cache_gib=3, threads=2,
                          max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=2048)  # fmt: skip


def test_poisson_offsets_are_seeded_start_at_zero_and_average_one_over_rate():
    a = poisson_offsets(2001, 4.0, seed=7)
    assert a == poisson_offsets(2001, 4.0, seed=7)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:], strict=False))
    assert a[-1] / 2000 == pytest.approx(0.25, rel=0.1)
    assert poisson_offsets(3, math.inf, seed=0) == [0.0, 0.0, 0.0]


def test_run_arrivals_sends_each_prompt_no_earlier_than_its_offset_without_waiting():
    sent: dict[str, float] = {}

    async def main() -> tuple[list[Sample], float, float]:
        loop = asyncio.get_running_loop()
        last_sent = asyncio.Event()

        async def request(prompt: str) -> Sample:
            sent[prompt] = loop.time()
            if prompt == "c":
                last_sent.set()
            else:  # answered only once the last one is out: a closed loop would hang here
                await asyncio.wait_for(last_sent.wait(), 30)
            return Sample(ok=True, tokens=1)

        t0 = loop.time()
        samples, wall = await run_arrivals(request, ["a", "b", "c"], [0.0, 0.05, 0.1])
        return samples, wall, t0

    samples, wall, t0 = asyncio.run(main())
    assert len(samples) == 3 and all(s.ok for s in samples)
    for prompt, offset in zip("abc", (0.0, 0.05, 0.1), strict=True):
        assert sent[prompt] - t0 >= offset - 0.005
    assert wall >= 0.1


def test_summarize_tpot_does_not_depend_on_how_tokens_are_packed_into_chunks():
    burst = Sample(ok=True, ttft=0.1, e2e=0.5, tokens=5, itls=[0.0, 0.0, 0.4], last=0.5)
    even = Sample(ok=True, ttft=0.1, e2e=0.5, tokens=5, itls=[0.1, 0.1, 0.1, 0.1], last=0.5)
    b, e = summarize([burst], 1.0), summarize([even], 1.0)
    assert b["tpot_ms"]["p50"] == e["tpot_ms"]["p50"] == 100.0
    assert b["itl_ms"]["p50"] == 0.0 and e["itl_ms"]["p50"] == 100.0
    assert b["tokens_per_chunk"] == 1.25 and e["tokens_per_chunk"] == 1.0


def test_both_servers_get_the_same_settings():
    ours, ours_env = ours_command(SETTINGS, 8123)
    vllm, vllm_env = vllm_command("/venv/bin/python", SETTINGS, 8124)
    for flag in ("model.dtype=bfloat16", "cache.cpu_kv_cache_gib=3", "runtime.num_threads=2",
                 "scheduler.max_num_seqs=256", "scheduler.max_num_batched_tokens=2048",
                 "model.max_model_len=2048", "model.served_name=bench", "server.http_port=8123"):  # fmt: skip
        assert flag in ours
    pairs = dict(zip(vllm[3::2], vllm[4::2], strict=False))
    assert vllm[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert {k: pairs[k] for k in ("--dtype", "--max-num-seqs", "--max-num-batched-tokens",
            "--max-model-len", "--served-model-name", "--port")} == {
        "--dtype": "bfloat16", "--max-num-seqs": "256", "--max-num-batched-tokens": "2048",
        "--max-model-len": "2048", "--served-model-name": "bench", "--port": "8124"}  # fmt: skip
    assert vllm_env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert vllm_env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert ours_env["OMP_NUM_THREADS"] == vllm_env["OMP_NUM_THREADS"] == "2"


def _row(engine: str, rate: object, tok_s: float, run_id: str = "r1") -> dict:
    pcts = {"p50": 10.0, "p90": 20.0, "p99": 30.0}
    return {
        "bench": "serving_vs", "run_id": run_id, "quick": False, "date": "2026-11-30T10:00:00",
        "model": "llama50m", "dtype": "float32", "engine": engine, "rate": rate, "ok": True,
        "max_tokens": 64, "workload": {"num_requests": 48, "prompt_len_min": 32,
                                       "prompt_len_max": 256},
        "settings": {**SETTINGS.as_dict(), "binding": {"vllm": "VLLM_CPU_OMP_THREADS_BIND=0-1"},
                     "prefix_caching": "on"},
        "machine": {"cores": 2, "cpu": "X", "isa": "avx512f"}, "req_per_s": 1.0,
        "output_tok_per_s": tok_s, "ttft_ms": pcts, "itl_ms": pcts, "tpot_ms": pcts,
        "e2e_ms": pcts, "other_cores": 0.0,
    }  # fmt: skip


def test_table_takes_the_latest_run_orders_rates_with_inf_last_and_divides_ours_by_vllm(
    tmp_path, monkeypatch
):
    rows = [_row("ours", 4.0, 999.0, run_id="old"), _row("ours", "inf", 300.0),
            _row("vllm", "inf", 200.0), _row("ours", 4.0, 100.0), _row("vllm", 4.0, 50.0)]  # fmt: skip
    src = tmp_path / "serving_vs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(plot_serving_vs, "SOURCE", src)
    table = [line for line in plot_serving_vs.table_md() if line.startswith("| llama50m")]
    assert [line.split(" | ")[2:4] for line in table] == [
        ["4", "ours"], ["4", "vllm"], ["inf", "ours"], ["inf", "vllm"]]  # fmt: skip
    assert table[0].endswith("| 2.00 |") and table[2].endswith("| 1.50 |")
    assert table[1].endswith("|  |")


def test_a_failed_servers_first_exception_is_found_above_the_reraises(tmp_path):
    import types

    from bench.servers import Server

    log = tmp_path / "server.log"
    log.write_text(
        "WARNING [utils.py:255] errors like `OSError: [Errno 24] Too many open files`. Fix it\n"
        '  File "/venv/vllm/worker.py", line 69, in _init_worker\n'
        "(Worker pid=1) ERROR [executor.py:1063] Exception: CPU Offloading is only on GPUs\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    fake = types.SimpleNamespace(log=types.SimpleNamespace(name=str(log)))
    assert Server.first_exception(fake) == "Exception: CPU Offloading is only on GPUs"
    log.write_text("nothing went wrong\n")
    assert Server.first_exception(fake) is None
