"""Suffix decoding: propose the most frequent continuation of the context's suffix, found in
the request's own tokens and in recent requests' outputs.

The idea is SuffixDecoding's (Arctic Inference, vLLM's `suffix` method): agent loops and
code edits repeat themselves (tool calls, JSON keys, the same function rewritten), so the
tokens that most often followed the context's longest matching suffix are a good guess,
and how often they did says how many to propose. Where that work keeps a suffix tree, this
keeps a positional index (`TokenIndex`, anchor `ANCHOR`): memory linear in the tokens, an
update O(new tokens), a lookup bounded by `MAX_CANDIDATES` occurrences per source.

One lookup:

1. candidates: earlier occurrences of the context's last ANCHOR tokens in the request's own
   prompt + output and in its partition of the cache of recent outputs, each with its match
   length m (how far back it agrees with the context, at most `max_depth`);
2. two candidate sets, the longest matches (m = M) and all of them; for each, a greedy
   path: at each depth the token most of the set's surviving candidates continue with, its
   share multiplied into the path's probability; the path stops when that probability falls
   under `min_token_prob` or its length reaches max_spec_factor x the set's match length
   (or k);
3. the path with the larger expected number of accepted tokens (the sum of its
   probabilities) is the proposal.

The cache of recent outputs (`SuffixCache`) holds the outputs of the last
`max_cached_requests` requests that finished normally, partitioned by the prefix cache's
extra keys (cache salts, the API key's salt, the LoRA adapter: `Request.cache_keys`), so one
tenant's outputs never shape another's proposals (nor, through acceptance, its timing).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from engine.config import SpeculativeConfig
from engine.core.request import Request, RequestStatus
from engine.core.spec.state import SpecState
from engine.core.spec.token_index import TokenIndex

ANCHOR = 2
# Occurrences compared per source per lookup (the latest ones).
MAX_CANDIDATES = 32
# Tokens of one output kept in the cache (its last ones).
MAX_CACHED_OUTPUT_TOKENS = 8192
_SEPARATOR = -1  # between cached outputs: no real token equals it, so no match crosses it


class _Candidate:
    """One earlier occurrence: where its continuation starts, in which token list."""

    __slots__ = ("tokens", "start", "match", "own_end")

    def __init__(self, tokens: Sequence[int], start: int, match: int, own_end: int):
        self.tokens = tokens
        self.start = start
        self.match = match
        # For the request's own tokens: their length, past which the continuation runs into
        # the proposal itself (a repeating run); -1 for cached outputs.
        self.own_end = own_end

    def token_at(self, depth: int, path: list[int]) -> int | None:
        pos = self.start + depth
        if self.own_end >= 0 and pos >= self.own_end:
            i = pos - self.own_end
            return path[i] if i < len(path) else None
        if pos >= len(self.tokens):
            return None
        tok = self.tokens[pos]
        return None if tok == _SEPARATOR else tok


class SuffixProposer:
    def __init__(self, config: SpeculativeConfig):
        self.max_depth = config.suffix_max_depth
        self.min_token_prob = config.suffix_min_token_prob
        self.max_spec_factor = config.suffix_max_spec_factor
        self.cache = SuffixCache(config.suffix_max_cached_requests)

    def propose(self, request: Request, state: SpecState, k: int) -> list[int]:
        tokens = request.all_token_ids
        index = state.index
        if index is None:
            index = state.index = TokenIndex(tokens, ANCHOR)
        n = len(tokens)
        index.index_upto(n - 1)
        cands = self._candidates(index, tokens, n)
        cached = self.cache.index_for(request.cache_keys)
        if cached is not None:
            cands += self._candidates(cached, tokens, -1)
        if not cands:
            return []
        longest = max(c.match for c in cands)
        best = self._path([c for c in cands if c.match == longest], longest, k)
        if any(c.match < longest for c in cands):
            other = self._path(cands, ANCHOR, k)
            if other[1] > best[1]:
                best = other
        return best[0]

    def _candidates(self, index: TokenIndex, context: list[int], own_end: int) -> list[_Candidate]:
        out = []
        for p in index.candidates(context, MAX_CANDIDATES):
            m = index.match_length(p, context, self.max_depth)
            if m >= ANCHOR:
                out.append(_Candidate(index.tokens, p + 1, m, own_end))
        return out

    def _path(self, cands: list[_Candidate], match: int, k: int) -> tuple[list[int], float]:
        """The greedy most-frequent path through the candidates' continuations and its
        expected accepted tokens (candidates are latest first: ties go to the latest)."""
        limit = min(k, max(1, int(self.max_spec_factor * match)))
        path: list[int] = []
        prob, score = 1.0, 0.0
        alive = cands
        while len(path) < limit and alive:
            depth = len(path)
            counts: dict[int, int] = {}
            for c in alive:
                tok = c.token_at(depth, path)
                if tok is not None:
                    counts[tok] = counts.get(tok, 0) + 1
            if not counts:
                break
            tok = max(counts, key=counts.__getitem__)  # first maximum: the latest candidate's
            prob *= counts[tok] / len(alive)
            if prob < self.min_token_prob:
                break
            alive = [c for c in alive if c.token_at(depth, path) == tok]
            path.append(tok)
            score += prob
        return path, score

    def on_finished(self, request: Request) -> None:
        if request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.cache.add(request.cache_keys, request.output_token_ids)


class _Partition:
    """The cached outputs of one set of cache keys, concatenated with separators."""

    __slots__ = ("tokens", "index", "segments")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.index = TokenIndex(self.tokens, ANCHOR)
        self.segments: deque[int] = deque()  # start of each cached output, oldest first

    def add(self, output: Sequence[int]) -> None:
        self.segments.append(len(self.tokens))
        self.tokens.append(_SEPARATOR)
        self.tokens.extend(output)
        self.index.index_upto(len(self.tokens))

    def evict_oldest(self) -> None:
        self.segments.popleft()
        start = self.segments[0] if self.segments else len(self.tokens)
        if start * 2 >= len(self.tokens):  # mostly dead: compact (amortized O(1) a token)
            del self.tokens[:start]
            self.segments = deque(s - start for s in self.segments)
            self.index = TokenIndex(self.tokens, ANCHOR)
            self.index.index_upto(len(self.tokens))
        else:
            self.index.forget_before(start)


class SuffixCache:
    """The outputs of the last `max_requests` requests, partitioned by their cache keys;
    evicted oldest first across partitions."""

    def __init__(self, max_requests: int):
        self.max_requests = max_requests
        self._partitions: dict[tuple, _Partition] = {}
        self._order: deque[tuple] = deque()  # the partition of each cached output, oldest first

    def __len__(self) -> int:
        return len(self._order)

    def add(self, keys: tuple, output: Sequence[int]) -> None:
        if self.max_requests == 0 or len(output) < ANCHOR + 1:
            return
        part = self._partitions.get(keys)
        if part is None:
            part = self._partitions[keys] = _Partition()
        part.add(output[-MAX_CACHED_OUTPUT_TOKENS:])
        self._order.append(keys)
        while len(self._order) > self.max_requests:
            old = self._order.popleft()
            oldest = self._partitions[old]
            oldest.evict_oldest()
            if not oldest.segments:
                del self._partitions[old]

    def index_for(self, keys: tuple) -> TokenIndex | None:
        part = self._partitions.get(keys)
        return part.index if part is not None else None
