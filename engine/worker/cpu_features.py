"""What this CPU computes fast: read from /proc/cpuinfo and torch when asked, never at import.

    detect_cpu_features()  -> CpuFeatures (vendor, bf16 flags, torch's ATen capability)
    native_bf16(features)  -> Bf16Support (native or not, and why, for the start-up log)

bf16 is "native" when a bf16 GEMM beats fp32 on this CPU, not merely when it runs:

    AMX-BF16 (amx_bf16 + amx_tile)     native: tile GEMMs, far faster than fp32
    AMD with avx512_bf16 (Zen 4/5)     native: VDPBF16PS double-pumped, ~4x fp32 GEMMs
    Intel with avx512_bf16, no AMX     not native: VDPBF16PS issues on one port against two
                                       FMA ports; oneDNN's bf16 GEMM ran ~0.55x fp32 when
                                       compute bound (Xeon with AMX hidden by a hypervisor)
    anything else                      not native

`APPLIANCE_CPU_BF16=1` (or 0) overrides the answer, for tests and benchmarks. torch is
imported only inside `detect_cpu_features`, so the rule itself is testable on fake cpuinfo.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CPUINFO_PATH = Path("/proc/cpuinfo")
OVERRIDE_ENV = "APPLIANCE_CPU_BF16"
_TRUE = ("1", "on", "true", "yes")
_FALSE = ("0", "off", "false", "no")


@dataclass(frozen=True)
class CpuFeatures:
    vendor: str  # cpuinfo's vendor_id: "GenuineIntel", "AuthenticAMD", ...; "" when unknown
    amx_bf16: bool
    amx_tile: bool
    avx512_bf16: bool
    # torch.backends.cpu.get_cpu_capability(): "AVX512", "AVX2", "DEFAULT", "SVE256", ...
    capability: str = ""
    cpuinfo_read: bool = True  # False: no /proc/cpuinfo (not Linux), every flag False

    @property
    def amx(self) -> bool:
        return self.amx_bf16 and self.amx_tile


@dataclass(frozen=True)
class Bf16Support:
    native: bool
    reason: str  # e.g. "CPU has AMX-BF16"; completes "dtype float32 (checkpoint bfloat16; ...)"


def parse_cpuinfo(text: str, capability: str = "") -> CpuFeatures:
    """Features from /proc/cpuinfo's text (the first processor's vendor_id and flags lines)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if sep and key in ("vendor_id", "flags") and key not in fields:
            fields[key] = value.strip()
    flags = set(fields.get("flags", "").split())
    return CpuFeatures(
        vendor=fields.get("vendor_id", ""),
        amx_bf16="amx_bf16" in flags,
        amx_tile="amx_tile" in flags,
        avx512_bf16="avx512_bf16" in flags,
        capability=capability,
    )


def detect_cpu_features() -> CpuFeatures:
    """This machine's features (reads `CPUINFO_PATH` and asks torch; nothing is cached)."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    try:
        text = CPUINFO_PATH.read_text()
    except OSError:
        return CpuFeatures("", False, False, False, capability, cpuinfo_read=False)
    return parse_cpuinfo(text, capability)


def native_bf16(
    features: CpuFeatures | None = None, env: Mapping[str, str] | None = None
) -> Bf16Support:
    """Whether bf16 is the fast dtype on this CPU; `features`/`env` default to this machine's.

    Raises ValueError when APPLIANCE_CPU_BF16 is set to something other than 1/0 (on/off,
    true/false, yes/no).
    """
    env = os.environ if env is None else env
    override = env.get(OVERRIDE_ENV, "").strip().lower()
    if override in _TRUE:
        return Bf16Support(True, f"{OVERRIDE_ENV}={env[OVERRIDE_ENV]}")
    if override in _FALSE:
        return Bf16Support(False, f"{OVERRIDE_ENV}={env[OVERRIDE_ENV]}")
    if override:
        raise ValueError(f"{OVERRIDE_ENV}={env[OVERRIDE_ENV]!r}: expected 1 or 0")
    f = detect_cpu_features() if features is None else features
    return bf16_rule(f)


def bf16_rule(f: CpuFeatures) -> Bf16Support:
    """The table in the module docstring, without the override."""
    if f.amx:
        return Bf16Support(True, "CPU has AMX-BF16")
    if f.avx512_bf16 and f.vendor == "AuthenticAMD":
        return Bf16Support(True, "CPU has AVX512-BF16 on AMD cores")
    if f.avx512_bf16 and f.vendor == "GenuineIntel":
        return Bf16Support(
            False, "avx512_bf16 without AMX: bf16 GEMMs are not faster than fp32 on Intel cores"
        )
    if f.avx512_bf16:
        vendor = f.vendor or "an unknown vendor"
        return Bf16Support(False, f"avx512_bf16 on {vendor}: not known to beat fp32 GEMMs")
    if not f.cpuinfo_read:
        return Bf16Support(False, f"no {CPUINFO_PATH} to read bf16 support from")
    capability = f" (torch capability {f.capability})" if f.capability else ""
    return Bf16Support(False, f"CPU has neither AMX-BF16 nor AVX512-BF16{capability}")
