"""The sampler's precision: which weights generate the rollouts.

Sampler precisions reproduce the train-inference mismatch of quantized deployment: the sampler
is a copy of the training model's weights in float32, bfloat16, int8 (torch dynamic
quantization of every nn.Linear: int8 weights AND int8 per-tensor activations, CPU only) or
int8_weight (weight-only int8, per output channel, symmetric; activations stay float32; any
device; the output embedding is left in float32 because it is tied to the input embedding).
Measured on SmolLM2-135M: int8 (W8A8) is far off (mean |Δ log p| ≈ 0.9-1.9 nats/token: the
activation outliers entering down_proj do not survive per-tensor int8), int8_weight ≈ 0.07 and
bfloat16 ≈ 0.04, so int8_weight is the realistic "quantized deployment" setting.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

PRECISIONS = ("float32", "bfloat16", "int8", "int8_weight")
INT8_MAX = 127  # symmetric int8 range used by the weight-only mode


def native_bf16(device: str | torch.device = "cpu") -> bool:
    """Does ``device`` multiply bfloat16 natively? CUDA: the driver says; CPU: AVX512-BF16 or
    AMX-BF16 in /proc/cpuinfo. Measured on an AVX2-only AMD EPYC (2 threads): a (2048 × 576) ×
    (576 × 1536) bfloat16 matmul takes 3.1 s against 47 ms in float32 — 65× SLOWER, so bf16 is
    a speed-up only where this is True."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            flags = next((line for line in fh if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_precision(precision: str, device: str | torch.device = "cpu") -> str:
    """'auto' → 'bfloat16' where the device multiplies it natively, else 'float32'."""
    if precision != "auto":
        return precision
    return "bfloat16" if native_bf16(device) else "float32"


def build_sampler_model(model: nn.Module, precision: str, copy_weights: bool = True) -> nn.Module:
    """A sampler built from the training model's current weights, in eval mode.

    float32 with ``copy_weights=False`` returns ``model`` itself (always in sync); otherwise a
    snapshot copy. int8 quantizes every nn.Linear dynamically (weights int8, activations
    quantized on the fly) and lives on CPU whatever the training model's device.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} (got {precision!r}).")
    if precision == "float32":
        if not copy_weights and next(model.parameters()).dtype == torch.float32:
            return model
        return copy.deepcopy(model).float().eval()
    if precision == "bfloat16":
        return copy.deepcopy(model).to(torch.bfloat16).eval()
    if precision == "int8_weight":
        return _weight_only_int8(copy.deepcopy(model).float().eval())
    with warnings.catch_warnings():  # torch.ao.quantization is deprecated but still works
        warnings.simplefilter("ignore")
        from torch.ao.quantization import quantize_dynamic

        cpu_copy = copy.deepcopy(model).float().cpu().eval()
        quantized: nn.Module = quantize_dynamic(  # type: ignore[no-untyped-call]
            cpu_copy, {nn.Linear}, dtype=torch.qint8
        )
        return quantized


@torch.no_grad()
def _weight_only_int8(model: nn.Module) -> nn.Module:
    """Round every nn.Linear weight (except the output embedding) to per-row symmetric int8."""
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    for module in model.modules():
        if isinstance(module, nn.Linear) and module is not output:
            weight = module.weight
            scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / INT8_MAX  # (out, 1)
            weight.copy_((weight / scale).round().clamp(-INT8_MAX, INT8_MAX) * scale)
    return model
