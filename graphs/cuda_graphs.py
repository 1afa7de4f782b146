"""Capture and replay of a callable as one CUDA graph per batch-size bucket.

`BucketGraphs` records, for every bucket size, a body that reads and writes fixed-address
tensors (see `graphs/buckets.py`), largest bucket first into one shared memory pool (the
smaller graphs reuse the larger one's blocks). Each bucket is prepared and run once eagerly
before it is recorded (warm-up: compiles, lazy initialisations, output buffers), then
prepared again and recorded. `replay(bucket)` replays it.

What the body computes is the caller's: the engine's decode step (model, attention backend,
KV cache) lives in `engine/worker/decode_graphs.py`. Tests pass a stand-in `graph_factory`
that records nothing and re-runs the body on replay, so the control flow runs on the CPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)


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
class CaptureStats:
    captured_sizes: list[int] = field(default_factory=list)
    capture_seconds: float = 0.0
    graph_memory_bytes: int = 0  # device memory the graphs took (0 off CUDA)


class BucketGraphs:
    """One recorded graph per bucket size, all from one memory pool."""

    def __init__(
        self,
        sizes: Sequence[int],
        device: torch.device,
        graph_factory: GraphFactory | None = None,
    ):
        """`graph_factory`: how a bucket is recorded (default: CUDA graphs, on a CUDA device)."""
        if not sizes:
            raise ValueError("capture sizes must not be empty")
        if device.type != "cuda" and graph_factory is None:
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.sizes = tuple(sorted(set(sizes)))
        self.device = device
        self._graph_factory = graph_factory or capture_cuda_graph
        self.graphs: dict[int, Replayable] = {}
        self.stats = CaptureStats()

    def __contains__(self, bucket: int | None) -> bool:
        return bucket in self.graphs

    def capture(self, prepare: Callable[[int], Callable[[], None]]) -> CaptureStats:
        """Record every bucket, largest first.

        `prepare(bucket)` sets up the bucket's inputs and per-step state and returns the body
        to run; it is called twice per bucket, before the eager warm-up and before recording,
        so state the warm-up consumed is fresh when the graph is recorded.
        """
        free_before = self._free_memory()
        t0 = time.perf_counter()
        pool = None
        for bucket in reversed(self.sizes):
            prepare(bucket)()  # warm-up
            self._synchronize()
            graph, pool = self._graph_factory(prepare(bucket), pool)
            self.graphs[bucket] = graph
        self._synchronize()
        self.stats.captured_sizes = sorted(self.graphs)
        self.stats.capture_seconds = time.perf_counter() - t0
        self.stats.graph_memory_bytes = max(0, free_before - self._free_memory())
        logger.info(
            "captured %d graphs (batch %d..%d) in %.1f s using %.0f MiB of device memory",
            len(self.graphs), self.sizes[0], self.sizes[-1],
            self.stats.capture_seconds, self.stats.graph_memory_bytes / 2**20,
        )  # fmt: skip
        return self.stats

    def replay(self, bucket: int) -> None:
        self.graphs[bucket].replay()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _free_memory(self) -> int:
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        return torch.cuda.mem_get_info(self.device)[0]
