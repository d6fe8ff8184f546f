"""`TrainConfig`: everything one training run needs, frozen and validated once.

Built from a preset (configs/*.toml: the loss stack → `StackConfig`, its [advantages] table →
`ShapingConfig`, its [mipu] table → `MipuConfig`) plus CLI overrides
(`TrainConfig.from_preset(name, **overrides)`). Every field has a docstring; `__post_init__`
rejects bad values with a message that says how to fix them. The config is stored with the run,
so `casi train --resume` rebuilds exactly the same trainer (`from_dict` also reads configs
stored when [advantages] and [mipu] were carried inside the stack).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from evaluator.limits import MAX_PLAYERS
from policy.advantages import CREDIT_MODES, ShapingConfig
from policy.constrain import DEFAULT_LINE_CAP, FORMATS, MIN_LINE_CAP, free_response_cap
from policy.losses.config import StackConfig, build_config
from policy.mipu import MipuConfig
from policy.precision import PRECISIONS
from policy.rollout import PROMPT_STYLES
from policy.sampler import SamplerConfig

SCHEDULES = ("constant", "linear", "cosine")
TRAIN_PRECISIONS = ("float32", "bfloat16")
PARAMS = ("full", "lora", "top")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PRESET_SECTIONS = ("advantages", "mipu")
"""The fields built from a preset's trainer tables (`policy.losses.presets.TRAINER_SECTIONS`)."""


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


@dataclass(frozen=True)
class TrainConfig:
    """One training run. B queries × G samples × m actions per step."""

    preset: str = "casi"
    """Loss-stack preset name (configs/<name>.toml) or path; recorded with the run."""
    stack: StackConfig = field(default_factory=StackConfig)
    """The loss stack (from the preset): loss settings only."""
    advantages: ShapingConfig = field(default_factory=ShapingConfig)
    """Credit shaping (the preset's [advantages] table; docs/methods.md §2). `credit` overrides
    its credit mode (`shaping`)."""
    mipu: MipuConfig | None = None
    """The MIPU accept / rollback check (the preset's [mipu] table; docs/methods.md §3.14); None
    or enabled = false: no check (`mipu_check`)."""
    steps: int = 20
    """Optimizer steps (rollout batches) in the run."""
    queries: int = 4
    """B: TRAIN queries per step, in a seeded shuffle that runs through epochs."""
    samples: int = 4
    """G: samples per query (the group of the base advantage), >= 2."""
    n_actions: int = 4
    """m: rewrites asked for in one generation (players of the credit game), 1..MAX_PLAYERS."""
    list_k: int = 10
    """K of the coalition lists and of the evaluator's nDCG@K."""
    anchor_query: bool = True
    """The user's query is in every coalition (v(∅) = query alone; docs/methods.md §1). False = plain game."""
    credit: str | None = None
    """Override the preset's credit: shapley | singleton | leave_one_out | broadcast."""
    lr: float = 1e-5
    """AdamW peak learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay (0: only the gradient moves the weights)."""
    schedule: str = "constant"
    """LR schedule after warm-up: constant | linear (to 0 at the last step) | cosine."""
    warmup_steps: int = 0
    """Linear LR warm-up steps (from 0 to lr)."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip."""
    micro_batch_size: int = 8
    """Sequences per forward/backward; the gradient does not depend on it (global counts)."""
    mini_batches: int = 1
    """Optimizer steps per rollout batch (PPO epochs over shuffled-free, query-aligned splits).
    With 1 the step is on-policy: π_old is the loss forward itself (no extra forward)."""
    temperature: float = 0.7
    """Sampler temperature (part of μ and of π; docs/methods.md §0 convention)."""
    top_p: float = 1.0
    """Nucleus truncation of sampling only."""
    format: str = "constrained"
    """constrained: every response is exactly m numbered non-empty lines, by construction, and
    μ, π_old, π and the reference are the constrained policy (docs/methods.md); free: whatever
    the model writes (malformed responses are partial games)."""
    line_cap: int = DEFAULT_LINE_CAP
    """Content tokens per rewrite line before the line is ended (constrained format); also
    sizes the free format's derived length cap."""
    max_new_tokens: int | None = None
    """Free format only: response length cap; None = derived from m and line_cap. The
    constrained format's cap is always derived (no answer is cut before its m-th line)."""
    precision: str = "float32"
    """Sampler precision: float32 | bfloat16 | int8 | int8_weight (TIS corrects the mismatch)."""
    train_precision: str = "float32"
    """Training forward: float32, or bfloat16 autocast (fp32 master weights and optimizer)."""
    prompt: str = "oneshot"
    """Prompt style: oneshot (with a worked example) | short (a format-trained policy)."""
    seed: int = 0
    """Seeds the query order, every sampler draw and torch."""
    eval_every: int = 0
    """Held-out evaluation every N steps (0 = only before and after the run, if eval_queries > 0)."""
    eval_queries: int = 0
    """TEST claims in each held-out evaluation (the first N of the split); 0 = none."""
    eval_split: str = "test"
    """Split of the held-out evaluation."""
    checkpoint_every: int = 0
    """Register a policy-version checkpoint every N steps (0 = only at the end)."""
    state_every: int = 1
    """Save the full resume state (weights, optimizer, scheduler, RNG) every N steps."""
    mipu_samples: int = 2
    """G of the MIPU validation batch (same step queries, the updated sampler)."""
    reference: str | None = None
    """KL reference policy (a path or version); None = the starting policy, frozen. With
    params = lora the reference is the base model with the adapters disabled (no copy)."""
    params: str = "full"
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

    def __post_init__(self) -> None:
        _check(self.steps >= 1, f"steps must be >= 1, got {self.steps}")
        _check(self.queries >= 1, f"queries (B) must be >= 1, got {self.queries}")
        _check(
            self.samples >= 2,
            f"samples (G) must be >= 2: group advantages need a group, got {self.samples}",
        )
        _check(
            1 <= self.n_actions <= MAX_PLAYERS,
            f"n_actions (m) must be in 1..{MAX_PLAYERS} (exact Shapley is 2^m), got {self.n_actions}",
        )
        _check(self.list_k >= 1, f"list_k must be >= 1, got {self.list_k}")
        _check(
            self.credit is None or self.credit in CREDIT_MODES,
            f"credit must be one of {list(CREDIT_MODES)}, got {self.credit!r}",
        )
        _check(self.lr >= 0 and self.weight_decay >= 0, "lr and weight_decay must be >= 0")
        _check(
            self.schedule in SCHEDULES,
            f"schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}",
        )
        _check(
            0 <= self.warmup_steps < self.steps or self.warmup_steps == 0,
            f"warmup_steps must be in [0, steps), got {self.warmup_steps}",
        )
        _check(self.max_grad_norm > 0, f"max_grad_norm must be > 0, got {self.max_grad_norm}")
        _check(
            self.micro_batch_size >= 1,
            f"micro_batch_size must be >= 1, got {self.micro_batch_size}",
        )
        _check(
            1 <= self.mini_batches <= self.queries,
            f"mini_batches must be in 1..queries ({self.queries}): each mini-batch holds whole query groups, got {self.mini_batches}",
        )
        _check(
            self.precision in PRECISIONS,
            f"precision must be one of {list(PRECISIONS)}, got {self.precision!r}",
        )
        _check(
            self.train_precision in TRAIN_PRECISIONS,
            f"train_precision must be one of {list(TRAIN_PRECISIONS)}, got {self.train_precision!r}",
        )
        _check(
            self.prompt in PROMPT_STYLES,
            f"prompt must be one of {list(PROMPT_STYLES)}, got {self.prompt!r}",
        )
        _check(
            self.eval_every >= 0 and self.eval_queries >= 0,
            "eval_every and eval_queries must be >= 0",
        )
        _check(
            self.checkpoint_every >= 0,
            f"checkpoint_every must be >= 0, got {self.checkpoint_every}",
        )
        _check(self.state_every >= 1, f"state_every must be >= 1, got {self.state_every}")
        _check(
            self.mipu_samples >= 2,
            f"mipu_samples must be >= 2 (validation advantages need a group), got {self.mipu_samples}",
        )
        _check(
            self.format in FORMATS, f"format must be one of {list(FORMATS)}, got {self.format!r}"
        )
        _check(
            self.line_cap >= MIN_LINE_CAP,
            f"line_cap must be >= {MIN_LINE_CAP}, got {self.line_cap}",
        )
        _check(
            self.format == "free" or self.max_new_tokens is None,
            "max_new_tokens applies to format 'free' only: the constrained format's cap is "
            "derived from n_actions and line_cap (set line_cap instead)",
        )
        self._check_params()
        SamplerConfig(
            temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.response_cap
        )

    def _check_params(self) -> None:
        _check(self.params in PARAMS, f"params must be one of {list(PARAMS)}, got {self.params!r}")
        _check(self.lora_rank >= 1, f"lora_rank must be >= 1, got {self.lora_rank}")
        _check(self.lora_alpha > 0, f"lora_alpha must be > 0, got {self.lora_alpha}")
        _check(
            0 <= self.lora_dropout < 1, f"lora_dropout must be in [0, 1), got {self.lora_dropout}"
        )
        _check(
            len(self.lora_targets) > 0 and all(isinstance(t, str) and t for t in self.lora_targets),
            f"lora_targets must be non-empty module names, got {self.lora_targets!r}",
        )
        _check(self.top_layers >= 1, f"top_layers must be >= 1, got {self.top_layers}")
        _check(
            self.params != "lora" or self.reference is None,
            "with params = lora the KL reference is the base model (adapters off); drop --reference",
        )

    @property
    def response_cap(self) -> int:
        """Free format's length cap (given, or derived from m and line_cap)."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        return free_response_cap(self.n_actions, self.line_cap)

    # ------------------------------------------------------------------ derived views

    @property
    def shaping(self) -> ShapingConfig:
        """The [advantages] section, with the `credit` override applied."""
        base = self.advantages
        return base if self.credit is None else dataclasses.replace(base, credit=self.credit)  # type: ignore[arg-type]

    @property
    def mipu_check(self) -> MipuConfig | None:
        """The [mipu] section when enabled, else None (no check)."""
        m = self.mipu
        return m if m is not None and m.enabled else None

    def sampler(self, seed: int, *, greedy: bool = False) -> SamplerConfig:
        """Sampler settings for one draw (each step and purpose gets its own seed)."""
        return SamplerConfig(
            temperature=self.temperature,
            top_p=self.top_p,
            max_new_tokens=self.response_cap,
            seed=seed,
            precision=self.precision,
            do_sample=not greedy,
        )

    # ------------------------------------------------------------------ (de)serialization

    @classmethod
    def from_preset(cls, preset: str, **overrides: Any) -> TrainConfig:
        """The preset's stack, [advantages] and [mipu] plus overrides; None-valued overrides
        are ignored. An invalid preset raises ValueError naming the file and the fix."""
        from policy.losses.presets import load_preset, read_preset

        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        _check(not unknown, f"unknown training option(s) {unknown}")
        given = {k: v for k, v in overrides.items() if v is not None}
        stack = load_preset(preset)
        path, table = read_preset(preset)
        try:
            sections = _preset_sections(table)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{path}: {err}") from err
        return cls(preset=preset, stack=stack, **sections, **given)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form, the resolved loss stack included (stored with the run)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Rebuild from `to_dict` output exactly (the stored stack, not today's preset file)."""
        data = dict(data)
        stack_table = dict(data.pop("stack"))
        for name in PRESET_SECTIONS:  # runs stored when the stack carried these sections
            legacy = stack_table.pop(name, None)
            data.setdefault(name, legacy)
        stack = build_config(StackConfig, stack_table, "stack")
        sections = _preset_sections({k: data.pop(k) for k in PRESET_SECTIONS})
        if "lora_targets" in data:  # JSON turns the tuple into a list
            data["lora_targets"] = tuple(data["lora_targets"])
        if "format" not in data:  # runs stored before the constrained format sampled freely
            data["format"] = "free"
        return cls(stack=stack, **sections, **data)


def _preset_sections(table: Mapping[str, Any]) -> dict[str, Any]:
    """`advantages` and `mipu` from their tables (absent or None: the defaults)."""
    adv, mipu = table.get("advantages") or {}, table.get("mipu")
    return {
        "advantages": build_config(ShapingConfig, dict(adv), "advantages"),
        "mipu": build_config(MipuConfig, dict(mipu), "mipu") if mipu is not None else None,
    }


def stored_section(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """Section `name` ("advantages", "mipu") of a stored `to_dict()` config, in either layout:
    a field of its own, or (runs stored before it moved) inside "stack"; {} when absent."""
    section = config.get(name)
    if section is None:
        section = (config.get("stack") or {}).get(name)
    return dict(section or {})
