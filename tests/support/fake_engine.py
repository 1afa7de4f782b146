"""A deterministic stand-in for LLMEngine: same interface, no model.

Used where a test needs what the real engine can't give on demand: a step that raises, a
queue that stays full (with `tests.support.waiting.StepGate` holding its steps). Each running
request gets one token per step; token ids are letters ('a' + (prompt_len + i) % 26), so
texts are predictable, unless `replies` holds scripted answers: each new request then takes
the next one, one character per step, and stops after it (finish_reason "stop"). Like
LLMEngine, `step` returns per-step `RequestDelta`s; `requests` keeps every request added.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from engine.config import EngineConfig, ModelConfig, SchedulerConfig
from engine.errors import InvalidRequestError, LoRAError, QueueFullError
from engine.output.request_output import RequestDelta, RequestMetrics, SampleDelta
from engine.sampling_params import SamplingParams
from engine.worker.status import AcceleratorStatus


class FakeTokenizer:
    """One token per character (byte value); id 0 is EOS."""

    vocab_size = 256
    eos_token_ids = frozenset({0})

    def encode(self, text: str) -> list[int]:
        return [min(ord(c), 255) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i or not skip_special_tokens)

    def has_chat_template(self) -> bool:
        return True

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kw) -> list[int]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return self.encode(text + ("assistant: " if add_generation_prompt else ""))


@dataclass
class FakeStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_blocks: int = 100
    num_free_blocks: int = 100
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    lora_running: dict[str, int] = field(default_factory=dict)
    lora_waiting: dict[str, int] = field(default_factory=dict)
    spec_decode: object | None = None  # speculative decoding is off in the fake
    kv_tier: object | None = None
    tenants: dict = field(default_factory=dict)


@dataclass
class _Req:
    request_id: str
    prompt: str | None
    ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival: float
    out: list[list[int]] = field(default_factory=list)
    first_token: float | None = None
    num_sent: int = 0  # tokens per sample already in a delta
    first_sent: bool = False
    script: list[int] | None = None  # a scripted answer's tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.ids


class FakeLLMEngine:
    def __init__(
        self,
        max_num_seqs: int = 4,
        max_queue_len: int = 8,
        max_model_len: int = 2048,
    ):
        self.config = EngineConfig(
            model=ModelConfig(served_name="fake-model"),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_queue_len=max_queue_len),
        )
        self.tokenizer = FakeTokenizer()
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.device = "cpu"
        self.accelerator = AcceleratorStatus("torch")
        self.fail_steps = 0  # the next N steps raise
        self.thread_ids: set[int] = set()
        self.aborted: list[str] = []
        self.running: list[_Req] = []
        self.waiting: list[_Req] = []
        self._stats = FakeStats()
        self.replies: list[str] = []  # scripted answers, taken in order
        self.requests: list[_Req] = []
        self.fatal_error: str | None = None  # set: the engine can never step again
        self.closed = False

    def prepare_request(
        self,
        request_id,
        prompt,
        params,
        *,
        priority=0,
        arrival_time=None,
        cache_salt=None,  # the fake has no prefix cache
        lora_request=None,
        tenant=None,  # the fake has no tenants and keeps no deadlines
        deadline=None,
    ):
        if lora_request is not None:
            raise LoRAError("the fake engine serves no LoRA adapters")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError("prompt too long", "prompt")
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        if len(ids) + max_tokens > self.max_model_len:
            raise InvalidRequestError("max_tokens too large", "max_tokens")
        if params.n > self.config.scheduler.max_n:
            raise InvalidRequestError("n too large", "n")
        arrival = arrival_time or time.monotonic()
        return _Req(
            request_id,
            prompt if isinstance(prompt, str) else None,
            ids,
            params,
            max_tokens,
            arrival,
        )

    def is_lora_loaded(self, lora) -> bool:
        return False  # it has none: a request naming one is refused in prepare_request

    def add_prepared(self, req: _Req) -> None:
        if len(self.waiting) >= self.config.scheduler.max_queue_len:
            raise QueueFullError("full")
        req.out = [[] for _ in range(req.params.n)]
        if self.replies:
            req.script = self.tokenizer.encode(self.replies.pop(0))
        self.requests.append(req)
        self.waiting.append(req)
        self._stats.prompt_tokens_total += len(req.ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def abort(self, request_ids) -> None:
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        self.aborted.extend(ids)
        self.running = [r for r in self.running if r.request_id not in ids]
        self.waiting = [r for r in self.waiting if r.request_id not in ids]

    def _delta(self, r: _Req, finished: bool, error: str | None = None) -> RequestDelta:
        stopped = r.script is not None and len(r.out[0]) >= len(r.script)
        reason = "error" if error else ("stop" if stopped else "length") if finished else None
        outs = []
        for i, toks in enumerate(r.out):
            new = toks[r.num_sent :]
            if new or reason:
                text = self.tokenizer.decode(new)
                outs.append(SampleDelta(i, text, list(new), finish_reason=reason))
        r.num_sent = len(r.out[0]) if r.out else 0
        now = time.monotonic()
        m = RequestMetrics(r.arrival, r.arrival, r.first_token, now, now if finished else None)
        delta = RequestDelta(r.request_id, outs, finished, error=error)
        if not r.first_sent or finished:
            delta.metrics = m
        if not r.first_sent:
            r.first_sent = True
            delta.prompt, delta.prompt_token_ids = r.prompt, r.ids
        return delta

    def step(self) -> list[RequestDelta]:
        self.thread_ids.add(threading.get_ident())
        while self.waiting and len(self.running) < self.config.scheduler.max_num_seqs:
            self.running.append(self.waiting.pop(0))
        if self.fail_steps:  # after admission: the admitted requests were in the failed step
            self.fail_steps -= 1
            raise RuntimeError("injected step failure")
        results = []
        for r in list(self.running):
            for i, toks in enumerate(r.out):
                if r.script is not None:
                    toks.append(r.script[len(toks)])
                else:
                    toks.append(ord("a") + (len(r.ids) + len(toks) + i) % 26)
            self._stats.generation_tokens_total += len(r.out)
            r.first_token = r.first_token or time.monotonic()
            done = len(r.out[0]) >= r.max_tokens or (
                r.script is not None and len(r.out[0]) >= len(r.script)
            )
            if done:
                self.running.remove(r)
            results.append(self._delta(r, done))
        return results

    def fail_all(self, message: str) -> list[RequestDelta]:
        outs = [self._delta(r, True, message) for r in self.running + self.waiting]
        self.running, self.waiting = [], []
        return outs

    def fail_step(self, message: str) -> list[RequestDelta]:
        """Fails the batch of the step that raised (every running request); waiting ones stay."""
        outs = [self._delta(r, True, message) for r in self.running]
        self.running = []
        return outs

    def has_request(self, request_id: str) -> bool:
        return any(r.request_id == request_id for r in self.running + self.waiting)

    def close(self) -> None:
        self.closed = True

    def set_wakeup(self, wake) -> None:
        self.wake = wake

    def flush_kv_tier(self, timeout_s: float) -> int:
        self.flushed_for = timeout_s
        return 0

    def stats(self) -> FakeStats:
        s = self._stats
        s.num_running, s.num_waiting = len(self.running), len(self.waiting)
        s.kv_usage = len(self.running) / 100
        return FakeStats(**s.__dict__)
