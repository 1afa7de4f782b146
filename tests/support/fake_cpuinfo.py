"""/proc/cpuinfo texts of CPUs this machine is not, for the native-bf16 rule's tests."""

from __future__ import annotations

_BASE = "fpu sse sse2 avx avx2 fma"
_AVX512 = f"{_BASE} avx512f avx512bw avx512vl avx512_vnni"


def cpuinfo(vendor: str, flags: str, processors: int = 2) -> str:
    """/proc/cpuinfo as Linux writes it on x86: one stanza per logical CPU."""
    stanza = (
        "processor\t: {i}\nvendor_id\t: {vendor}\ncpu family\t: 6\n"
        "model name\t: Some CPU\nflags\t\t: {flags}\nbugs\t\t: spectre_v1\n\n"
    )
    return "".join(stanza.format(i=i, vendor=vendor, flags=flags) for i in range(processors))


SAPPHIRE_RAPIDS = cpuinfo("GenuineIntel", f"{_AVX512} avx512_bf16 amx_bf16 amx_tile amx_int8")
XEON_AMX_HIDDEN = cpuinfo("GenuineIntel", f"{_AVX512} avx512_bf16")  # AMX hidden by a hypervisor
AMX_BF16_NO_TILE = cpuinfo("GenuineIntel", f"{_AVX512} avx512_bf16 amx_bf16")
ZEN4 = cpuinfo("AuthenticAMD", f"{_AVX512} avx512_bf16")
ZEN3 = cpuinfo("AuthenticAMD", _BASE)
SKYLAKE_X = cpuinfo("GenuineIntel", _AVX512)
OTHER_X86 = cpuinfo("HygonGenuine", f"{_AVX512} avx512_bf16")
AARCH64 = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve bf16 i8mm\n\n"
