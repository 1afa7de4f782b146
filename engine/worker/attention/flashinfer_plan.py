"""The index arrays FlashInfer's paged wrappers plan with, built from block tables: pure math.

FlashInfer describes a batch of paged sequences in CSR form. For request i with context length
`seq_lens[i]` (tokens in the cache after this step) and `query_lens[i]` new tokens:

    pages_i                   = ceil(seq_lens[i] / block_size)
    qo_indptr[i+1]            = qo_indptr[i] + query_lens[i]          (same as query_start_loc)
    paged_kv_indptr[i+1]      = paged_kv_indptr[i] + pages_i
    paged_kv_indices[indptr[i]:indptr[i+1]] = block_tables[i, :pages_i]
    paged_kv_last_page_len[i] = seq_lens[i] - (pages_i - 1) * block_size   (in 1..block_size)

    request 0: seq_len 35, block_size 16, blocks [7, 2, 9, 0...]
      pages 3 -> indices [7, 2, 9], last page holds 35 - 32 = 3 tokens

Everything here is NumPy on the host so it is exact, cheap and testable without a GPU. The
backend computes `paged_kv_indices` on the device from the device block table
(`flashinfer.device_page_indices`, checked against `build_paged_kv_plan` here), so planning
never reads the block table back to the host nor copies an index array to the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PagedKVPlan:
    """Host int32 arrays for one step, in FlashInfer's argument order."""

    qo_indptr: np.ndarray  # [num_reqs + 1] int32
    paged_kv_indptr: np.ndarray  # [num_reqs + 1] int32
    paged_kv_indices: np.ndarray  # [paged_kv_indptr[-1]] int32
    paged_kv_last_page_len: np.ndarray  # [num_reqs] int32

    @property
    def num_reqs(self) -> int:
        return len(self.paged_kv_last_page_len)

    @property
    def num_pages(self) -> int:
        return int(self.paged_kv_indptr[-1])


def pages_per_request(seq_lens: Sequence[int] | np.ndarray, block_size: int) -> np.ndarray:
    """ceil(seq_len / block_size) per request, int64. Every request must hold >= 1 token."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    if lens.size and int(lens.min()) < 1:
        raise ValueError(f"every request needs seq_len >= 1, got {lens.tolist()}")
    return (lens + block_size - 1) // block_size


def paged_kv_indptr(seq_lens: Sequence[int] | np.ndarray, block_size: int) -> np.ndarray:
    """Prefix sum of pages per request: [num_reqs + 1] int32, starting at 0."""
    pages = pages_per_request(seq_lens, block_size)
    out = np.zeros(len(pages) + 1, dtype=np.int64)
    np.cumsum(pages, out=out[1:])
    return out.astype(np.int32)


def paged_kv_last_page_len(seq_lens: Sequence[int] | np.ndarray, block_size: int) -> np.ndarray:
    """Tokens in each request's last page, in 1..block_size: [num_reqs] int32."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    pages = pages_per_request(lens, block_size)
    return (lens - (pages - 1) * block_size).astype(np.int32)


def page_gather_index(
    seq_lens: Sequence[int] | np.ndarray, block_size: int, table_width: int
) -> np.ndarray:
    """Flat positions into a row-major `[num_reqs, table_width]` block table, one per page.

    `block_tables.reshape(-1)[page_gather_index(...)]` is `paged_kv_indices`; the gather runs
    where the block table lives (the GPU), with no device-to-host copy.
    """
    pages = pages_per_request(seq_lens, block_size)
    if pages.size and int(pages.max()) > table_width:
        raise ValueError(
            f"a request needs {int(pages.max())} pages but the block table has {table_width} columns"
        )
    rows = np.repeat(np.arange(len(pages), dtype=np.int64), pages)
    starts = np.cumsum(pages) - pages  # first page of each request in the flat list
    cols = np.arange(int(pages.sum()), dtype=np.int64) - np.repeat(starts, pages)
    return rows * table_width + cols


def build_paged_kv_plan(
    block_tables: np.ndarray,
    seq_lens: Sequence[int] | np.ndarray,
    query_start_loc: Sequence[int] | np.ndarray,
    block_size: int,
) -> PagedKVPlan:
    """All four plan arrays from a host block table `[num_reqs, width]`.

    `query_start_loc` is the step's `[num_reqs + 1]` token offsets; it is FlashInfer's
    `qo_indptr` unchanged.
    """
    table = np.asarray(block_tables)
    if table.ndim != 2:
        raise ValueError(f"block_tables must be 2-D, got shape {table.shape}")
    lens = np.asarray(seq_lens, dtype=np.int64)
    qo = np.asarray(query_start_loc, dtype=np.int64)
    if len(qo) != len(lens) + 1 or table.shape[0] < len(lens):
        raise ValueError(
            f"inconsistent batch: {len(lens)} seq_lens, {len(qo)} query_start_loc entries, "
            f"{table.shape[0]} block table rows"
        )
    gather = page_gather_index(lens, block_size, table.shape[1])
    return PagedKVPlan(
        qo_indptr=qo.astype(np.int32),
        paged_kv_indptr=paged_kv_indptr(lens, block_size),
        paged_kv_indices=table.reshape(-1)[gather].astype(np.int32),
        paged_kv_last_page_len=paged_kv_last_page_len(lens, block_size),
    )


def window_left(sliding_window: int | None) -> int:
    """FlashInfer's `window_left` for a window of `sliding_window` tokens, itself included.

    A query at position p may see keys p - window_left ... p, so a window of W tokens is
    `window_left = W - 1`; -1 means no window.
    """
    if sliding_window is None or sliding_window <= 0:
        return -1
    return int(sliding_window) - 1
