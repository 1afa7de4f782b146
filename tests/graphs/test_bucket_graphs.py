"""BucketGraphs on the CPU: capture order, one pool, prepare before warm-up and recording.

A stand-in graph factory records nothing and re-runs the body on replay; the body is a plain
callable writing into a fixed buffer, so nothing of the engine is involved.
"""

from __future__ import annotations

import pytest
import torch

from graphs.cuda_graphs import BucketGraphs
from tests.support.fake_graphs import ReplayGraph


def test_buckets_are_captured_largest_first_into_one_pool_and_replayed():
    pools, events = [], []
    out = torch.zeros(8)

    def factory(body, pool):
        pools.append(pool)
        return ReplayGraph(body), pool or "shared-pool"

    def prepare(bucket):
        events.append(("prepare", bucket))

        def body():
            events.append(("run", bucket))
            out[:bucket] += 1

        return body

    graphs = BucketGraphs((4, 1, 2, 2), torch.device("cpu"), graph_factory=factory)
    assert graphs.sizes == (1, 2, 4)
    stats = graphs.capture(prepare)

    assert stats.captured_sizes == [1, 2, 4]
    assert list(graphs.graphs) == [4, 2, 1]
    assert pools == [None, "shared-pool", "shared-pool"]
    # Each bucket: prepared, warmed up eagerly, prepared again, then recorded (not run).
    assert events[:3] == [("prepare", 4), ("run", 4), ("prepare", 4)]
    assert events.count(("run", 2)) == 1 and events.count(("prepare", 2)) == 2
    assert 2 in graphs and 3 not in graphs
    out.zero_()
    graphs.replay(2)
    assert out.tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert graphs.graphs[2].replays == 1 and graphs.graphs[4].replays == 0


def test_cuda_graphs_need_a_cuda_device_unless_a_factory_stands_in():
    with pytest.raises(ValueError, match="CUDA device"):
        BucketGraphs((1, 2), torch.device("cpu"))
    with pytest.raises(ValueError, match="empty"):
        BucketGraphs((), torch.device("cpu"), graph_factory=lambda b, p: (b, p))
