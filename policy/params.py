"""Which weights a training run updates: all of them, LoRA adapters, or the top N layers.

Read :func:`prepare_params`. It takes the loaded policy and a :class:`ParamsConfig` (the run's
``TrainConfig.params`` section) and returns a
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

PARAMS = ("full", "lora", "top")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_CONFIG = "adapter_config.json"
BASE_FILE = "casi_base.json"  # {"base_path": ..., "base_version": ...} beside the adapter


@dataclass(frozen=True)
class ParamsConfig:
    """Which weights train (`TrainConfig.params`)."""

    kind: str = field(default="full", metadata={"option": "params"})
    """Which weights train: full (every weight) | lora (LoRA adapters on lora_targets; the base
    is frozen) | top (only the top `top_layers` transformer layers; the backward stops there)."""
    lora_rank: int = 16
    """LoRA rank r (params = lora)."""
    lora_alpha: float = 32.0
    """LoRA scale numerator: the update is (alpha / r)·BA."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input (0 keeps the step deterministic given the seed)."""
    lora_targets: tuple[str, ...] = LORA_TARGETS
    """Module names (attention and MLP projections) that get adapters."""
    top_layers: int = 2
    """N of params = top: the last N transformer layers (and the final norm) train."""
    reuse_trunk: bool = True
    """params = top: the frozen layers below the trained ones run once, in the sampler; the
    training forward starts from the hidden state the sampler recorded there (not with
    --reference, or several processes: then they are recomputed). Off: always recompute."""

    def __post_init__(self) -> None:
        if self.kind not in PARAMS:
            raise ValueError(f"params must be one of {list(PARAMS)}, got {self.kind!r}")
        if self.lora_rank < 1:
            raise ValueError(f"lora_rank must be >= 1, got {self.lora_rank}")
        if not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha must be > 0, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        targets = tuple(self.lora_targets)  # JSON and the CLI give a list
        object.__setattr__(self, "lora_targets", targets)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(f"lora_targets must be non-empty module names, got {targets!r}")
        if self.top_layers < 1:
            raise ValueError(f"top_layers must be >= 1, got {self.top_layers}")


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
    model: nn.Module, cfg: ParamsConfig, reference: nn.Module | None, *, with_reference: bool = True
) -> TrainableParams:
    """Make ``cfg.kind`` of ``model``'s weights trainable (in place) and build the KL reference.

    ``reference``: an explicit reference policy (full / top only), else the starting weights;
    ``with_reference`` False (a stack without KL): no reference is built. Full fine-tuning
    trains ``model`` itself (as before); lora / top train a copy, so the caller's model keeps
    its structure and flags (the experiment restores it between cells).
    """
    if cfg.kind in ("lora", "top"):
        model = copy.deepcopy(model)
    if cfg.kind == "lora":
        prepared = _lora(model, cfg)
        return prepared if with_reference else TrainableParams(prepared.model, None, prepared.peft)
    source = reference if reference is not None else model
    ref = _frozen(source) if with_reference else None
    if cfg.kind == "top":
        trained = {id(p) for p in top_params(model, cfg.top_layers)}
        for p in model.parameters():
            p.requires_grad_(id(p) in trained)
    return TrainableParams(model, ref)


def check_params(model: nn.Module, cfg: ParamsConfig) -> None:
    """Raise ValueError, before anything is built, when ``cfg`` does not fit ``model``: more top
    layers than it has, or LoRA targets it lacks (what `prepare_params` would refuse later)."""
    if cfg.kind == "top":
        top_params(model, cfg.top_layers)
    elif cfg.kind == "lora":
        _lora_missing(model, cfg)


def top_params(model: nn.Module, top_layers: int) -> list[nn.Parameter]:
    """The weights of the top ``top_layers`` decoder layers and the final norm (what ``params =
    top`` trains; the embedding, tied to the output head, and the layers below stay frozen)."""
    layers = decoder_layers(model)
    if not 1 <= top_layers <= len(layers):
        raise ValueError(
            f"top_layers must be in 1..{len(layers)} for this model, got {top_layers} — it has "
            f"{len(layers)} decoder layers"
        )
    norm = getattr(getattr(model, "model", None), "norm", None)
    modules = [*layers[-top_layers:], *([norm] if norm is not None else [])]
    return [p for module in modules for p in module.parameters()]


def _lora(model: nn.Module, cfg: ParamsConfig) -> TrainableParams:
    from peft import LoraConfig, get_peft_model

    _lora_missing(model, cfg)
    lora = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,  # type: ignore[arg-type]  # peft scales by alpha / r: a float works
        lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.lora_targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, lora)
    base = peft_model.get_base_model()  # the same HF model object, adapters injected
    return TrainableParams(base.eval(), AdaptersOff(peft_model).eval(), peft_model)


def _lora_missing(model: nn.Module, cfg: ParamsConfig) -> None:
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    if missing := sorted(set(cfg.lora_targets) - present):
        raise ValueError(
            f"lora_targets {missing} are not modules of this model — name its projections "
            f"(the default: {','.join(LORA_TARGETS)})"
        )


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
