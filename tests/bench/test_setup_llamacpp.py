"""The llama.cpp peer's configure flags (bench/peers/setup_llamacpp.py): the ISA comes from the
CPU's flags, every ggml ISA option is stated, AMX is never on, and a build stamped with other
flags is not taken for today's build."""

from __future__ import annotations

import json

from bench.peers import setup_llamacpp as peer

SPR_GUEST = {"sse4_2", "avx", "avx2", "bmi2", "fma", "f16c", "avx512f", "avx512_vnni",
             "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}  # fmt: skip


def _opts(flags: list[str]) -> dict[str, str]:
    return dict(f[2:].split("=", 1) for f in flags if f.startswith("-D"))


def test_an_amx_cpu_gets_avx512_but_no_amx():
    opts = _opts(peer.cmake_flags(SPR_GUEST))
    assert opts["GGML_NATIVE"] == "OFF"
    assert opts["GGML_AVX512"] == opts["GGML_AVX512_VNNI"] == opts["GGML_AVX512_BF16"] == "ON"
    assert opts["GGML_AMX_TILE"] == opts["GGML_AMX_INT8"] == opts["GGML_AMX_BF16"] == "OFF"
    assert opts["GGML_AVX512_VBMI"] == "OFF"  # not in the flags given


def test_an_avx2_cpu_states_avx512_off():
    opts = _opts(peer.cmake_flags({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}))
    assert opts["GGML_AVX2"] == opts["GGML_FMA"] == "ON"
    assert all(opts[k] == "OFF" for k in ("GGML_AVX512", "GGML_AVX512_BF16", "GGML_AVX_VNNI"))
    assert set(peer.X86_ISA) <= set(opts)


def test_no_cpu_flags_falls_back_to_native():
    assert _opts(peer.cmake_flags(set()))["GGML_NATIVE"] == "ON"


def test_a_stamp_with_other_flags_is_not_a_build(tmp_path):
    binary = peer.server_binary(tmp_path)
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    (tmp_path / "built.json").write_text(json.dumps({"cmake_flags": ["-DGGML_NATIVE=ON"]}))
    st = peer.state(tmp_path)
    assert not st["ok"] and "other flags" in st["error"]
    (tmp_path / "built.json").write_text(json.dumps({"cmake_flags": peer.cmake_flags()}))
    assert peer.state(tmp_path)["ok"]
