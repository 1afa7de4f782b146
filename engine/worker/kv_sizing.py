"""How many KV blocks fit: an explicit count, a CPU size in GiB, or a GPU memory fraction.

On the GPU the budget is `memory_fraction * total` minus what is already allocated (the
weights) minus the activation peak of a profiling forward at `max_num_batched_tokens`,
measured by the runner and passed in as `activation_peak_bytes`.

Under tensor parallelism every rank sizes its own cache from its own geometry (its KV
heads) and memory, and all take the smallest count (`size_kv_cache`): the scheduler on
rank 0 hands out one set of block ids that every rank's cache must hold.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from engine.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from engine.core.admission import max_request_blocks
from engine.core.step_io import NewRequestData, SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.worker.models.parallel import TensorParallel
from engine.worker.sampler import SamplingRow

logger = logging.getLogger(__name__)

# Kept free for CUDA graph pools and FlashInfer workspaces, which are allocated after sizing.
GRAPH_RESERVE_BYTES = 1 << 30

_GIB = 1 << 30


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the pages' (cache.kv_dtype resolved): fp8 e4m3 counts 1 byte
    # Bytes per block of another cache indexed by the same block ids (a draft model's).
    extra_bytes_per_block: int = 0

    @classmethod
    def of(cls, model, block_size: int, dtype: torch.dtype) -> KVGeometry:
        """The cache geometry of `model` (its KV heads: this rank's, under tensor parallelism)
        with pages of `dtype`."""
        return cls(model.num_layers, block_size, model.num_kv_heads, model.head_dim, dtype)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        own = self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem
        return own + self.extra_bytes_per_block


def check_room_for_one_request(
    num_blocks: int, block_size: int, max_model_len: int, key: str, sized_by: str
) -> None:
    """Refuses start-up, naming `key` (the setting that sized the pool), when one request of
    model.max_model_len tokens would not fit: the KV-fit rule admission applies
    (`max_request_blocks`), for every sizing path (explicit count, CPU GiB, GPU fraction)."""
    need = max_request_blocks(max_model_len, block_size)
    if num_blocks < need:
        raise ConfigError(
            key,
            f"{sized_by} gives {num_blocks} KV blocks of {block_size} tokens, but one "
            f"model.max_model_len={max_model_len} request needs {need}; raise {key} or lower "
            "model.max_model_len",
        )


def size_kv_cache(
    runner, config: EngineConfig, geom: KVGeometry, max_model_len: int, tp: TensorParallel
) -> int:
    """KV blocks for the runner's device (GPU: memory fraction after profiling; else the CPU
    rule), the smallest over the tensor-parallel ranks (each rank calls this in step)."""
    if runner.device.type == "cuda":
        n = size_gpu_kv_cache(runner, config.cache, config.scheduler, geom, max_model_len)
    else:
        n = size_cpu_kv_cache(config.cache, geom, max_model_len)
    return tp.min_int(n)


def size_cpu_kv_cache(cache: CacheConfig, geom: KVGeometry, max_model_len: int) -> int:
    """Blocks for the CPU pool (`num_blocks_for_cpu`); fails at start, naming the key, when
    not even one max_model_len request would fit."""
    num_blocks = num_blocks_for_cpu(cache, geom)
    if cache.num_kv_blocks is not None:
        key, sized_by = "cache.num_kv_blocks", f"cache.num_kv_blocks={cache.num_kv_blocks}"
    else:
        key, sized_by = "cache.cpu_kv_cache_gib", f"cache.cpu_kv_cache_gib={cache.cpu_kv_cache_gib}"
    check_room_for_one_request(num_blocks, geom.block_size, max_model_len, key, sized_by)
    return num_blocks


def num_blocks_for_cpu(cache: CacheConfig, geom: KVGeometry) -> int:
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    return max(1, int(cache.cpu_kv_cache_gib * _GIB) // geom.bytes_per_block)


def num_blocks_for_gpu(
    cache: CacheConfig,
    geom: KVGeometry,
    total_bytes: int,
    allocated_bytes: int,
    activation_peak_bytes: int,
) -> int:
    """Blocks that fit in `memory_fraction` of the device after weights and activations."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    budget = int(cache.memory_fraction * total_bytes) - allocated_bytes - activation_peak_bytes
    n = budget // geom.bytes_per_block
    if n < 1:
        raise ValueError(
            "cache.memory_fraction: leaves no room for the KV cache "
            f"(budget {budget / _GIB:.2f} GiB after weights and activations); raise it or "
            "lower scheduler.max_num_batched_tokens"
        )
    return int(n)


def size_gpu_kv_cache(
    runner, cache: CacheConfig, sched: SchedulerConfig, geom: KVGeometry, max_model_len: int
) -> int:
    """Profiles the activation peak, then fits KV blocks into the memory fraction.

    Fails at start (naming the key) when not even one max_model_len request would fit."""
    if cache.num_kv_blocks is not None:
        n = cache.num_kv_blocks
        check_room_for_one_request(
            n, geom.block_size, max_model_len, "cache.num_kv_blocks", f"cache.num_kv_blocks={n}"
        )
        return n
    device = runner.device
    torch.cuda.empty_cache()
    peak = profile_activation_peak(runner, sched, geom.block_size, max_model_len)
    free, total = torch.cuda.mem_get_info(device)
    used = total - free  # weights, the CUDA context, and anything outside PyTorch
    num_blocks = num_blocks_for_gpu(cache, geom, total, used, peak + GRAPH_RESERVE_BYTES)
    check_room_for_one_request(
        num_blocks, geom.block_size, max_model_len, "cache.memory_fraction",
        f"cache.memory_fraction={cache.memory_fraction} of {total / _GIB:.1f} GiB, after "
        f"weights and activations ({used / _GIB:.2f} + {peak / _GIB:.2f} GiB),",
    )  # fmt: skip
    logger.info(
        "kv sizing total_gib=%.1f used_gib=%.2f activation_peak_gib=%.2f blocks=%d",
        total / _GIB, used / _GIB, peak / _GIB, num_blocks,
    )  # fmt: skip
    return num_blocks


def profile_requests(sched: SchedulerConfig, max_model_len: int) -> list[int]:
    """Prompt lengths of a profiling step: the whole token budget over as many requests as
    max_num_seqs allows (each < max_model_len), so logits and sampling run at full width."""
    total = sched.max_num_batched_tokens
    per_req = min(max_model_len - 1, max(1, -(-total // sched.max_num_seqs)))
    lens: list[int] = []
    while sum(lens) < total and len(lens) < sched.max_num_seqs:
        lens.append(min(per_req, total - sum(lens)))
    return lens


# The profiling step asks for what a served step can: every prompt token's logprobs (top 20,
# the most allowed) and top-p sampling, so the chunked logits and the sort are in the peak.
PROFILE_PARAMS = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, prompt_logprobs=20)


def profile_kv_blocks(sched: SchedulerConfig, block_size: int, max_model_len: int) -> int:
    """KV blocks `profile_step` writes into (blocks 0 .. n-1)."""
    return sum(math.ceil(n / block_size) for n in profile_requests(sched, max_model_len))


def profile_step(runner, sched: SchedulerConfig, block_size: int, max_model_len: int) -> None:
    """The largest step a served engine can run, on whatever device the runner has, into a KV
    cache of at least `profile_kv_blocks` blocks.

    One forward at max_num_batched_tokens over `profile_requests`, each prompt token scored
    (prompt logprobs, in the runner's bounded chunks), sampled with top-p; then one sampler
    pass with top-p over max_num_seqs rows of full-vocabulary logits (the decode step with
    the most rows, whose sort is [max_num_seqs, vocab])."""
    lens = profile_requests(sched, max_model_len)
    blocks_per = [math.ceil(n / block_size) for n in lens]
    so = SchedulerOutput(total_num_scheduled_tokens=sum(lens))
    first = 0
    for i, (n, nb) in enumerate(zip(lens, blocks_per, strict=True)):
        rid = f"profile-{i}"
        blocks = list(range(first, first + nb))
        first += nb
        so.scheduled_new_reqs.append(NewRequestData(rid, [0] * n, [], PROFILE_PARAMS, blocks, 0))
        so.num_scheduled_tokens[rid] = n
    runner.execute(so)
    runner.execute(SchedulerOutput(finished_req_ids=set(so.num_scheduled_tokens)))
    vocab = runner.model.vocab_size
    logits = torch.randn(sched.max_num_seqs, vocab, device=runner.device)  # compute_logits: fp32
    rows = [SamplingRow(PROFILE_PARAMS, (), 1, 0) for _ in range(sched.max_num_seqs)]
    runner.sampler(logits, rows)


def profile_activation_peak(
    runner, sched: SchedulerConfig, block_size: int, max_model_len: int
) -> int:
    """Peak activation bytes of `profile_step` (GPU sizing), its KV cache not counted."""
    runner.allocate_kv_cache(profile_kv_blocks(sched, block_size, max_model_len))
    base = torch.cuda.memory_allocated(runner.device)
    torch.cuda.reset_peak_memory_stats(runner.device)
    profile_step(runner, sched, block_size, max_model_len)
    peak = torch.cuda.max_memory_allocated(runner.device) - base
    runner.kv_caches = []
    torch.cuda.empty_cache()
    return peak
