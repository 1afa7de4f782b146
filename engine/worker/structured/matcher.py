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
"""

from __future__ import annotations

from collections.abc import Iterable

import llguidance as llg

from engine.worker.structured.compiler import CompiledGrammar, first_line


class GrammarState:
    def __init__(
        self,
        grammar: CompiledGrammar,
        start_after: str | None = None,
        output_token_ids: Iterable[int] = (),
    ):
        self.grammar = grammar
        self._tokenizer = grammar.tokenizer
        self._marker = start_after.encode() if start_after else b""
        self._tail = b""  # the output's last bytes while waiting for the marker
        self.matcher: llg.LLMatcher | None = None if self._marker else grammar.new_matcher()
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
        if self.matcher is not None:
            self.matcher.consume_token(token_id)
            return
        self._tail += self._tokenizer.decode_bytes([token_id])
        if self._marker in self._tail:
            self.matcher = self.grammar.new_matcher()
            self._tail = b""
        else:
            self._tail = self._tail[-(len(self._marker) - 1) :] if len(self._marker) > 1 else b""

    def error(self) -> str | None:
        """The matcher's error (a refused token, a parser or lexer limit hit), its first
        line (llguidance may append a state dump), or None."""
        if self.matcher is not None and self.matcher.is_error():
            return first_line(self.matcher.get_error()) or "grammar error"
        return None
