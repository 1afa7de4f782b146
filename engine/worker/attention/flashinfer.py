"""FlashInfer paged attention for CUDA: the GPU fast path over the shared NHD paged cache.

flashinfer is imported here, lazily, only for a CUDA device, and must be a 0.7.x release (the
version this code is written and checked against). Any failure (not installed, another
version, a keyword this version would drop) raises `FlashInferUnavailable` with the reason;
kernels are JIT-built at the first `plan()`/`run()`, which the start-up probe
(`attention/probe.py`) makes happen before serving, so a failed build falls back to the torch
backend there (`runtime.attention_backend: auto`) or stops start-up (`flashinfer`).

Per step (`begin_step`) the host builds the CSR plan arrays (`flashinfer_plan`) once; each
distinct kind of layer (heads, scale, window, soft cap, dtypes) gets one wrapper whose
`plan()` runs once per step, on the first layer of that kind, and is shared by all layers of
that kind. Decode-only steps use `BatchDecodeWithPagedKVCacheWrapper`; steps with prefill
chunks use `BatchPrefillWithPagedKVCacheWrapper` (causal, bottom-right aligned) for the whole
batch. K/V are written by a scatter through the slot mapping before attention.

fp8 pages (`cache.kv_dtype: fp8_e4m3`, `attention/kv_dtype.py`): the scatter casts K/V to
e4m3 (scale 1, saturating) and writes the bytes; every plan carries the cache's dtype as
`kv_data_type` and the query's as `q_data_type` (bf16/fp16), and `run()` gets no
`k_scale`/`v_scale` (FlashInfer's default 1). The FA2 kernels are the same templates
instantiated with an e4m3 KV type.

CUDA graphs: `make_graph_state` builds decode wrappers with `use_cuda_graph=True` over fixed
buffers for one padded batch size; `begin_graph_step` plans them (outside the graph, before
capture and before every replay) and makes `forward` use them.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.worker.attention.base import AttentionBackend, AttentionLayerSpec, AttentionMetadata
from engine.worker.attention.flashinfer_plan import (
    paged_kv_indptr,
    paged_kv_last_page_len,
    window_left,
)
from engine.worker.attention.kv_dtype import is_fp8, page_bytes, to_page_values

logger = logging.getLogger(__name__)

DEFAULT_WORKSPACE_BYTES = 256 << 20  # FlashInfer's split-KV scratch; its docs suggest 128 MiB
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# The release series the keywords and plan arguments here were checked against (0.7.2.post1).
SUPPORTED_VERSION = "0.7"
# FA2 for prefill (and tensor-core decode): the one built and checked on Hopper so far; "auto"
# would pick FA3 there, a much longer JIT build that has not been measured yet.
DEFAULT_PREFILL_BACKEND = "fa2"
# Keywords that only choose a kernel, never the result: dropped with a log line when a
# version lacks them. Any other keyword (window_left, logits_soft_cap, sm_scale, causal,
# use_cuda_graph and its buffers, the data types) changes what attention computes, so a
# version that would drop it is refused instead.
OPTIONAL_KWARGS = frozenset({"use_tensor_cores", "backend"})


class FlashInferUnavailable(RuntimeError):
    """FlashInfer cannot run here; the message says why."""


def import_flashinfer(device: torch.device) -> Any:
    """The flashinfer module, or `FlashInferUnavailable` naming the reason."""
    if device.type != "cuda":
        raise FlashInferUnavailable(f"FlashInfer needs a CUDA device, got {device}")
    if not torch.cuda.is_available():
        raise FlashInferUnavailable("torch reports no CUDA device")
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        raise FlashInferUnavailable(f"import flashinfer failed: {type(e).__name__}: {e}") from e
    return flashinfer


def check_version(module: Any) -> str:
    """`module.__version__` when it is a 0.7.x release; `FlashInferUnavailable` else."""
    version = str(getattr(module, "__version__", ""))
    series = ".".join(version.split(".")[:2])
    if series != SUPPORTED_VERSION:
        raise FlashInferUnavailable(
            f"flashinfer {version or '(no __version__)'} is not a {SUPPORTED_VERSION}.x release; "
            f"this engine's calls are checked against {SUPPORTED_VERSION}.x (0.7.2.post1)"
        )
    return version


@functools.cache
def _accepted_kwargs(fn: Callable) -> frozenset[str] | None:
    """Keyword names `fn` accepts; None when it takes **kwargs (accepts any)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params)


def call_compat(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call a FlashInfer API, passing every option by name.

    A keyword `fn` does not take is dropped (logged) only when it is in `OPTIONAL_KWARGS`;
    dropping any other would change the attention computed, so that raises
    `FlashInferUnavailable` naming it. Positional arguments are the ones stable across
    releases; a renamed or reordered optional parameter cannot be silently misassigned.
    """
    accepted = _accepted_kwargs(getattr(fn, "__func__", fn))
    if accepted is not None:
        dropped = sorted(k for k in kwargs if k not in accepted)
        required = [k for k in dropped if k not in OPTIONAL_KWARGS]
        if required:
            raise FlashInferUnavailable(
                f"{fn.__qualname__} does not accept {required}: this flashinfer would compute "
                "different attention than asked"
            )
        if dropped:
            logger.info("%s ignores optional arguments %s", fn.__qualname__, dropped)
            kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    return fn(*args, **kwargs)


@dataclass(frozen=True)
class PlanKey:
    """Layers with equal keys share one planned wrapper per step."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    window_left: int
    soft_cap: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype


def plan_key(layer: AttentionLayerSpec, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> PlanKey:
    return PlanKey(
        layer.num_heads,
        layer.num_kv_heads,
        layer.head_dim,
        float(layer.scale),
        window_left(layer.sliding_window),
        float(layer.logits_soft_cap or 0.0),
        q_dtype,
        kv_dtype,
    )


@dataclass
class _StepArrays:
    """Plan inputs for the current step: host int32 CSR arrays and device page indices."""

    metadata: AttentionMetadata
    decode_only: bool
    qo_indptr: torch.Tensor  # [R+1] int32, host
    kv_indptr: torch.Tensor  # [R+1] int32, host
    kv_last_page_len: torch.Tensor  # [R] int32, host
    kv_indices: torch.Tensor  # [pages] int32, device
    # (source row, block, offset) of each token's K/V write; built on the first layer.
    write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    planned: set[PlanKey] = field(default_factory=set)


def build_step_arrays(metadata: AttentionMetadata) -> _StepArrays:
    """The step's plan arrays: CSR offsets on the host (from the host seq_lens, as `plan()`
    wants them), page indices gathered on the block table's device with no host round trip."""
    seq_lens = metadata.seq_lens_cpu[: metadata.num_reqs]
    bs = metadata.block_size
    kv_indptr = paged_kv_indptr(seq_lens, bs)
    n = metadata.num_reqs
    indices = device_page_indices(
        metadata.block_tables[:n], metadata.seq_lens[:n], bs, int(kv_indptr[-1])
    )
    return _StepArrays(
        metadata=metadata,
        decode_only=metadata.is_decode_only,
        qo_indptr=torch.tensor(metadata.query_start_loc_cpu, dtype=torch.int32),
        kv_indptr=torch.from_numpy(kv_indptr),
        kv_last_page_len=torch.from_numpy(paged_kv_last_page_len(seq_lens, bs)),
        kv_indices=indices,
    )


def device_page_indices(
    block_tables: torch.Tensor,  # [R, width] int32, on the device
    seq_lens: torch.Tensor,  # [R] int32, on the device
    block_size: int,
    num_pages: int,  # sum of ceil(seq_lens / block_size), known on the host
) -> torch.Tensor:  # [num_pages] int32: each request's first ceil(len / bs) table entries
    """`paged_kv_indices` computed where the tables live, with no host copy and no sync
    (`num_pages` sizes every output). Equals `flashinfer_plan.build_paged_kv_plan`'s."""
    dev = block_tables.device
    pages = (seq_lens.long() + block_size - 1) // block_size  # [R]
    rows = torch.repeat_interleave(
        torch.arange(pages.shape[0], device=dev), pages, output_size=num_pages
    )  # [num_pages]: the request each page belongs to
    first = torch.cumsum(pages, 0) - pages  # [R]: each request's first page in the flat list
    cols = torch.arange(num_pages, device=dev) - first.index_select(0, rows)
    return block_tables[rows, cols].to(torch.int32)


@dataclass
class DecodeGraphState:
    """Decode wrappers for one padded batch size, bound to fixed device buffers.

    A captured graph reads the page table through these buffers, so `plan()` (which copies
    the step's arrays into them) must run before every replay.
    """

    batch_size: int
    indptr_buf: torch.Tensor  # [batch_size + 1] int32
    last_page_len_buf: torch.Tensor  # [batch_size] int32
    indices_buf: torch.Tensor  # [max_num_pages] int32, shared by all batch sizes
    wrappers: dict[PlanKey, Any]


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graphs = True
    cache_dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES

    def __init__(
        self,
        device: torch.device,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        prefill_backend: str = DEFAULT_PREFILL_BACKEND,
        decode_tensor_cores: bool | None = None,
        flashinfer_module: Any = None,
    ):
        """`decode_tensor_cores=None` uses tensor-core decode when a KV head serves >= 4 query
        heads (Llama-3-8B's group of 4 included, as mini-sglang does), where FlashInfer's
        CUDA-core decode kernel stops being the faster one. `prefill_backend`: FlashInfer's
        prefill implementation ("fa2" by default, see DEFAULT_PREFILL_BACKEND).
        `flashinfer_module` replaces the real import (tests drive the planning logic with a
        stand-in on the CPU); its version is checked like the real one's."""
        self._fi = flashinfer_module or import_flashinfer(device)
        version = check_version(self._fi)
        self.device = device
        self.prefill_backend = prefill_backend
        self.decode_tensor_cores = decode_tensor_cores
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self._prefill: dict[PlanKey, Any] = {}
        self._decode: dict[PlanKey, Any] = {}
        self._step: _StepArrays | None = None
        self._graph: DecodeGraphState | None = None
        self._graph_indices: torch.Tensor | None = None
        logger.info("flashinfer %s backend on %s", version, device)

    # ---- per-step planning ------------------------------------------------------------------
    def begin_step(self, metadata: AttentionMetadata) -> None:
        self._graph = None
        self._step = build_step_arrays(metadata)

    def _use_tensor_cores(self, key: PlanKey) -> bool:
        if self.decode_tensor_cores is not None:
            return self.decode_tensor_cores
        return key.num_heads // key.num_kv_heads >= 4

    def _new_decode(self, key: PlanKey, **graph_buffers: torch.Tensor) -> Any:
        """Tensor-core decode runs the prefill kernels of `prefill_backend` (FA2), named
        rather than left to "auto", which would ask which backend fits each plan's dtypes."""
        tensor_cores = self._use_tensor_cores(key)
        kernel = {"backend": self.prefill_backend} if tensor_cores else {}
        return call_compat(
            self._fi.BatchDecodeWithPagedKVCacheWrapper,
            self._workspace,
            "NHD",
            use_cuda_graph=bool(graph_buffers),
            use_tensor_cores=tensor_cores,
            **kernel,
            **graph_buffers,
        )

    def _new_prefill(self) -> Any:
        return call_compat(
            self._fi.BatchPrefillWithPagedKVCacheWrapper,
            self._workspace,
            "NHD",
            backend=self.prefill_backend,
        )

    def _plan(self, wrapper: Any, key: PlanKey, step: _StepArrays) -> None:
        common = dict(
            sm_scale=key.scale,
            window_left=key.window_left,
            logits_soft_cap=key.soft_cap,
            q_data_type=key.q_dtype,
            kv_data_type=key.kv_dtype,
        )
        bs = step.metadata.block_size
        heads = (key.num_heads, key.num_kv_heads, key.head_dim, bs)
        kv = (step.kv_indptr, step.kv_indices, step.kv_last_page_len)
        if step.decode_only:
            call_compat(wrapper.plan, *kv, *heads, **common)
        else:
            call_compat(wrapper.plan, step.qo_indptr, *kv, *heads, causal=True, **common)
        step.planned.add(key)

    def _wrapper(self, key: PlanKey, step: _StepArrays) -> Any:
        if self._graph is not None:
            return self._graph.wrappers[key]  # planned in begin_graph_step
        pool = self._decode if step.decode_only else self._prefill
        wrapper = pool.get(key)
        if wrapper is None:
            wrapper = self._new_decode(key) if step.decode_only else self._new_prefill()
            pool[key] = wrapper
        if key not in step.planned:
            self._plan(wrapper, key, step)
        return wrapper

    # ---- CUDA-graph hooks -------------------------------------------------------------------
    def make_graph_state(
        self,
        batch_size: int,
        max_num_pages: int,
        specs: Sequence[AttentionLayerSpec],
        dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
    ) -> DecodeGraphState:
        """Decode wrappers with `use_cuda_graph=True` for a padded batch of `batch_size`.

        `dtype`: the queries' (the model's); `kv_dtype`: the pages' (default `dtype`; fp8
        pages). `max_num_pages` bounds the pages of any batch this state will plan; the
        page-index buffer is shared by all states, so make the largest batch size first.
        """
        if self._graph_indices is None or self._graph_indices.numel() < max_num_pages:
            if self._graph_indices is not None:
                raise ValueError("make the largest graph state first: the page buffer is shared")
            self._graph_indices = torch.zeros(max_num_pages, dtype=torch.int32, device=self.device)
        indptr = torch.zeros(batch_size + 1, dtype=torch.int32, device=self.device)
        last = torch.ones(batch_size, dtype=torch.int32, device=self.device)
        keys = {plan_key(s, dtype, kv_dtype or dtype) for s in specs}
        wrappers = {
            key: self._new_decode(
                key,
                paged_kv_indptr_buffer=indptr,
                paged_kv_indices_buffer=self._graph_indices,
                paged_kv_last_page_len_buffer=last,
            )
            for key in keys
        }
        return DecodeGraphState(batch_size, indptr, last, self._graph_indices, wrappers)

    def begin_graph_step(self, state: DecodeGraphState, metadata: AttentionMetadata) -> None:
        """Plan `state`'s wrappers for this (padded, decode-only) step; call outside the graph."""
        if metadata.num_reqs != state.batch_size or not metadata.is_decode_only:
            raise ValueError(
                f"graph state for {state.batch_size} decode requests got {metadata.num_reqs} "
                f"requests (decode-only: {metadata.is_decode_only})"
            )
        step = build_step_arrays(metadata)
        if step.kv_indices.numel() > state.indices_buf.numel():
            raise ValueError(
                f"{step.kv_indices.numel()} pages exceed the graph page buffer "
                f"({state.indices_buf.numel()})"
            )
        for key, wrapper in state.wrappers.items():
            self._plan(wrapper, key, step)
        self._step = step
        self._graph = state

    # ---- forward ----------------------------------------------------------------------------
    def runs(self, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        """Queries of `q_dtype` over pages of `kv_dtype`: the same dtype, or fp8 pages."""
        return q_dtype in self.cache_dtypes and (kv_dtype == q_dtype or is_fp8(kv_dtype))

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        layer: AttentionLayerSpec,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        step = self._step
        if self._graph is None and (step is None or step.metadata is not metadata):
            self.begin_step(metadata)  # a caller that skipped begin_step still gets a plan
            step = self._step
        assert step is not None
        if not self.runs(q.dtype, kv_cache.dtype):
            raise FlashInferUnavailable(
                f"FlashInfer runs fp16/bf16 caches (or fp8 e4m3 pages beside fp16/bf16 "
                f"queries), not {kv_cache.dtype} pages with {q.dtype} queries; use model.dtype "
                "auto/bfloat16 on the GPU, or the torch backend for float32"
            )
        write_kv(kv_cache, k, v, step_write_indices(step))
        wrapper = self._wrapper(plan_key(layer, q.dtype, kv_cache.dtype), step)
        return wrapper.run(q.contiguous(), kv_cache)


def step_write_indices(step: _StepArrays) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Computed on the first layer (inside a captured graph, when capturing), then reused."""
    if step.write is None:
        meta = step.metadata
        step.write = slot_write_indices(meta.slot_mapping, meta.block_size)
    return step.write


def slot_write_indices(
    slot_mapping: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(source row, block, offset) per token such that slot -1 writes nowhere, with no sync.

    A token with slot -1 re-writes the first valid token's K/V into that token's slot: the
    same bytes to the same place, so the duplicate is harmless whichever write lands last.
    When every slot is -1 (only the dummy batch of a graph capture at start-up, when the
    cache holds nothing live) the rows land in slot 0.
    """
    valid = slot_mapping >= 0
    rows = torch.arange(slot_mapping.shape[0], device=slot_mapping.device)
    first_valid = torch.argmax(valid.to(torch.int32))
    src = torch.where(valid, rows, first_valid)
    slots = slot_mapping.index_select(0, src).clamp_min(0)
    return src, torch.div(slots, block_size, rounding_mode="floor"), slots % block_size


def write_kv(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    write: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """Scatter this step's K/V into the paged cache (NHD: [blocks, 2, block, heads, dim]),
    cast to the pages' dtype (fp8: e4m3 with scale 1, saturating; written as bytes)."""
    src, blocks, offsets = write
    pages = page_bytes(kv_cache)
    for i, x in ((0, k), (1, v)):
        values = to_page_values(x.index_select(0, src), kv_cache.dtype)
        pages[:, i].index_put_((blocks, offsets), values)
