"""Prompt lookup (n-gram) proposals: copy what followed the context's suffix earlier.

For the request's prompt and output so far, find the latest earlier occurrence of the
longest suffix of n tokens, n in [prompt_lookup_min, prompt_lookup_max], and propose the k
tokens that followed it (vLLM's `ngram` method; the same longest-n rule). Copying tasks
(editing code, summarizing with quotes, JSON that repeats keys) accept most of them.

Cost per step: the index takes the step's new tokens (O(new tokens x 1)); the lookup walks
at most `MAX_CANDIDATES` earlier occurrences of the last prompt_lookup_min tokens, latest
first, comparing at most prompt_lookup_max tokens each.
"""

from __future__ import annotations

from engine.core.request import Request
from engine.core.spec.proposer import continuation
from engine.core.spec.state import SpecState
from engine.core.spec.token_index import TokenIndex

# Earlier occurrences compared per lookup (the latest ones).
MAX_CANDIDATES = 32


class NgramProposer:
    def __init__(self, lookup_min: int, lookup_max: int):
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, request: Request, state: SpecState, k: int) -> list[int]:
        tokens = request.all_token_ids
        index = state.index
        if index is None:
            index = state.index = TokenIndex(tokens, self.lookup_min)
        index.index_upto(len(tokens) - 1)
        best, best_len, hi = -1, 0, self.lookup_max
        for p in index.candidates(tokens, MAX_CANDIDATES):
            m = index.match_length(p, tokens, hi)
            if m > best_len:
                best, best_len = p, m
                if m >= hi:
                    break
        if best_len < self.lookup_min:
            return []
        return continuation(tokens, best + 1, k)

    def on_finished(self, request: Request) -> None:
        pass
