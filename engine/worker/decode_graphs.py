"""GraphRunner: decode steps replayed from CUDA graphs captured per batch-size bucket.

The runner asks `can_run(step)`; decode-only steps of at most the largest bucket go through
`run(step)`, everything else (prefill chunks, mixed steps, bigger batches) stays eager in
the runner. A step is copied into the static buffers (`graphs.buckets.StaticDecodeInputs`),
padded to its bucket, given attention metadata over those rows (`padded_decode_metadata`),
and:

  - on CUDA, the backend plans the bucket's graph-safe attention (FlashInfer decode wrappers
    built with `use_cuda_graph=True`; `plan()` runs here, outside the graph) and the graph
    for that bucket replays (`graphs.cuda_graphs.BucketGraphs`);
  - on the CPU (no graphs), the model runs eagerly on the same static buffers: the padding,
    metadata and slicing code is the one the GPU uses, so CPU tests cover it.

Graphs are captured largest bucket first into one shared memory pool. Capture needs the KV
cache allocated (graphs bake in its address) and happens before any request is served.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.worker.attention.base import AttentionBackend, AttentionMetadata, ForwardContext
from graphs.buckets import PAD_SEQ_LEN, StaticDecodeInputs, capture_sizes, pick_bucket
from graphs.cuda_graphs import BucketGraphs, CaptureStats, GraphFactory, Replayable

logger = logging.getLogger(__name__)


class StepLike(Protocol):
    """What GraphRunner needs of a step (engine.worker.input_batch.StepInputs has it)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata


@dataclass
class GraphStats(CaptureStats):
    replays: int = 0  # decode steps run on the static buffers (replayed or, off CUDA, eager)
    padded_rows: int = 0  # padding rows those steps computed


def padded_decode_metadata(
    buffers: StaticDecodeInputs,
    input_ids: torch.Tensor,  # [n] int64
    metadata: AttentionMetadata,  # decode-only, n requests
    bucket: int,
    full_width: bool = False,
) -> AttentionMetadata:
    """Copy a decode step into the first `bucket` rows, padded; metadata over those rows.

    `full_width` hands the backend all block-table columns (fixed addresses, for graphs);
    otherwise only the step's columns (less work for a backend that reads every column).
    """
    n = metadata.num_reqs
    if not metadata.is_decode_only or metadata.num_tokens != n:
        raise ValueError("only decode-only steps (one token per request) can be padded")
    buffers.fill(
        bucket,
        input_ids=input_ids[:n],
        positions=metadata.positions[:n],
        slot_mapping=metadata.slot_mapping[:n],
        seq_lens=metadata.seq_lens[:n],
        block_tables=metadata.block_tables[:n],
    )
    seq_lens_cpu = [*metadata.seq_lens_cpu[:n], *([PAD_SEQ_LEN] * (bucket - n))]
    width = buffers.max_blocks_per_seq if full_width else metadata.block_tables.shape[1]
    return _bucket_metadata(buffers, bucket, seq_lens_cpu, metadata.block_size, width)


def dummy_decode_metadata(
    buffers: StaticDecodeInputs, bucket: int, block_size: int
) -> AttentionMetadata:
    """A batch of `bucket` padding rows, for graph capture (nothing is written anywhere)."""
    buffers.fill_padding(bucket)
    seq_lens_cpu = [PAD_SEQ_LEN] * bucket
    return _bucket_metadata(buffers, bucket, seq_lens_cpu, block_size, buffers.max_blocks_per_seq)


def _bucket_metadata(
    buffers: StaticDecodeInputs, bucket: int, seq_lens_cpu: list[int], block_size: int, cols: int
) -> AttentionMetadata:
    return AttentionMetadata(
        num_reqs=bucket,
        num_tokens=bucket,
        query_start_loc=buffers.query_start_loc[: bucket + 1],
        seq_lens=buffers.seq_lens[:bucket],
        block_tables=buffers.block_tables[:bucket, :cols],
        slot_mapping=buffers.slot_mapping[:bucket],
        positions=buffers.positions[:bucket],
        max_query_len=1,
        max_seq_len=max(seq_lens_cpu),
        query_start_loc_cpu=list(range(bucket + 1)),
        seq_lens_cpu=seq_lens_cpu,
        block_size=block_size,
    )


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
        dtype: torch.dtype | None = None,
    ):
        """`model`: `model(input_ids, positions, ctx) -> hidden [T, H]` with `attention_specs`.
        `max_blocks_per_seq`: ceil(max_model_len / block_size), the widest block table.
        `use_graphs`: capture and replay (default: on CUDA); off runs the same buffers eagerly.
        `graph_factory`: how a bucket is recorded (default CUDA graphs; tests pass a stand-in).
        `dtype`: the model's (its queries'); default the caches' dtype, which differs with fp8
        KV pages (the graph wrappers are planned for both).
        """
        if not capture_sizes:
            raise ValueError("capture_sizes must not be empty")
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.dtype = dtype
        self.sizes = tuple(sorted(set(capture_sizes)))
        self.max_batch = self.sizes[-1]
        self.device = device
        self.block_size = block_size
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        self._bucket_graphs: BucketGraphs | None = None
        if self.use_graphs:
            if not getattr(backend, "supports_cuda_graphs", False):
                raise ValueError(
                    f"attention backend {backend.name!r} has no graph-safe decode path; "
                    "use FlashInfer or turn runtime.cuda_graphs off"
                )
            self._bucket_graphs = BucketGraphs(self.sizes, device, graph_factory)
        self.buffers = StaticDecodeInputs.allocate(self.max_batch, max_blocks_per_seq, device)
        self.hidden: torch.Tensor | None = None  # [max_batch, H], allocated on first output
        self.graph_states: dict[int, Any] = {}
        self.stats = GraphStats()

    @property
    def graphs(self) -> dict[int, Replayable]:
        """The captured graph of each bucket (empty before `capture` or without graphs)."""
        return self._bucket_graphs.graphs if self._bucket_graphs is not None else {}

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
        padded = padded_decode_metadata(
            self.buffers, step.input_ids, md, bucket, full_width=self.use_graphs
        )
        if self._bucket_graphs is not None:
            self.backend.begin_graph_step(self.graph_states[bucket], padded)  # plan, not in graph
            self._bucket_graphs.replay(bucket)
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
        if self._bucket_graphs is None:
            logger.info("decode graphs off: buckets %s run eagerly", list(self.sizes))
            return self.stats
        captured = self._bucket_graphs.capture(self._prepare_capture)
        for f in dataclasses.fields(CaptureStats):
            setattr(self.stats, f.name, getattr(captured, f.name))
        return self.stats

    def _prepare_capture(self, bucket: int) -> Callable[[], None]:
        """The bucket's dummy batch and graph state, planned: the body to warm up or record."""
        state = self.graph_states.get(bucket)
        if state is None:
            max_pages = self.max_batch * self.buffers.max_blocks_per_seq
            specs, kv_dtype = self.model.attention_specs, self.kv_caches[0].dtype
            state = self.graph_states[bucket] = self.backend.make_graph_state(
                bucket, max_pages, specs, self.dtype or kv_dtype, kv_dtype
            )
        md = dummy_decode_metadata(self.buffers, bucket, self.block_size)
        self.backend.begin_graph_step(state, md)  # fresh per-step state, built in-graph
        ctx = ForwardContext(md, self.kv_caches, self.backend)
        return lambda: self._forward_into(bucket, ctx)

    # ---- helpers ----------------------------------------------------------------------------
    def _forward_into(self, bucket: int, ctx: ForwardContext) -> None:
        """model on the first `bucket` static rows; the result lands in the static output."""
        ids, pos = self.buffers.input_ids[:bucket], self.buffers.positions[:bucket]
        out = self.model(ids, pos, ctx)  # [bucket, H]
        if self.hidden is None:
            shape = (self.max_batch, *out.shape[1:])
            self.hidden = torch.empty(shape, dtype=out.dtype, device=out.device)
        self.hidden[:bucket].copy_(out)


def build_graph_runner(
    model: Any,
    backend: AttentionBackend,
    kv_caches: list[torch.Tensor],
    device: torch.device,
    *,
    enabled: bool,
    sizes: Sequence[int] | None,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    graph_factory: GraphFactory | None = None,
    dtype: torch.dtype | None = None,
) -> GraphRunner | None:
    """A captured GraphRunner, or None (with the reason logged) when graphs are not to be used.

    None when `enabled` (runtime.cuda_graphs) is off, the device is not CUDA (and no
    `graph_factory` stand-in is given), or the backend has no graph-safe decode path (the
    torch backend reads host lists every step). `sizes`: runtime.capture_sizes (None:
    graphs' default). `dtype`: the model's (see `GraphRunner`). A capture error propagates (the runner falls back to eager decode).
    Call after the final KV cache allocation and after the model is compiled, before serving.
    """
    reason = None
    if not enabled:
        reason = "runtime.cuda_graphs is off"
    elif device.type != "cuda" and graph_factory is None:
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
        capture_sizes(sizes, max_num_seqs),
        device,
        block_size=block_size,
        max_blocks_per_seq=-(-max_model_len // block_size),
        use_graphs=True,
        graph_factory=graph_factory,
        dtype=dtype,
    )
    runner.capture()
    return runner
