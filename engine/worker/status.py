"""What the worker runs on after start-up, and why not the fast path when it fell back.

Torch-free: the async engine, `/health` and the metrics read it. `ModelRunner.status` holds
it; `LLMEngine.accelerator` is the final one, after the attention probe and graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AcceleratorStatus:
    attention_backend: str  # "flashinfer" | "torch"
    # Set when FlashInfer was wanted (runtime.attention_backend auto, on CUDA) but could not
    # run: not importable, another version, a failed JIT build, plan or probe.
    attention_fallback_reason: str | None = None
    decode_graphs: bool = False  # decode-only steps replay captured CUDA graphs
    # Set when graphs were to be captured but capture failed: decode runs eagerly.
    graphs_fallback_reason: str | None = None

    def fallbacks(self) -> dict[str, str]:
        """Reason by component ("attention", "decode_graphs"), for each one that fell back."""
        reasons = {
            "attention": self.attention_fallback_reason,
            "decode_graphs": self.graphs_fallback_reason,
        }
        return {name: reason for name, reason in reasons.items() if reason is not None}


def describe_error(e: BaseException, limit: int = 300) -> str:
    """One line naming the exception, short enough for a health body or a metric label."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
