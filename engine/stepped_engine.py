"""The contract between the async layer and the engine it drives.

`AsyncEngine` runs any object with this shape on its engine thread: `LLMEngine` in the
product, a stand-in in tests (tests/support/fake_engine.py). Only `prepare_request` may run
on another thread.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from engine.core.policy.tenant import Tenant
from engine.lora_request import LoRARequest
from engine.output.request_output import RequestDelta
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm_engine import EngineStats
    from engine.worker.status import AcceleratorStatus


class PreparedLike(Protocol):
    """A validated, tokenized request (`LLMEngine.PreparedRequest`)."""

    request_id: str
    prompt_token_ids: list[int]


class SteppedEngine(Protocol):
    """What AsyncEngine needs of the engine it drives: `LLMEngine`, or a test's stand-in.

    `prepare_request` may run on any thread; everything else runs on the engine thread.
    `task` (generate | embed) and `embedding_size` are read where present (LLMEngine has
    them); a stand-in without them serves generation.
    """

    config: EngineConfig
    tokenizer: Any
    model_name: str
    max_model_len: int
    accelerator: AcceleratorStatus  # attention backend, decode graphs, fallback reasons

    def prepare_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | tuple[str, ...] | None = None,
        lora_request: LoRARequest | None = None,
        tenant: Tenant | None = None,
        deadline: float | None = None,
    ) -> PreparedLike: ...

    def add_prepared(self, prepared: Any) -> None: ...

    def abort(self, request_ids: str | Iterable[str]) -> None: ...

    def step(self) -> list[RequestDelta]: ...

    def fail_step(self, message: str) -> list[RequestDelta]: ...

    def fail_all(self, message: str) -> list[RequestDelta]: ...

    def has_request(self, request_id: str) -> bool: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    # LoRA adapters (LLMEngine's; a stand-in needs them only where a test uses adapters).
    # add_lora, list_loras and is_lora_loaded may run on any thread.
    def add_lora(self, lora: LoRARequest) -> None: ...

    def remove_lora(self, lora_name: str) -> None: ...

    def list_loras(self) -> list[LoRARequest]: ...

    def is_lora_loaded(self, lora: LoRARequest) -> bool: ...

    def lora_in_use(self, lora_name: str) -> bool: ...

    @property
    def fatal_error(self) -> str | None:
        """Why no step can ever run again (e.g. a tensor-parallel worker died), else None.
        Read from any thread."""
        ...

    def close(self) -> None:
        """Releases what outlives a step (tensor-parallel workers); after the loop stopped."""
        ...

    def set_wakeup(self, wake: Any) -> None:
        """`wake()` may be called from any thread when background work needs a step."""
        ...

    def flush_kv_tier(self, timeout_s: float) -> int:
        """Drain: writes the pool's cached blocks to the KV disk tier for at most
        `timeout_s` (0 without one); after the loop stopped, before `close`."""
        ...
