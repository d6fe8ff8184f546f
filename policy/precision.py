"""The sampler's precision: which weights generate the rollouts.

Sampler precisions reproduce the train-inference mismatch of quantized deployment: the sampler
is a copy of the training model's weights in float32, bfloat16, int8 (torch dynamic
quantization of every nn.Linear: int8 weights AND int8 per-tensor activations, CPU only) or
int8_weight (weight-only int8, per output channel, symmetric; activations stay float32; any
device; the output embedding is left in float32 because it is tied to the input embedding).
Measured on SmolLM2-135M: int8 (W8A8) is far off (mean |Δ log p| ≈ 0.9-1.9 nats/token: the
activation outliers entering down_proj do not survive per-tensor int8), int8_weight ≈ 0.07 and
bfloat16 ≈ 0.04, so int8_weight is the realistic "quantized deployment" setting.

A float32 sampler on CPU multiplies with prepacked weights (`PACK_LINEAR`): every nn.Linear's
weight is reordered once, when the sampler is built, into oneDNN's blocked layout, and the
decode step's matrix products run on it (`torch.ops.mkldnn._linear_pointwise`). `F.linear`
hands MKL the plain weight on every call, which repacks it: at the decode batch's 32 rows that
costs more than the product. The values are float32 products summed in another order (a few
ulps from `F.linear`, as `F.linear` itself differs between batch sizes), and unlike `F.linear`
a row's result does not depend on the rows beside it.
"""

from __future__ import annotations

import copy
import itertools
import warnings

import torch
from torch import nn

PRECISIONS = ("float32", "bfloat16", "int8", "int8_weight")
INT8_MAX = 127  # symmetric int8 range used by the weight-only mode
PACK_LINEAR = True
"""Lever: a float32 CPU sampler multiplies with prepacked weights (module docstring). False:
the previous path, `F.linear` on the training model's own weights (kept for the benchmark)."""
PACK_ROWS = 32
"""The batch-size hint of the reorder: the decode batch of a training step (8 × 4 rows)."""


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

    float32 on CPU where `packable`: a `packed_view` (the Linear weights prepacked, a
    snapshot; the other tensors shared with ``model``, or with a copy of it when
    ``copy_weights``). Otherwise float32 with ``copy_weights=False`` returns ``model`` itself
    (always in sync), else a snapshot copy. int8 quantizes every nn.Linear dynamically
    (weights int8, activations quantized on the fly) and lives on CPU whatever the training
    model's device.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} (got {precision!r}).")
    if precision == "float32":
        if packable(model):
            return packed_view(copy.deepcopy(model) if copy_weights else model)
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


class PackedLinear(nn.Module):
    """An nn.Linear for inference on CPU: its float32 weight reordered once into oneDNN's
    blocked layout, each forward one `mkldnn._linear_pointwise`. A snapshot: later changes to
    the source layer's weight do not reach it."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():  # plain attributes: opaque mkldnn tensors stay out of state_dict
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_ROWS)
            self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, "none", [], ""
        )
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def sampler_kernels(device: str | torch.device = "cpu") -> str:
    """How a float32 sampler on ``device`` multiplies: "packed" (`PACK_LINEAR` on, a CPU with
    oneDNN) or "plain" (`F.linear`). Adapter (LoRA) models always multiply plain."""
    onednn = bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
    on = PACK_LINEAR and torch.device(device).type == "cpu" and onednn
    return "packed" if on else "plain"


def packable(model: nn.Module) -> bool:
    """Can a float32 sampler of ``model`` run on prepacked weights? `PACK_LINEAR` on, oneDNN
    built in, the model's float32 weights on CPU, and no adapter layers (a PEFT layer reads its
    sub-layers' ``.weight``)."""
    if sampler_kernels("cpu") != "packed":
        return False
    params = list(model.parameters())
    if not params or any(p.device.type != "cpu" or p.dtype != torch.float32 for p in params):
        return False
    return not any(type(m).__module__.startswith("peft") for m in model.modules())


def packed_view(model: nn.Module) -> nn.Module:
    """``model``'s module tree, in eval mode, with every nn.Linear replaced by a `PackedLinear`
    of its current weight; every other parameter and buffer is shared with ``model``, not
    copied. Rebuild it after an update (the trainer does at every sampler sync)."""
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    view = copy.deepcopy(model, shared)
    for parent in list(view.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child))
    return view.eval()


def is_packed(model: nn.Module) -> bool:
    """Is ``model`` a `packed_view`?"""
    return any(isinstance(m, PackedLinear) for m in model.modules())
