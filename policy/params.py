"""Which weights a training run updates: all of them, LoRA adapters, or the top N layers.

Read :func:`prepare_params`. It takes the loaded policy and a `TrainConfig` and returns a
:class:`TrainableParams`: the module the trainer runs (for LoRA, the same Hugging Face model
with adapter layers injected in place by ``peft``, so generation, the teacher-forced forward and
``state_dict`` work unchanged), and the frozen KL reference:

- ``full``: every weight trains; the reference is a frozen copy of the starting weights;
- ``lora``: LoRA on ``cfg.lora_targets`` (attention and MLP projections); the base weights are
  frozen, so the reference is the same model with the adapters disabled (:class:`AdaptersOff`),
  not a second copy of the weights;
- ``top``: only the last ``cfg.top_layers`` decoder layers and the final norm train; the
  embedding (tied to the output head) and the lower layers are frozen, so the backward stops at
  the lowest trained layer; the reference is a frozen copy.

Adapter checkpoints (`save_adapter_checkpoint`) hold only the adapter and name their base;
`policy.model.load_policy` loads such a folder by loading the base and merging the adapter in.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

ADAPTER_CONFIG = "adapter_config.json"
BASE_FILE = "casi_base.json"  # {"base_path": ..., "base_version": ...} beside the adapter


@dataclass
class TrainableParams:
    """The module to train, the KL reference (or None) and the peft handle (LoRA only)."""

    model: nn.Module
    reference: nn.Module | None
    peft: Any | None = None


class AdaptersOff(nn.Module):
    """The LoRA model's base: the same modules run with every adapter disabled (no copy).

    ``module`` exposes the wrapped Hugging Face model so `policy.sampler` reads its forward's
    keyword arguments (``logits_to_keep``, the cache) from the real signature.
    """

    _peft: Any
    module: Any

    def __init__(self, peft_model: Any) -> None:
        super().__init__()
        object.__setattr__(self, "_peft", peft_model)  # not a submodule: no parameters of its own
        object.__setattr__(self, "module", peft_model.get_base_model())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._peft.disable_adapter():
            return self.module(*args, **kwargs)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a Hugging Face causal LM (``model.model.layers``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no model.layers: params 'top' needs one")
    return layers


def prepare_params(
    model: nn.Module, cfg: Any, reference: nn.Module | None, *, with_reference: bool = True
) -> TrainableParams:
    """Make ``cfg.params`` of ``model`` trainable (in place) and build the KL reference.

    ``reference``: an explicit reference policy (full / top only), else the starting weights;
    ``with_reference`` False (a stack without KL): no reference is built. Full fine-tuning
    trains ``model`` itself (as before); lora / top train a copy, so the caller's model keeps
    its structure and flags (the experiment restores it between cells).
    """
    if cfg.params in ("lora", "top"):
        model = copy.deepcopy(model)
    if cfg.params == "lora":
        prepared = _lora(model, cfg)
        return prepared if with_reference else TrainableParams(prepared.model, None, prepared.peft)
    source = reference if reference is not None else model
    ref = _frozen(source) if with_reference else None
    if cfg.params == "top":
        layers = decoder_layers(model)
        if not 1 <= cfg.top_layers <= len(layers):
            raise ValueError(
                f"top_layers must be in 1..{len(layers)} for this model, got {cfg.top_layers}"
            )
        for p in model.parameters():
            p.requires_grad_(False)
        norm = getattr(getattr(model, "model", None), "norm", None)
        for module in [*layers[-cfg.top_layers :], *([norm] if norm is not None else [])]:
            for p in module.parameters():
                p.requires_grad_(True)
    return TrainableParams(model, ref)


def _lora(model: nn.Module, cfg: Any) -> TrainableParams:
    from peft import LoraConfig, get_peft_model

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = sorted(set(cfg.lora_targets) - present)
    if missing:
        raise ValueError(f"lora_targets {missing} are not modules of this model")
    lora = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.lora_targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, lora)
    base = peft_model.get_base_model()  # the same HF model object, adapters injected
    return TrainableParams(base.eval(), AdaptersOff(peft_model).eval(), peft_model)


def _frozen(model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def trainable_count(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def merged_copy(peft_model: Any) -> nn.Module:
    """A merged copy of ``peft_model`` (plain HF model; the adapter model is untouched): its
    ``policy.model.policy_version`` is the version an adapter checkpoint serves."""
    with _quiet():
        merged: nn.Module = copy.deepcopy(peft_model).merge_and_unload()
    return merged


def save_adapter(peft_model: Any, folder: Path, base_path: str | None, base_version: str) -> None:
    """Write the adapter (peft format) and the name of its base into ``folder``."""
    with _quiet():
        peft_model.save_pretrained(folder)
    (folder / BASE_FILE).write_text(
        json.dumps({"base_path": base_path, "base_version": base_version}), encoding="utf-8"
    )


def is_adapter_folder(folder: Path) -> bool:
    return (folder / ADAPTER_CONFIG).is_file() and (folder / BASE_FILE).is_file()


def adapter_base(folder: Path) -> dict[str, str]:
    """{"base_path", "base_version"} of an adapter checkpoint."""
    data: dict[str, str] = json.loads((folder / BASE_FILE).read_text(encoding="utf-8"))
    return data


def merge_adapter(base: nn.Module, folder: Path) -> nn.Module:
    """``base`` with the adapter in ``folder`` merged into its weights (plain HF model)."""
    from peft import PeftModel

    with _quiet():
        merged = PeftModel.from_pretrained(base, str(folder)).merge_and_unload()
    out: nn.Module = merged
    return out.eval()
