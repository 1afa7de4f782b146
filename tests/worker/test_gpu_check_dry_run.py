"""scripts/gpu_check.sh --dry-run: every phase of the GPU check on the CPU (tiny shapes, torch
backend), so a crash in the check is caught here before GPU time is spent (issue 14)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import bench.gpu_decode as gpu_decode

ROOT = Path(__file__).resolve().parents[2]
PHASES = [
    "setup",
    "jit",
    "backend",
    "graphs",
    "fidelity",
    "served",
    "kv",
    "decode",
    "fp8",
    "spec",
    "kvtier",
    "fp8kv",
]


def _check(out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "OUT": str(out), "PY": sys.executable, **env}
    full.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "--dry-run", *args],
                          cwd=ROOT, env=full, capture_output=True, text=True, timeout=600)  # fmt: skip


def test_dry_run_passes_every_phase_and_reports_each(tmp_path):
    proc = _check(tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["ok"] and sorted(report["phases"]) == sorted(PHASES)
    assert all(p["status"] == "ok" for p in report["phases"].values())
    res = {name: p.get("result", {}) for name, p in report["phases"].items()}
    assert res["jit"]["modules"] == [
        "decode-bfloat16-d128", "prefill-fa2-bfloat16-d128", "prefill-fa2-paged-bfloat16-d128"
    ]  # fmt: skip
    assert res["served"]["health"] == 200 and res["served"]["grpc_completion_tokens"] == 4
    assert res["kv"]["top_p_step"].startswith("ok")
    assert res["kv"]["engine_decode_b1"]["steps"] >= 1  # the engine's loop on the same runner
    assert res["kv"]["engine_decode_b64"]["steps"] >= 1
    assert {"decode_eager_b1", "decode_graphs_b4"} <= set(res["decode"])
    assert "errors" not in res["decode"]
    kv8 = res["fp8"]["kv_pages"]  # fp8 KV pages, on the stand-in flashinfer in the dry run
    assert "errors" not in res["fp8"] and kv8["backend"] == "flashinfer"
    assert kv8["modules"] == [
        "decode-bfloat16-kv-float8_e4m3fn-d128", "prefill-fa2-bfloat16-kv-float8_e4m3fn-d128",
        "prefill-fa2-paged-bfloat16-kv-float8_e4m3fn-d128",
    ]  # fmt: skip
    assert kv8["bytes_per_block"]["bfloat16"] == 2 * kv8["bytes_per_block"]["float8_e4m3fn"]
    assert kv8["planned_kv_dtypes"] == ["bfloat16", "float8_e4m3fn"]
    assert kv8["teacher_forced"]["positions"] == 8 * (2 + 32)
    assert set(kv8["fp8_over_bf16"]) == {"eager_b1", "eager_b4", "graphs_b1", "graphs_b4"}
    lin = res["fp8"]["linears"]  # the fp8-linears part ran after it
    assert lin["exact_rel_err"] <= 2.0**-7 and lin["fp8_linears"] > 0
    assert set(lin["layers"]) == {f"{n}_m{m}" for n in ("qkv", "down") for m in (1, 8, 64)}
    assert {"bf16_us", "fp8_us", "quant_us", "scaled_mm_us"} <= set(lin["layers"]["qkv_m1"])
    assert "replay_ms" in lin["fp8_graphs_b1"] and "replay_ms" in lin["bf16_graphs_b4"]
    assert lin["fidelity"]["positions"] == 4 * 4 and "graphs_b1_replay" in lin["fp8_over_bf16"]
    assert res["spec"]["ngram"]["equal"] == res["spec"]["ngram"]["of"] == 16
    assert res["spec"]["draft"]["accepted"] > 0
    log = (tmp_path / "gpu_check.log").read_text()
    assert all(f"phase {p}: exit 0" in log for p in PHASES)


def test_a_phase_out_of_budget_fails_the_check(tmp_path):
    proc = _check(tmp_path, "--only", "setup", GPU_CHECK_BUDGET="1")
    assert proc.returncode == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["phases"]["setup"]["status"] == "timeout" and not report["ok"]


def test_unknown_phase_is_refused(tmp_path):
    assert _check(tmp_path, "--only", "setup,warp").returncode == 2


def test_gpu_decode_exits_nonzero_when_a_measurement_raises(tmp_path, monkeypatch, capsys):
    """Defect 1: an error used to be stored in the JSON with exit status 0."""

    def broken(*args, **kwargs):
        raise TypeError("select_attention_backend() missing 1 required positional argument")

    monkeypatch.setattr(gpu_decode, "bench_decode", broken)
    out = tmp_path / "decode.json"
    assert gpu_decode.main(["--smoke", "--device", "cpu", "--out", str(out)]) == 1
    assert "TypeError" in json.loads(out.read_text())["errors"]["decode"]
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize("fails", [False, True])
def test_run_parts_returns_the_parts_that_raised(fails):
    def part():
        if fails:
            raise RuntimeError("boom")

    res: dict = {}
    assert gpu_decode.run_parts({"p": part}, res) == (["p"] if fails else [])
    assert ("errors" in res) == fails


def test_a_failing_fp8_part_is_recorded_and_fails_the_phase_after_the_other_ran(
    tmp_path, monkeypatch
):
    import bench.gpu_fp8_kv as gpu_fp8_kv
    import bench.gpu_phases as gpu_phases

    def broken(model, dev, dry, save, res):
        res["modules"] = ["measured before the error"]
        raise RuntimeError("fp8 pages moved the reference token's log-prob by 2.4")

    monkeypatch.setattr(gpu_fp8_kv, "fp8_kv_check", broken)
    assert gpu_phases.main(["fp8", "--work", str(tmp_path), "--dry-run"]) == 1
    res = json.loads((tmp_path / "fp8.json").read_text())
    assert "log-prob by 2.4" in res["errors"]["kv_pages"]
    assert res["kv_pages"]["modules"] == ["measured before the error"]
    assert "exact_rel_err" in res["linears"] and "linears" not in res["errors"]


def test_fp8_linears_off_their_operands_fail_the_phase_after_measuring(tmp_path, monkeypatch):
    """An Fp8Linear that disagrees with its own operands' fp32 product (a transposed weight,
    a scale on the wrong axis) fails the phase, with the figures measured kept."""
    import bench.gpu_fp8_linears as gpu_fp8_linears
    import bench.gpu_phases as gpu_phases

    monkeypatch.setattr(gpu_fp8_linears, "exactness", lambda dev, dry: 0.5)
    assert gpu_phases.main(["fp8", "--work", str(tmp_path), "--dry-run"]) == 1
    res = json.loads((tmp_path / "fp8.json").read_text())
    assert "wrong layout or scale axis" in res["errors"]["linears"]
    assert "fp8_graphs_b1" in res["linears"] and "errors" not in res["kv_pages"]


def test_a_failing_engine_loop_keeps_the_kv_figures_and_fails_the_phase(tmp_path, monkeypatch):
    """The kv phase's engine-loop timing is a part: when it raises, KV sizing's figures are
    still written and the phase exits 1 with the error recorded."""
    import bench.gpu_phases as gpu_phases

    def broken(*args, **kwargs):
        raise RuntimeError("a decode step lost a request")

    monkeypatch.setattr(gpu_phases, "engine_loop", broken)
    assert gpu_phases.main(["kv", "--work", str(tmp_path), "--dry-run"]) == 1
    res = json.loads((tmp_path / "kv.json").read_text())
    assert res["kv_blocks"] > 0 and res["top_p_step"].startswith("ok")
    assert "lost a request" in res["errors"]["engine_decode_b1"]
