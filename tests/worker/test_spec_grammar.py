"""Grammar masks for verified positions and forced-token proposals (engine/worker/spec/grammar.py):
each position's row is the mask after the proposals before it, the real matcher is not
moved, and a state waiting for its marker is played forward on a copy."""

from __future__ import annotations

import llguidance as llg
import numpy as np
import pytest

from engine import StructuredOutputsParams
from engine.worker.spec.grammar import forced_tokens, verify_bitmask
from engine.worker.structured.bitmask import fill_bitmask
from engine.worker.structured.compiler import GrammarCompiler
from engine.worker.structured.matcher import GrammarState

VOCAB = 520


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from tests.support.tiny_models import make_tokenizer

    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def compiled(tok):
    c = GrammarCompiler(tok, VOCAB, {tok.eos_token_id}, cache_size=4)
    yield lambda spec: c.compile(spec)
    c.close()


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _mask_after(state: GrammarState, tokens: list[int], tok) -> np.ndarray:
    probe = GrammarState(state.grammar, None, tokens)
    return fill_bitmask(llg.LLExecutor(), [(0, probe.matcher)], 1, VOCAB, state.grammar.eos_token_id, [tok.eos_token_id])[0]  # fmt: skip


def test_each_verified_row_is_the_mask_after_the_proposals_before_it(compiled, tok):
    grammar = compiled(StructuredOutputsParams(regex=r"(ab|cd)+x"))
    state = GrammarState(grammar)
    drafts = _ids(tok, "abcd")
    mask, rows = verify_bitmask(llg.LLExecutor(), [(1, state, drafts)], 1 + len(drafts) + 2, VOCAB, [tok.eos_token_id])  # fmt: skip
    assert rows == [False] + [True] * (len(drafts) + 1) + [False]
    for j in range(len(drafts) + 1):
        assert (mask[1 + j] == _mask_after(state, drafts[:j], tok)).all()
    assert state.matcher.validate_tokens(drafts) == len(drafts)  # the matcher did not move


def test_a_waiting_grammar_starts_at_the_row_after_its_marker(compiled, tok):
    grammar = compiled(StructuredOutputsParams(regex=r"[0-9]+", start_after="=="))
    state = GrammarState(grammar, "==")
    drafts = _ids(tok, "a") + _ids(tok, "==") + _ids(tok, "1")
    marker_end = len(_ids(tok, "a")) + len(_ids(tok, "=="))
    _, rows = verify_bitmask(llg.LLExecutor(), [(0, state, drafts)], len(drafts) + 1, VOCAB, [tok.eos_token_id])  # fmt: skip
    assert rows == [False] * marker_end + [True] * (len(drafts) + 1 - marker_end)
    assert not state.active  # the real state still waits


def test_forced_tokens_are_what_the_grammar_allows_alone(compiled, tok):
    grammar = compiled(StructuredOutputsParams(regex=r"hello world [0-9]"))
    state = GrammarState(grammar)
    forced = forced_tokens(state, 16)
    assert forced and tok.decode(forced).startswith("hello")
    assert forced_tokens(state, 1) == forced[:1]
    assert forced_tokens(GrammarState(grammar, "=="), 4) == []  # waiting: nothing forced
