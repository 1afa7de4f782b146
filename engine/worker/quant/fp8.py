"""fp8 (e4m3) weights on CUDA: per-output-channel scales, `torch._scaled_mm` (sm 89+).

    check_fp8_device(device, key)   ConfigError naming `key` unless a CUDA GPU with fp8
                                    tensor cores (compute capability >= 8.9: Ada, Hopper)
    fp8_capable(device)             the same question, answered with a bool
    check_kv_dtype(kv_dtype, dev)   the same for `cache.kv_dtype: fp8_e4m3`
    quantize_fp8_rows(w)            (e4m3 [N, K], fp32 scale [N]): scale = max|row| / 448
    quantize_fp8_activations(x)     the same per row of activations, in five kernels
    Fp8Linear                       a QuantLinear whose finalize keeps e4m3 rows and whose
                                    forward quantizes x per row (dynamic) and multiplies with
                                    `torch._scaled_mm` (row-wise scales), output in x's dtype;
                                    a pre-quantized checkpoint's rows (`Fp8Rows`) are kept as
                                    stored, and its float layers (those the checkpoint left
                                    unquantized) stay float

The scale and layout logic is plain torch and runs (and is tested) on the CPU; only the
matmul needs the GPU. torch is asked about CUDA only inside the checks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.config import ConfigError
from engine.worker.quant.fp8_rows import Fp8Rows, concat_fp8_rows
from engine.worker.quant.linear import QuantLinear

E4M3_MAX = 448.0
MIN_CAPABILITY = (8, 9)


def check_fp8_device(device: torch.device, key: str) -> None:
    if device.type != "cuda":
        raise ConfigError(
            key,
            f"fp8 runs only on CUDA GPUs with fp8 tensor cores (compute capability >= 8.9); "
            f"this engine runs on {device.type}",
        )
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < MIN_CAPABILITY:
        raise ConfigError(
            key, f"fp8 needs compute capability >= 8.9; this GPU is sm {cap[0]}{cap[1]}"
        )


def fp8_capable(device: torch.device) -> bool:
    try:
        check_fp8_device(device, "")
    except ConfigError:
        return False
    return True


def check_kv_dtype(kv_dtype: str, device: torch.device) -> None:
    """`cache.kv_dtype`: auto always; fp8_e4m3 refused at start where fp8 does not run (a
    CPU, a GPU below sm 89). The pages also need FlashInfer: the runner's backend choice
    refuses the torch backend for them (`engine.worker.attention.selection.select_attention_backend`)."""
    if kv_dtype == "auto":
        return
    check_fp8_device(device, "cache.kv_dtype")


def quantize_fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (e4m3 [N, K], fp32 scale [N]) with w ~= q * scale[:, None]."""
    scale = (w.float().abs().amax(dim=1) / E4M3_MAX).clamp(min=1e-12)
    q = (w.float() / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_fp8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] finite float -> (e4m3 [M, K], fp32 scale [M, 1]), scale = max|row| / 448 (at
    least 1e-12): the dynamic per-token quantization `_scaled_mm` is fed, once per linear.

    Five elementwise kernels where the plain formula (`x.float().abs().amax()`, a clamp to
    +-448, then the cast) takes nine, with the same bits: at batch 1 each kernel costs a few
    microseconds even inside a CUDA graph, about what the weight read of a 4096-wide layer
    saves by being fp8. The row maximum reads x as it is (`vector_norm` with ord inf,
    accumulated in fp32: exact); dividing a bf16 tensor by the fp32 scale promotes and
    divides in fp32, as `x.float() / scale` does; no clamp is needed before the cast, since
    |x| / scale exceeds 448 by at most one rounding of the quotient and e4m3 rounds anything
    under 464 to at most 448."""
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=1, keepdim=True, dtype=torch.float32)
    scale = amax.div_(E4M3_MAX).clamp_min_(1e-12)
    return (x / scale).to(torch.float8_e4m3fn), scale


def dequantize_fp8_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


class Fp8Linear(QuantLinear):
    """e4m3 weight rows with per-channel scales; see the module docstring.

    `quantize_float` False (a pre-quantized checkpoint): float shards are the layers the
    checkpoint left unquantized and stay float."""

    quantize_float = True

    def finalize(self) -> str:
        parts = self._take_parts()
        device = self._device()
        if all(isinstance(p, Fp8Rows) for p in parts):
            rows = concat_fp8_rows(parts).to(device)  # the checkpoint's own bytes and scales
            q, scale, how = rows.q, rows.scale.float(), "fp8 e4m3 as stored (per-channel scales)"
        else:
            parts = [p.dequantize() if isinstance(p, Fp8Rows) else p for p in parts]
            dense = torch.cat([p.to(self.act_dtype) for p in parts]).to(device)
            if not self.quantize_float:  # left unquantized by the checkpoint: float
                self.dense = dense
                return f"dense {str(self.act_dtype).removeprefix('torch.')}"
            q, scale = quantize_fp8_rows(dense)
            how = "fp8 e4m3 (per-channel scales)"
        self.register_buffer("fp8_weight", q, persistent=False)
        self.register_buffer("fp8_scale", scale.view(1, -1), persistent=False)
        return how

    def weight_bytes(self) -> int:
        if not hasattr(self, "fp8_weight"):
            return super().weight_bytes()
        return self.fp8_weight.numel() + self.fp8_scale.numel() * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "fp8_weight"):  # a float layer of a pre-quantized checkpoint
            return super().forward(x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.device.type != "cuda":  # the reference path (tests): same values, F.linear
            w = dequantize_fp8_rows(self.fp8_weight, self.fp8_scale.view(-1)).to(x.dtype)
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, w, bias)
        xq, xs = quantize_fp8_activations(x2)
        y = torch._scaled_mm(
            xq, self.fp8_weight.t(), scale_a=xs, scale_b=self.fp8_scale, out_dtype=x.dtype,
            bias=None if self.bias is None else self.bias.to(x.dtype),
        )  # fmt: skip
        return y.view(*lead, self.out_features)


def to_fp8(model: torch.nn.Module) -> int:
    """Replaces every float linear except the LM head by an Fp8Linear of its weight (for
    benchmarks on random weights; checkpoints go through `model.quantization: fp8`).
    Returns how many."""
    count = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear) or name == "lm_head":
            continue
        layer = Fp8Linear(module.in_features, module.out_features, module.bias is not None,
                          target=None, dtype=module.weight.dtype)  # fmt: skip
        layer.to(module.weight.device)
        layer.load_tensor("weight", None, module.weight.detach())
        if module.bias is not None:
            layer.load_tensor("bias", None, module.bias.detach())
        layer.finalize()
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
        count += 1
    return count
