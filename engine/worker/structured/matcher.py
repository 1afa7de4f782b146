"""One request's grammar state in the runner, advanced by every token it samples.

A `GrammarState` is created with the request's runner state (a new request, a resumed one
after preemption by recompute, or a forked sample of `n > 1`: each has its own state) and
replays the output tokens the request already has, so a recomputed request continues where
it stopped.

`start_after` (a reasoning model's end-of-thinking marker): until the marker's bytes appear
in the output, the request is unconstrained; the grammar starts with the token after the
one that completed the marker. The match is on the bytes the tokens decode to (llguidance's
decoding; added tokens such as `</think>` decode to their text), so it holds however the
marker was tokenized. Bytes after the marker in that same token are not checked by the
grammar (reasoning parsers split at the marker token the same way).

`optional` (Qwen3: the answer reasons only when it opens with `<think>`): the section is
open only if the first sampled token is one of the grammar's `open_token_ids` (the
tokenizer's single token for the opener); until that first token the grammar is active and
its mask is widened by those ids (`widen`), and any other first token is the grammar's.
"""

from __future__ import annotations

from collections.abc import Iterable

import llguidance as llg
import numpy as np

from engine.worker.structured.compiler import CompiledGrammar, first_line


class GrammarState:
    def __init__(
        self,
        grammar: CompiledGrammar,
        start_after: str | None = None,
        output_token_ids: Iterable[int] = (),
        optional: bool = False,
    ):
        self.grammar = grammar
        self._tokenizer = grammar.tokenizer
        self._marker = start_after.encode() if start_after else b""
        self._tail = b""  # the output's last bytes while waiting for the marker
        # Optional section: undecided until the first token (then the grammar is active).
        self._undecided = bool(self._marker) and optional
        waiting = bool(self._marker) and not self._undecided
        self.matcher: llg.LLMatcher | None = None if waiting else grammar.new_matcher()
        for tok in output_token_ids:
            self.advance(tok)

    @property
    def active(self) -> bool:
        """True when the grammar constrains the next token."""
        return self.matcher is not None

    def advance(self, token_id: int) -> None:
        """Takes one sampled token. A token the grammar refuses (only possible if another
        path put it there) or a limit llguidance hits while taking it (an Earley row or a
        lexer past its bounds) leaves the matcher in its error state, for good: `error()`
        says so. In that state llguidance's mask allows EOS alone, which would end the
        sample as a clean "stop", so the runner consults `error()` after every token and
        before every mask it uses, and ends the sample with that error instead."""
        if self._undecided:
            self._undecided = False
            if token_id in self.grammar.open_token_ids:  # the section opens: wait for its end
                self.matcher = None
                return
        if self.matcher is not None:
            self.matcher.consume_token(token_id)
            return
        self._tail += self._tokenizer.decode_bytes([token_id])
        if self._marker in self._tail:
            self.matcher = self.grammar.new_matcher()
            self._tail = b""
        else:
            self._tail = self._tail[-(len(self._marker) - 1) :] if len(self._marker) > 1 else b""

    def widen(self, mask_row: np.ndarray) -> None:
        """Allows the opener's token ids in this request's bitmask row (int32 words) while
        the first token is still to come; otherwise leaves it as the grammar made it."""
        if not self._undecided:
            return
        words = mask_row.view(np.uint32)
        for t in self.grammar.open_token_ids:
            if t < self.grammar.vocab_size:
                words[t // 32] |= np.uint32(1 << (t % 32))

    def error(self) -> str | None:
        """The matcher's error (a refused token, a parser or lexer limit hit), its first
        line (llguidance may append a state dump), or None."""
        if self.matcher is not None and self.matcher.is_error():
            return first_line(self.matcher.get_error()) or "grammar error"
        return None
