"""The grammar engine glue: compile cache and timeout, bitmask layout, start_after."""

from __future__ import annotations

import json
import threading

import llguidance as llg
import numpy as np
import pytest
import torch

from engine import StructuredOutputsParams
from engine.sampling_params import SamplingParamsError
from engine.worker.structured import compiler as compiler_mod
from engine.worker.structured.bitmask import apply_bitmask, fill_bitmask
from engine.worker.structured.compiler import GrammarCompiler
from engine.worker.structured.matcher import GrammarState

VOCAB = 520  # the model's logits width: 8 padded ids above the 512-token tokenizer


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    from tests.support.tiny_models import make_tokenizer

    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def compiler(hf_tok):
    im_end = hf_tok.convert_tokens_to_ids("<|im_end|>")
    c = GrammarCompiler(hf_tok, VOCAB, {hf_tok.eos_token_id, im_end}, cache_size=2)
    yield c
    c.close()


def _bits(mask_row: np.ndarray) -> np.ndarray:
    return np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:VOCAB]


def test_compile_runs_on_the_compile_thread_and_is_cached(compiler, monkeypatch):
    threads = []
    real = compiler_mod._to_llguidance

    def spy(kind, canonical):
        threads.append(threading.current_thread().name)
        return real(kind, canonical)

    monkeypatch.setattr(compiler_mod, "_to_llguidance", spy)
    spec = StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}}
    )
    same = StructuredOutputsParams(
        json='{"type": "object", "properties": {"a": {"type": "integer"}}}'
    )
    g1 = compiler.compile(spec)
    assert compiler.compile(same) is g1  # one key for the same schema, as a dict or as text
    assert len(threads) == 1 and threads[0].startswith("grammar-compile")


def test_cache_is_bounded_lru(compiler):
    specs = [StructuredOutputsParams(regex=f"a{{{i}}}") for i in range(1, 4)]
    for s in specs:
        compiler.compile(s)
    assert not compiler.cached(specs[0])
    assert compiler.cached(specs[1]) and compiler.cached(specs[2])


def test_compile_timeout_refuses_naming_the_field(compiler, monkeypatch):
    release = threading.Event()
    real = compiler_mod._to_llguidance

    def stuck(kind, canonical):
        release.wait()
        return real(kind, canonical)

    monkeypatch.setattr(compiler_mod, "_to_llguidance", stuck)
    compiler.timeout_s = 0.01
    spec = StructuredOutputsParams(regex="stuck")
    try:
        with pytest.raises(SamplingParamsError, match="did not finish") as e:
            compiler.compile(spec)
        assert e.value.param == "structured_outputs.regex"
    finally:
        release.set()


def test_padded_ids_are_never_allowed_and_every_eos_follows_the_grammar(compiler, hf_tok):
    g = compiler.compile(StructuredOutputsParams(regex="[a-z]+"))
    m = g.new_matcher()
    im_end = hf_tok.convert_tokens_to_ids("<|im_end|>")
    eos_ids = sorted({hf_tok.eos_token_id, im_end})
    ex = llg.LLExecutor()
    mask = fill_bitmask(ex, [(1, m)], 2, VOCAB, g.eos_token_id, eos_ids)
    bits = _bits(mask[1])
    assert bits[512:].sum() == 0
    assert bits[hf_tok.eos_token_id] == 0 and bits[im_end] == 0  # nothing matched yet
    assert (_bits(mask[0]) == 1).all()  # an unconstrained row is all ones
    assert m.consume_tokens(hf_tok.encode("abc"))
    mask = fill_bitmask(ex, [(0, m)], 1, VOCAB, g.eos_token_id, eos_ids)
    bits = _bits(mask[0])
    assert bits[hf_tok.eos_token_id] == 1 and bits[im_end] == 1  # accepting: EOS allowed


def test_apply_bitmask_masks_only_the_given_rows():
    logits = torch.zeros(2, 40)
    mask = np.zeros((2, 2), dtype=np.int32)
    mask[0, 0] = 0b101  # tokens 0 and 2
    apply_bitmask(logits, mask, [0])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(logits[1]).all()


def test_start_after_waits_for_the_marker_then_constrains(compiler, hf_tok):
    g = compiler.compile(StructuredOutputsParams(regex="[0-9]+"))
    st = GrammarState(g, start_after="</answer>")
    for tok in hf_tok.encode("some thinking </ans"):
        st.advance(tok)
    assert not st.active
    for tok in hf_tok.encode("wer>"):
        st.advance(tok)
    assert st.active
    # Replay: a state rebuilt from the same output tokens is at the same place.
    out = hf_tok.encode("some thinking </answer>") + hf_tok.encode("42")
    replayed = GrammarState(g, "</answer>", out)
    assert replayed.active and replayed.error() is None
    assert not replayed.matcher.is_stopped()


def test_a_refused_token_puts_the_state_in_error(compiler, hf_tok):
    g = compiler.compile(StructuredOutputsParams(regex="[0-9]+"))
    st = GrammarState(g)
    st.advance(hf_tok.encode("x")[0])
    assert st.error() is not None


def _object(*names: str) -> dict:
    """A schema whose properties are `names`, all required, in that order."""
    return {
        "type": "object",
        "properties": {n: {"type": "string"} for n in names},
        "required": list(names),
        "additionalProperties": False,
    }


def _forced_bytes(compiler: GrammarCompiler, spec: StructuredOutputsParams) -> bytes:
    return compiler.compile(spec).new_matcher().compute_ff_bytes()


def test_json_properties_are_forced_in_the_clients_order_at_every_level(compiler):
    """A schema {reasoning, answer} must let the model reason first: its first forced bytes
    are `{"reasoning":`, its reordered twin's `{"answer":`, and the cache keeps them apart."""
    inner = {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "string"}},
             "required": ["z", "a"], "additionalProperties": False}  # fmt: skip
    first = _object("reasoning", "answer")
    first["properties"]["reasoning"] = inner
    twin = _object("answer", "reasoning")
    spec, twin_spec = StructuredOutputsParams(json=first), StructuredOutputsParams(json=twin)
    assert _forced_bytes(compiler, spec) == b'{"reasoning":{"z":"'
    assert _forced_bytes(compiler, twin_spec) == b'{"answer":"'
    assert compiler.compile(spec) is not compiler.compile(twin_spec)
    # The schema as JSON text in the same order is the same constraint (one cache entry).
    text = StructuredOutputsParams(json=json.dumps(first))
    assert compiler.compile(text) is compiler.compile(spec)


def _heap_in_use() -> int:
    """Bytes the C heap has handed out and not taken back (glibc's mallinfo2): where
    llguidance's structures live. Skips the test elsewhere."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]  # fmt: skip

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
    except (OSError, AttributeError):
        pytest.skip("needs glibc's mallinfo2")
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


MIB = 1 << 20


def test_compiled_grammars_hold_at_most_the_cache_bytes(hf_tok):
    """Each distinct large grammar keeps megabytes (llguidance's lexer states, shared by
    the cached template and every request's copy of it) until the cache drops it; the
    cache holds at most `cache_bytes` of them, however many distinct grammars come."""
    c = GrammarCompiler(hf_tok, VOCAB, {hf_tok.eos_token_id})
    c.cache_bytes = 40 * MIB
    try:
        c.compile(StructuredOutputsParams(regex="warm-up")).new_matcher().compute_bitmask()
        before = _heap_in_use()
        for i in range(8):  # what a request with max_tokens=1 does with each
            c.compile(
                StructuredOutputsParams(regex=f"a{{{30000 + i}}}")
            ).new_matcher().compute_bitmask()
        grown = _heap_in_use() - before
        assert grown <= 40 * MIB + 8 * MIB, f"{grown / MIB:.0f} MiB held by 8 grammars"
        assert 0 < c.cached_bytes() <= 40 * MIB
    finally:
        c.close()


def test_the_accounted_size_is_the_grammars_heap(hf_tok):
    c = GrammarCompiler(hf_tok, VOCAB, {hf_tok.eos_token_id})
    try:
        small, large = (
            StructuredOutputsParams(regex="[a-z]+"),
            StructuredOutputsParams(regex="a{30000}"),
        )
        c.compile(small)
        before = _heap_in_use()
        c.compile(large).new_matcher().compute_bitmask()
        grown = _heap_in_use() - before
        assert c.cached_bytes(small) < 2 * MIB
        assert 0.5 * grown <= c.cached_bytes(large) <= 2 * grown + MIB, (
            c.cached_bytes(large),
            grown,
        )
    finally:
        c.close()


def test_a_grammar_above_the_size_limit_is_refused_naming_the_field(hf_tok):
    c = GrammarCompiler(hf_tok, VOCAB, {hf_tok.eos_token_id}, max_grammar_bytes=2 * MIB)
    try:
        with pytest.raises(SamplingParamsError, match="structured_outputs.max_grammar_mib") as e:
            c.compile(StructuredOutputsParams(regex="a{30000}"))
        assert e.value.param == "structured_outputs.regex"
        assert not c.cached(StructuredOutputsParams(regex="a{30000}"))
        c.compile(StructuredOutputsParams(regex="[a-z]{1,8}"))  # small ones still compile
    finally:
        c.close()
