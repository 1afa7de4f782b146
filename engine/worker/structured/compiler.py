"""Compiles a `StructuredOutputsParams` into an llguidance grammar, once per distinct spec.

`GrammarCompiler.compile` runs on the caller's thread (`LLMEngine.prepare_request`, which
the async engine calls off the engine thread) and does the heavy part on its own worker
thread, waiting at most `timeout_s`:

- llguidance's `LLMatcher(...)` constructor builds the grammar in Rust with the GIL
  dropped (its documented contract), so the engine thread keeps stepping meanwhile;
- the work itself is bounded by `LLParserLimits` (grammar size, lexer states, lexer fuel):
  a pathological schema stops inside llguidance with an error, which is what really ends
  it (a Python thread cannot be killed); the wall-clock timeout only stops the wait, so a
  slow compile is refused (`SamplingParamsError`) while its thread runs out its fuel;
- llguidance never raises for a grammar it cannot follow: its matcher enters an error
  state whose mask allows EOS alone. So each new grammar is *probed* before it is cached:
  on a copy, the first mask is computed (an empty language or a `$ref` cycle errors there)
  and the forced prefix consumed (a limit hit on it, e.g. `a{400000}` or a sentence of
  2**60 a's, errors there). What fails is refused naming the field; what only shows once
  the model has chosen a branch ends that sample with an error (see `matcher`).

Choices compile to one regex lexeme (an alternation of the escaped strings), not to a Lark
alternative per choice: llguidance's Earley rows hold at most 2,000 items, so 2,000
choices sharing a prefix used to hit that limit mid-answer.

Results are cached by (kind, canonical spec) in an LRU bounded by bytes (`cache_bytes`,
`structured_outputs.cache_mib`) and by `cache_size` entries; concurrent requests for the
same spec share one compile. A grammar's bytes are measured on the C heap across its build
and probe (`heap`: llguidance's lexer states, which the cached template keeps alive, are
most of it), and one above `max_grammar_bytes` (`structured_outputs.max_grammar_mib`) is
refused. Errors name `structured_outputs.<kind>`.

A JSON schema is compiled, and keyed, in the client's key order: llguidance writes an
object's properties in the order `properties` lists them, so sorting the keys would make a
model commit to `answer` before its `reasoning`, and a sorted cache key would hand a
`{answer, reasoning}` request the grammar compiled for `{reasoning, answer}`.

JSON whitespace is not flexible: items and keys are separated by "," and ":" with no
blanks or newlines (as OpenAI's strict mode and vLLM's `disable_any_whitespace`), so a
sampled answer cannot run to max_tokens on whitespace.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import llguidance as llg

from engine.sampling_params import SamplingParamsError, StructuredOutputsParams
from engine.worker.structured.heap import HeapMeter, floor_bytes

DEFAULT_CACHE_SIZE = 256
DEFAULT_TIMEOUT_S = 10.0
MIB = 1 << 20
DEFAULT_CACHE_BYTES = 256 * MIB  # structured_outputs.cache_mib
DEFAULT_MAX_GRAMMAR_BYTES = 64 * MIB  # structured_outputs.max_grammar_mib
# Evictions freeing at least this much give the heap's free pages back to the system.
_TRIM_BYTES = MIB
# Compact JSON: no whitespace between tokens (see the module docstring).
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated grammar: `template` is a fresh matcher each request copies (immutable
    in use: nobody consumes tokens on it). `eos_token_id` is the one EOS id llguidance's
    mask uses; the runner extends its verdict to every EOS id of the model."""

    kind: str
    template: llg.LLMatcher
    tokenizer: llg.LLTokenizer
    vocab_size: int
    eos_token_id: int
    nbytes: int = 0  # its memory, as accounted by the cache (module docstring)
    # The token ids that open an optional section before the constraint (`opened_by`); set
    # per request (`GrammarCompiler.marker_token_ids`), never in the cache.
    open_token_ids: frozenset[int] = frozenset()

    def new_matcher(self) -> llg.LLMatcher:
        return self.template.deep_copy()


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer (thread-safe)."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        limits: llg.LLParserLimits | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES,
    ):
        """`vocab_size`: the model's logits width (may exceed the tokenizer's: the padded
        ids have no bytes, so no grammar ever allows them). `eos_token_ids`: the model's
        EOS ids; the tokenizer's own (else the smallest) is the one llguidance knows."""
        eos = sorted(eos_token_ids)
        if not eos:
            raise ValueError("structured outputs need the model's EOS token id")
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        own = getattr(hf_tokenizer, "eos_token_id", None)
        self.eos_token_id = own if own in eos else eos[0]
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.max_grammar_bytes = max_grammar_bytes
        self.timeout_s = timeout_s
        self._heap = HeapMeter()
        self._cached_bytes = 0
        self._markers: dict[str, frozenset[int]] = {}
        # Short errors: llguidance's verbose ones append the parser state (and the grammar).
        self.limits = limits or llg.LLParserLimits(verbose_errors=False)
        self._ll_tokenizer: llg.LLTokenizer | None = None
        self._lock = threading.RLock()  # a done future runs _finish in compile's lock
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._in_flight: dict[tuple[str, str], Future[CompiledGrammar]] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")

    @property
    def ll_tokenizer(self) -> llg.LLTokenizer:
        """llguidance's view of the tokenizer, built once (about a second for 150k tokens)."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf, n_vocab=self.vocab_size, eos_token=self.eos_token_id
                )
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The grammar for `spec`, from the cache or compiled now (waiting at most
        `timeout_s`). Raises `SamplingParamsError` naming structured_outputs.<kind>."""
        kind = spec.kind
        key = (kind, _canonical(spec))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            fut = self._in_flight.get(key)
            if fut is None:
                fut = self._pool.submit(self._build, kind, key[1])
                self._in_flight[key] = fut
                fut.add_done_callback(lambda f, k=key: self._finish(k, f))
        try:
            return fut.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise SamplingParamsError(
                f"grammar compilation did not finish within {self.timeout_s:g}s",
                f"structured_outputs.{kind}",
            ) from None

    def cached(self, spec: StructuredOutputsParams) -> bool:
        """True when `spec`'s grammar is in the cache (tests and metrics)."""
        with self._lock:
            return (spec.kind, _canonical(spec)) in self._cache

    def cached_bytes(self, spec: StructuredOutputsParams | None = None) -> int:
        """The accounted bytes of the cache (or of `spec`'s grammar in it, 0 if absent)."""
        with self._lock:
            if spec is None:
                return self._cached_bytes
            hit = self._cache.get((spec.kind, _canonical(spec)))
            return hit.nbytes if hit is not None else 0

    def marker_token_ids(self, marker: str) -> frozenset[int]:
        """The ids of the tokens that are exactly `marker` (an added token such as Qwen3's
        `<think>`); empty when the tokenizer has none, so the marker takes several tokens."""
        with self._lock:
            hit = self._markers.get(marker)
            if hit is None:
                hf = self._hf
                ids = {hf.convert_tokens_to_ids(marker)}
                encoded = hf.encode(marker, add_special_tokens=False)
                if len(encoded) == 1:
                    ids.add(encoded[0])
                hit = frozenset(
                    t for t in ids
                    if isinstance(t, int) and 0 <= t < self.vocab_size
                    and t != getattr(hf, "unk_token_id", None)
                    and hf.decode([t], skip_special_tokens=False) == marker
                )  # fmt: skip
                self._markers[marker] = hit
            return hit

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- on the compile thread ------------------------------------------------------------
    def _build(self, kind: str, canonical: str) -> CompiledGrammar:
        param = f"structured_outputs.{kind}"
        try:
            grammar = _to_llguidance(kind, canonical)
        except ValueError as e:
            raise SamplingParamsError(f"invalid: {e}", param) from None
        tokenizer = self.ll_tokenizer  # built once, before the heap is read
        before = self._heap.in_use()
        # Drops the GIL while it builds; never raises for grammar errors (error state).
        matcher = llg.LLMatcher(tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise SamplingParamsError(_short(matcher.get_error()), param)
        _probe(matcher, param)
        after = self._heap.in_use()
        measured = after - before if before is not None and after is not None else 0
        nbytes = max(measured, floor_bytes(grammar))
        if nbytes > self.max_grammar_bytes:
            del matcher
            self._heap.trim()
            raise SamplingParamsError(
                f"the compiled grammar needs {nbytes / MIB:.1f} MiB of memory, more than "
                f"structured_outputs.max_grammar_mib ({self.max_grammar_bytes / MIB:g} MiB)",
                param,
            )
        return CompiledGrammar(kind, matcher, tokenizer, self.vocab_size, self.eos_token_id, nbytes)

    def _finish(self, key: tuple[str, str], fut: Future[CompiledGrammar]) -> None:
        dropped = 0
        with self._lock:
            self._in_flight.pop(key, None)
            if fut.cancelled() or fut.exception() is not None:
                return
            grammar = fut.result()
            self._cache[key] = grammar
            self._cache.move_to_end(key)
            self._cached_bytes += grammar.nbytes
            old: CompiledGrammar | None = None
            while len(self._cache) > 1 and (
                len(self._cache) > self.cache_size or self._cached_bytes > self.cache_bytes
            ):
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= old.nbytes
                dropped += old.nbytes
            del grammar, old  # this frame's references: a dropped grammar can be freed
        if dropped >= _TRIM_BYTES:  # requests still holding a dropped one keep it alive
            self._heap.trim()


def _canonical(spec: StructuredOutputsParams) -> str:
    """One string per distinct constraint: JSON schemas as compact JSON in the client's key
    order (the order is part of the constraint), choices as a JSON list. Raises
    `SamplingParamsError` for a schema that is not JSON."""
    kind = spec.kind
    if kind == "json":
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise SamplingParamsError(
                    f"not valid JSON: {e}", "structured_outputs.json"
                ) from None
        if not isinstance(schema, dict | bool):
            raise SamplingParamsError("a JSON Schema must be an object", "structured_outputs.json")
        try:
            return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise SamplingParamsError(
                f"not JSON-serializable: {e}", "structured_outputs.json"
            ) from None
    if kind == "json_object":
        return ""
    if kind == "choice":
        return json.dumps(list(spec.choice or ()), ensure_ascii=False)
    value = getattr(spec, kind)
    if not isinstance(value, str) or not value:
        raise SamplingParamsError("must be a non-empty string", f"structured_outputs.{kind}")
    return value


def _to_llguidance(kind: str, canonical: str) -> str:
    """The llguidance grammar (its JSON form) for a canonical spec."""
    if kind == "json":
        return llg.LLMatcher.grammar_from_json_schema(canonical, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(canonical)
    if kind == "choice":  # one lexeme: see the module docstring
        alts = "|".join(_regex_literal(c) for c in json.loads(canonical))
        return llg.LLMatcher.grammar_from_regex(f"({alts})")
    if kind == "grammar":
        return llg.LLMatcher.grammar_from_lark(canonical)
    raise ValueError(f"unknown kind {kind!r}")


def _regex_literal(text: str) -> str:
    """`text` as a regex matching exactly it: ASCII letters and digits and non-ASCII
    characters as they are, every other character as a `\\x{..}` escape."""
    return "".join(
        c if (c.isascii() and c.isalnum()) or ord(c) > 127 else f"\\x{{{ord(c):x}}}" for c in text
    )


def _probe(template: llg.LLMatcher, param: str) -> None:
    """What llguidance can tell before a token is sampled (module docstring), on a copy so
    the template stays at the start; raises SamplingParamsError naming `param`."""
    m = template.deep_copy()
    m.compute_bitmask()
    if not m.is_error():
        forced = m.compute_ff_tokens()
        if forced and not m.is_error():
            m.consume_tokens(forced)
            if not m.is_error():
                m.compute_bitmask()  # the mask right after the forced prefix
    if m.is_error():
        raise SamplingParamsError(_cannot_honor(m.get_error()), param)


def _cannot_honor(error: str) -> str:
    why = first_line(error)
    if why == "NoExtensionBias":  # the first mask allows nothing, not even EOS
        why = "it allows no text at all (an empty language, e.g. a $ref cycle)"
    return _short(f"the grammar engine cannot follow this constraint: {why}")


def first_line(message: str) -> str:
    """llguidance's error without the state dump it may append."""
    return message.strip().split("\n", 1)[0].strip()


def _short(message: str, limit: int = 500) -> str:
    """llguidance's error, trimmed so a huge schema does not come back whole in a 400."""
    message = first_line(message)
    return message if len(message) <= limit else message[: limit - 3] + "..."
