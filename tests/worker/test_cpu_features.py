"""The native-bf16 rule on fake /proc/cpuinfo texts: never on this machine's own flags."""

from __future__ import annotations

import pytest

from engine.worker import cpu_features
from engine.worker.cpu_features import CpuFeatures, detect_cpu_features, native_bf16, parse_cpuinfo
from tests.support.fake_cpuinfo import (
    AARCH64,
    AMX_BF16_NO_TILE,
    OTHER_X86,
    SAPPHIRE_RAPIDS,
    SKYLAKE_X,
    XEON_AMX_HIDDEN,
    ZEN3,
    ZEN4,
)


@pytest.mark.parametrize(
    ("text", "native", "reason"),
    [
        (SAPPHIRE_RAPIDS, True, "CPU has AMX-BF16"),
        (ZEN4, True, "CPU has AVX512-BF16 on AMD cores"),
        (
            XEON_AMX_HIDDEN,
            False,
            "avx512_bf16 without AMX: bf16 GEMMs are not faster than fp32 on Intel cores",
        ),
        (OTHER_X86, False, "avx512_bf16 on HygonGenuine: not known to beat fp32 GEMMs"),
        (SKYLAKE_X, False, "CPU has neither AMX-BF16 nor AVX512-BF16 (torch capability AVX2)"),
        (ZEN3, False, "CPU has neither AMX-BF16 nor AVX512-BF16 (torch capability AVX2)"),
        (AARCH64, False, "CPU has neither AMX-BF16 nor AVX512-BF16 (torch capability AVX2)"),
    ],
)
def test_native_bf16_rule_on_fake_cpuinfo(text, native, reason):
    support = native_bf16(parse_cpuinfo(text, capability="AVX2"), env={})
    assert (support.native, support.reason) == (native, reason)


def test_parse_reads_vendor_and_flags_of_the_first_processor():
    f = parse_cpuinfo(SAPPHIRE_RAPIDS, capability="AVX512")
    assert f == CpuFeatures("GenuineIntel", True, True, True, "AVX512")
    assert f.amx
    assert parse_cpuinfo(AARCH64) == CpuFeatures("", False, False, False, "")


def test_amx_bf16_flag_without_tiles_is_not_amx():
    assert not native_bf16(parse_cpuinfo(AMX_BF16_NO_TILE), env={}).native


@pytest.mark.parametrize(
    ("value", "native"), [("1", True), ("on", True), ("0", False), ("false", False)]
)
def test_override_env_wins_over_the_flags(value, native):
    for text in (SAPPHIRE_RAPIDS, SKYLAKE_X):
        support = native_bf16(parse_cpuinfo(text), env={"APPLIANCE_CPU_BF16": value})
        assert support == cpu_features.Bf16Support(native, f"APPLIANCE_CPU_BF16={value}")


def test_override_env_rejects_other_values():
    with pytest.raises(ValueError, match="APPLIANCE_CPU_BF16='maybe': expected 1 or 0"):
        native_bf16(parse_cpuinfo(ZEN4), env={"APPLIANCE_CPU_BF16": "maybe"})
    assert native_bf16(parse_cpuinfo(ZEN4), env={"APPLIANCE_CPU_BF16": ""}).native


def test_detect_reads_the_cpuinfo_path_and_torch_capability(tmp_path, monkeypatch):
    import torch

    fake = tmp_path / "cpuinfo"
    fake.write_text(ZEN4)
    monkeypatch.setattr(cpu_features, "CPUINFO_PATH", fake)
    f = detect_cpu_features()
    assert (f.vendor, f.avx512_bf16, f.amx) == ("AuthenticAMD", True, False)
    assert f.capability == torch.backends.cpu.get_cpu_capability()
    monkeypatch.setattr(cpu_features, "CPUINFO_PATH", tmp_path / "missing")
    assert native_bf16(detect_cpu_features(), env={}).reason.startswith("no ")
