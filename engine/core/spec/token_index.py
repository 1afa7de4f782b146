"""Where each short token pattern occurred before: the lookup under both id-only proposers.

A `TokenIndex` over a growing token list maps every *anchor* (the `anchor` tokens ending at
a position) to the latest position it ended at, and chains each position to the previous
one with the same anchor::

    tokens:  a b c a b d a b
    anchor 2 ("a b") ends at 1, 4, 7:   last["a b"] = 7, prev[7] = 4, prev[4] = 1, prev[1] = -1

To find earlier occurrences of the context's suffix, walk the chain of the context's last
anchor and measure how far back each candidate agrees with the context (`match_length`):
the longest matches and their continuations are what the n-gram and suffix proposers use.
Memory is one dict entry per distinct anchor plus 4 bytes per token (an `array`); an update
costs O(new tokens), a lookup O(candidates x match length), both bounded by the caller.

The index never includes the positions of the list's last token (`index_upto(len - 1)`),
so a lookup of the context's own suffix finds only earlier occurrences, each with at least
one token after it. Tokens are compared, so a hash collision between anchors only costs a
candidate that matches less. Pure Python, no torch.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence


class TokenIndex:
    """The anchors of `tokens` up to a position; `tokens` is shared and only appended to."""

    __slots__ = ("tokens", "anchor", "start", "_last", "_prev", "_upto")

    def __init__(self, tokens: Sequence[int], anchor: int):
        if anchor < 1:
            raise ValueError("anchor: must be >= 1")
        self.tokens = tokens
        self.anchor = anchor
        # Positions before `start` are never returned (an evicted prefix; see `forget_before`).
        self.start = 0
        self._last: dict[int, int] = {}
        # prev[p]: the previous position with p's anchor, or -1.
        self._prev = array("i")
        self._upto = 0  # positions [0, upto) are indexed

    def _key(self, end: int) -> int:
        """The anchor ending at `end` (inclusive) as one int."""
        a, t = self.anchor, self.tokens
        if a == 1:
            return t[end]
        if a == 2:
            return (t[end - 1] << 32) | (t[end] & 0xFFFFFFFF)
        return hash(tuple(t[end - a + 1 : end + 1]))

    def index_upto(self, end: int) -> None:
        """Indexes the anchors ending at positions [indexed so far, end)."""
        last, prev, key = self._last, self._prev, self._key
        first = self.anchor - 1
        for p in range(self._upto, end):
            if p < first:
                prev.append(-1)
                continue
            k = key(p)
            prev.append(last.get(k, -1))
            last[k] = p
        if end > self._upto:
            self._upto = end

    def candidates(self, context: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` indexed positions, latest first, where the context's last anchor
        tokens ended (hash collisions included: check with `match_length`)."""
        a = self.anchor
        if len(context) < a:
            return []
        if context is self.tokens:
            k = self._key(len(context) - 1)
        else:
            k = _anchor_key(context, a)
        p = self._last.get(k, -1)
        out: list[int] = []
        prev, start = self._prev, self.start
        while p >= start and len(out) < limit:
            out.append(p)
            p = prev[p]
        return out

    def match_length(self, p: int, context: Sequence[int], cap: int) -> int:
        """How many tokens ending at `p` equal the context's last ones (at most `cap`)."""
        t, start = self.tokens, self.start
        n = len(context)
        m = 0
        while m < cap and p - m >= start and m < n and t[p - m] == context[n - 1 - m]:
            m += 1
        return m

    def forget_before(self, start: int) -> None:
        """Positions before `start` are never returned again (their tokens were evicted);
        O(1): their entries stay until the owner rebuilds a smaller index."""
        self.start = start


def _anchor_key(context: Sequence[int], a: int) -> int:
    """`TokenIndex._key` of the context's last `a` tokens (the same int for the same ids)."""
    n = len(context)
    if a == 1:
        return context[n - 1]
    if a == 2:
        return (context[n - 2] << 32) | (context[n - 1] & 0xFFFFFFFF)
    return hash(tuple(context[n - a : n]))
