"""GraphRunner: decode steps replayed from CUDA graphs captured per batch-size bucket.

The runner asks `can_run(step)`; decode-only steps of at most the largest bucket go through
`run(step)`, everything else (prefill chunks, mixed steps, bigger batches) stays eager in
the runner. A step is copied into the typed static buffers (`StaticDecodeInputs`), padded
to its bucket, and:

  - on CUDA, the backend plans the bucket's graph-safe attention (FlashInfer decode wrappers
    built with `use_cuda_graph=True`; `plan()` runs here, outside the graph) and the graph
    for that bucket replays;
  - on the CPU (no graphs), the model runs eagerly on the same static buffers: the padding,
    metadata and slicing code is the one the GPU uses, so CPU tests cover it.

Graphs are captured largest bucket first into one shared memory pool (smaller graphs reuse
the larger one's blocks). Capture needs the KV cache allocated (graphs bake in its address)
and happens before any request is served.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engine.config import RuntimeConfig
from engine.worker.attention.base import AttentionBackend, AttentionMetadata, ForwardContext
from graphs.buckets import StaticDecodeInputs, capture_sizes, pick_bucket

logger = logging.getLogger(__name__)


class StepLike(Protocol):
    """What GraphRunner needs of a step (engine.worker.input_batch.StepInputs has it)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata


class Replayable(Protocol):
    def replay(self) -> None: ...


# (body to record, shared pool or None) -> (graph, pool for the next capture)
GraphFactory = Callable[[Callable[[], None], Any], tuple[Replayable, Any]]


def capture_cuda_graph(body: Callable[[], None], pool: Any) -> tuple[Replayable, Any]:
    """Record `body` into a CUDA graph allocating from `pool` (a new pool when None)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        body()
    return graph, graph.pool() if pool is None else pool


@dataclass
class GraphStats:
    captured_sizes: list[int] = field(default_factory=list)
    capture_seconds: float = 0.0
    graph_memory_bytes: int = 0
    replays: int = 0
    padded_rows: int = 0


class GraphRunner:
    """Owns the static decode buffers and, in graph mode, one captured graph per bucket.

    `run` returns a view of a static output buffer: read it (logits, sampling) before the next
    `run`, which overwrites it.
    """

    def __init__(
        self,
        model: Any,
        backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        capture_sizes: Sequence[int],
        device: torch.device,
        *,
        block_size: int,
        max_blocks_per_seq: int,
        use_graphs: bool | None = None,
        graph_factory: GraphFactory | None = None,
    ):
        """`model`: `model(input_ids, positions, ctx) -> hidden [T, H]` with `attention_specs`.
        `max_blocks_per_seq`: ceil(max_model_len / block_size), the widest block table.
        `use_graphs`: capture and replay (default: on CUDA); off runs the same buffers eagerly.
        `graph_factory`: how a bucket is recorded (default CUDA graphs; tests pass a stand-in).
        """
        if not capture_sizes:
            raise ValueError("capture_sizes must not be empty")
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.sizes = tuple(sorted(set(capture_sizes)))
        self.max_batch = self.sizes[-1]
        self.device = device
        self.block_size = block_size
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs:
            if device.type != "cuda" and graph_factory is None:
                raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
            if not getattr(backend, "supports_cuda_graphs", False):
                raise ValueError(
                    f"attention backend {backend.name!r} has no graph-safe decode path; "
                    "use FlashInfer or turn runtime.cuda_graphs off"
                )
        self._graph_factory = graph_factory or capture_cuda_graph
        self.buffers = StaticDecodeInputs.allocate(self.max_batch, max_blocks_per_seq, device)
        self.hidden: torch.Tensor | None = None  # [max_batch, H], allocated on first output
        self.graphs: dict[int, Replayable] = {}
        self.graph_states: dict[int, Any] = {}
        self.stats = GraphStats()

    # ---- the hook the model runner calls ----------------------------------------------------
    def can_run(self, step: StepLike) -> bool:
        """Decode-only, within the largest bucket, block table within the static width."""
        md = step.attn_metadata
        fits = (
            md.num_reqs >= 1
            and md.is_decode_only
            and md.num_tokens == md.num_reqs
            and md.num_reqs <= self.max_batch
            and md.block_tables.shape[1] <= self.buffers.max_blocks_per_seq
        )
        if not fits:
            return False
        return not self.use_graphs or pick_bucket(self.sizes, md.num_reqs) in self.graphs

    @torch.inference_mode()
    def run(self, step: StepLike) -> torch.Tensor:
        """Hidden states [num_reqs, H] of a decode step, computed padded to its bucket."""
        md = step.attn_metadata
        n = md.num_reqs
        bucket = pick_bucket(self.sizes, n)
        if bucket is None:
            raise ValueError(f"{n} requests exceed the largest bucket {self.max_batch}")
        padded = self.buffers.fill(
            step.input_ids, step.positions, md, bucket, full_width=self.use_graphs
        )
        if self.use_graphs:
            self.backend.begin_graph_step(self.graph_states[bucket], padded)  # plan, not in graph
            self.graphs[bucket].replay()
        else:
            self.backend.begin_step(padded)
            self._forward_into(bucket, ForwardContext(padded, self.kv_caches, self.backend))
        self.stats.replays += 1
        self.stats.padded_rows += bucket - n
        assert self.hidden is not None
        return self.hidden[:n]

    # ---- capture ----------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> GraphStats:
        """Record every bucket, largest first, into one memory pool (no-op without graphs).

        Call once at start-up, after the KV cache is allocated and before any request holds
        blocks: the all-padding dummy batch may write its rows into slot 0.
        """
        if not self.use_graphs:
            logger.info("decode graphs off: buckets %s run eagerly", list(self.sizes))
            return self.stats
        free_before = self._free_memory()
        t0 = time.perf_counter()
        specs = self.model.attention_specs
        dtype = self.kv_caches[0].dtype
        max_pages = self.max_batch * self.buffers.max_blocks_per_seq
        pool = None
        for bucket in reversed(self.sizes):
            state = self.backend.make_graph_state(bucket, max_pages, specs, dtype)
            md = self.buffers.dummy(bucket, self.block_size)
            ctx = ForwardContext(md, self.kv_caches, self.backend)
            self.backend.begin_graph_step(state, md)
            self._forward_into(bucket, ctx)  # warm-up: compile, lazy inits, output buffer
            self._synchronize()
            self.backend.begin_graph_step(state, md)  # fresh per-step state, built in-graph
            graph, pool = self._graph_factory(
                functools.partial(self._forward_into, bucket, ctx), pool
            )
            self.graphs[bucket] = graph
            self.graph_states[bucket] = state
        self._synchronize()
        self.stats.captured_sizes = sorted(self.graphs)
        self.stats.capture_seconds = time.perf_counter() - t0
        self.stats.graph_memory_bytes = max(0, free_before - self._free_memory())
        logger.info(
            "captured %d decode graphs (batch %d..%d) in %.1f s using %.0f MiB of GPU memory",
            len(self.graphs), self.sizes[0], self.max_batch,
            self.stats.capture_seconds, self.stats.graph_memory_bytes / 2**20,
        )  # fmt: skip
        return self.stats

    # ---- helpers ----------------------------------------------------------------------------
    def _forward_into(self, bucket: int, ctx: ForwardContext) -> None:
        """model on the first `bucket` static rows; the result lands in the static output."""
        ids, pos = self.buffers.input_ids[:bucket], self.buffers.positions[:bucket]
        out = self.model(ids, pos, ctx)  # [bucket, H]
        if self.hidden is None:
            shape = (self.max_batch, *out.shape[1:])
            self.hidden = torch.empty(shape, dtype=out.dtype, device=out.device)
        self.hidden[:bucket].copy_(out)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _free_memory(self) -> int:
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        return torch.cuda.mem_get_info(self.device)[0]


def build_graph_runner(
    model: Any,
    backend: AttentionBackend,
    kv_caches: list[torch.Tensor],
    runtime: RuntimeConfig,
    device: torch.device,
    *,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
) -> GraphRunner | None:
    """A captured GraphRunner, or None (with the reason logged) when graphs cannot be used.

    None when `runtime.cuda_graphs` is off, the device is not CUDA, or the backend has no
    graph-safe decode path (the torch backend reads host lists every step). Call after the
    final KV cache allocation and after `maybe_compile`, before serving.
    """
    reason = None
    if not runtime.cuda_graphs:
        reason = "runtime.cuda_graphs is off"
    elif device.type != "cuda":
        reason = f"device is {device.type}"
    elif not getattr(backend, "supports_cuda_graphs", False):
        reason = f"the {backend.name} attention backend cannot be captured"
    if reason is not None:
        logger.info("decode steps run eagerly: %s", reason)
        return None
    runner = GraphRunner(
        model,
        backend,
        kv_caches,
        capture_sizes(runtime.capture_sizes, max_num_seqs),
        device,
        block_size=block_size,
        max_blocks_per_seq=-(-max_model_len // block_size),
    )
    runner.capture()
    return runner
