"""A stand-in `flashinfer` module for CPU tests: wrappers that follow FlashInfer's documented
contract (CSR page table, causal bottom-right alignment, `window_left`, soft cap, fixed plan
buffers in graph mode) with plain torch math, and the real backend built over it.

Data types as FlashInfer 0.7 handles them: `plan()` takes `q_data_type` (default float16)
and `kv_data_type` (default: the queries'), and `run()` refuses queries or pages of another
dtype than planned (its `_check_cached_qkv_data_type`). fp8 pages are widened to the
queries' dtype before the products (exact for e4m3 in bf16/fp16/fp32), `k_scale` multiplies
the softmax scale and `v_scale` the output (both default 1), as the FA2 kernels do: a
wrong cast on the write side shows up in the output, against the torch backend."""

from __future__ import annotations

import torch

from engine.worker.attention.flashinfer import FlashInferBackend


class _FakeWrapper:
    """Stores the plan like FlashInfer (into fixed buffers in graph mode); runs plain torch."""

    prefill = False

    def __init__(
        self,
        workspace,
        kv_layout="NHD",
        use_cuda_graph=False,
        use_tensor_cores=False,
        paged_kv_indptr_buffer=None,
        paged_kv_indices_buffer=None,
        paged_kv_last_page_len_buffer=None,
        backend="auto",
    ):
        assert kv_layout == "NHD"
        self.use_cuda_graph = use_cuda_graph
        self.backend = backend
        self.bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self.plans: list[dict] = []
        self.runs = 0

    def plan(self, *args, causal=False, sm_scale=None, window_left=-1, logits_soft_cap=0.0,
             q_data_type=torch.float16, kv_data_type=None):  # fmt: skip
        if self.prefill:
            qo, *args = args
        indptr, indices, last, heads, kv_heads, head_dim, page_size = args
        if not self.prefill:
            qo = torch.arange(len(last) + 1, dtype=torch.int32)
        assert indptr.dtype == indices.dtype == last.dtype == qo.dtype == torch.int32
        if self.use_cuda_graph:
            indptr_buf, indices_buf, last_buf = self.bufs
            assert len(last) == len(last_buf), "graph wrappers have a fixed batch size"
            indptr_buf.copy_(indptr)
            indices_buf[: len(indices)].copy_(indices)
            last_buf.copy_(last)
            indptr, indices, last = indptr_buf, indices_buf, last_buf
        self.plans.append(
            dict(qo=qo, indptr=indptr, indices=indices, last=last, heads=heads, kv_heads=kv_heads,
                 head_dim=head_dim, page_size=page_size, causal=causal, scale=sm_scale,
                 window_left=window_left, soft_cap=logits_soft_cap, q_dtype=q_data_type,
                 kv_dtype=kv_data_type or q_data_type)
        )  # fmt: skip

    def run(self, q, kv_cache, *, k_scale=None, v_scale=None):
        self.runs += 1
        p = self.plans[-1]
        if q.dtype != p["q_dtype"] or kv_cache.dtype != p["kv_dtype"]:
            raise ValueError(
                f"planned q {p['q_dtype']} / kv {p['kv_dtype']}, got q {q.dtype} / kv "
                f"{kv_cache.dtype}"
            )
        kv_cache = kv_cache.to(q.dtype)  # fp8 pages widened to the queries' dtype
        scale = p["scale"] * (1.0 if k_scale is None else k_scale)
        out = torch.zeros_like(q)
        group = p["heads"] // p["kv_heads"]
        for i in range(len(p["qo"]) - 1):
            q0, q1 = int(p["qo"][i]), int(p["qo"][i + 1])
            pages = p["indices"][int(p["indptr"][i]) : int(p["indptr"][i + 1])].long()
            kv_len = (len(pages) - 1) * p["page_size"] + int(p["last"][i])
            keys = kv_cache[pages, 0].reshape(-1, p["kv_heads"], p["head_dim"])[:kv_len]
            vals = kv_cache[pages, 1].reshape(-1, p["kv_heads"], p["head_dim"])[:kv_len]
            keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
            vals = vals.repeat_interleave(group, dim=1).transpose(0, 1)
            qi = q[q0:q1].transpose(0, 1)  # [H, n, D]
            scores = qi @ keys.transpose(1, 2) * scale
            if p["soft_cap"] > 0:
                scores = p["soft_cap"] * torch.tanh(scores / p["soft_cap"])
            qpos = torch.arange(kv_len - (q1 - q0), kv_len)[:, None]  # bottom-right aligned
            kpos = torch.arange(kv_len)[None, :]
            allowed = kpos <= qpos if (p["causal"] or q1 - q0 == 1) else torch.ones_like(kpos > 0)
            if p["window_left"] >= 0:
                allowed = allowed & (kpos >= qpos - p["window_left"])
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[q0:q1] = (scores.softmax(-1) @ vals).transpose(0, 1)
        return out if v_scale is None else out * v_scale


class _FakePrefill(_FakeWrapper):
    prefill = True


class FakeFlashInfer:
    __version__ = "0.7.2.post1"  # the series the backend accepts
    BatchDecodeWithPagedKVCacheWrapper = _FakeWrapper
    BatchPrefillWithPagedKVCacheWrapper = _FakePrefill


def fake_backend() -> FlashInferBackend:
    """The real backend over the stand-in module; float32 allowed so it can match exactly."""
    backend = FlashInferBackend(
        torch.device("cpu"), workspace_bytes=16, flashinfer_module=FakeFlashInfer
    )
    backend.cache_dtypes = (torch.float32,)
    return backend
