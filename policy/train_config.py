"""`TrainConfig`: everything one training run needs, one frozen tree validated once.

The tree: run-level fields (B, G, the game, seeds, checkpoints) and frozen sections, each a
dataclass of its own module that validates itself —

| field | section | what |
| --- | --- | --- |
| ``stack``, ``advantages``, ``mipu`` | `StackConfig`, `ShapingConfig`, `MipuConfig` | from the preset (configs/*.toml) |
| ``rollout`` | `policy.rollout.RolloutConfig` | m, format, line cap, length cap, prompt (shared with the held-out evaluation) |
| ``sampler`` | `policy.sampler.SamplerConfig` | temperature, top_p, precision (per-draw seed / greedy set at each draw) |
| ``update`` | `policy.update.UpdateConfig` | optimizer, schedule, micro/mini-batches, training precision |
| ``params`` | `policy.params.ParamsConfig` | full / LoRA / top-N layers |
| ``eval`` | `policy.evaluate.HeldOutConfig` | held-out evaluation: every, queries, split, the degenerate guard |

Nothing is copied between them: the trainer hands ``update`` to the update, ``rollout`` to the
sampler and the evaluation, ``params`` to `prepare_params`. Every user-settable leaf is ONE
declaration (name, type, default, the docstring under it, its section's ``__post_init__``);
`policy.config_tree.config_options` reads them off the tree, and the ``casi train`` /
``casi experiment`` options, the API's training-job flags and ``from_preset``'s keywords are
derived from that list (flat names: ``lr``, ``n_actions``, ``eval_queries``, ``params``…).

The config is stored with the run (``to_dict``: the nested tree), so `casi train --resume`
rebuilds exactly the same trainer; ``from_dict`` also reads the flat layout stored before the
sections existed, and configs that carried [advantages] / [mipu] inside the stack.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from policy.advantages import CREDIT_MODES, ShapingConfig
from policy.config_tree import (
    ConfigOption,
    build_tree,
    config_options,
    nonfinite_fields,
    option_table,
)
from policy.evaluate import HeldOutConfig
from policy.losses.config import StackConfig, build_config
from policy.mipu import MipuConfig
from policy.params import ParamsConfig
from policy.rollout import RolloutConfig
from policy.sampler import SamplerConfig
from policy.update import UpdateConfig

PRESET_SECTIONS = ("advantages", "mipu")
"""The fields built from a preset's trainer tables (`policy.losses.presets.TRAINER_SECTIONS`)."""
SAMPLER_OPTIONS = ("temperature", "top_p", "precision")
"""The sampler fields a user sets; seed, greedy and the length cap are set at each draw."""


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _section(factory: Any, prefix: str = "", options: tuple[str, ...] | None = None) -> Any:
    meta: dict[str, Any] = {"section": prefix}
    if options is not None:
        meta["options"] = options
    return field(default_factory=factory, metadata=meta)


@dataclass(frozen=True)
class TrainConfig:
    """One training run. B queries × G samples × m actions per step."""

    preset: str = field(default="casi", metadata={"option": False})
    """Loss-stack preset name (configs/<name>.toml) or path; recorded with the run."""
    stack: StackConfig = field(default_factory=StackConfig, metadata={"option": False})
    """The loss stack (from the preset): loss settings only."""
    advantages: ShapingConfig = field(default_factory=ShapingConfig, metadata={"option": False})
    """Credit shaping (the preset's [advantages] table; docs/methods.md §2). `credit` overrides
    its credit mode (`shaping`)."""
    mipu: MipuConfig | None = field(default=None, metadata={"option": False})
    """The MIPU accept / rollback check (the preset's [mipu] table; docs/methods.md §3.14); None
    or enabled = false: no check (`mipu_check`)."""
    steps: int = 20
    """Optimizer steps (rollout batches) in the run."""
    queries: int = 4
    """B: TRAIN queries per step, in a seeded shuffle that runs through epochs."""
    samples: int = 4
    """G: samples per query (the group of the base advantage), >= 2."""
    list_k: int = field(default=10, metadata={"option": False})
    """K of the coalition lists and of the evaluator's nDCG@K (the server's CASI_LIST_K)."""
    anchor_query: bool = field(default=True, metadata={"flag": "anchor"})
    """The user's query is in every coalition (v(∅) = query alone; docs/methods.md §1). False = plain game."""
    credit: str | None = None
    """Override the preset's credit: shapley | singleton | leave_one_out | broadcast (plain GRPO)
    | shuffled (placebo: each rollout's Shapley credits permuted among its actions)."""
    seed: int = 0
    """Seeds the query order, every sampler draw and torch."""
    checkpoint_every: int = 0
    """Register a policy-version checkpoint every N steps (0 = only at the end)."""
    state_every: int = 1
    """Save the full resume state (weights, optimizer, scheduler, RNG) every N steps."""
    mipu_samples: int = 2
    """G of the MIPU validation batch (same step queries, the updated sampler)."""
    reference: str | None = None
    """KL reference policy (a path or version); None = the starting policy, frozen. With
    params = lora the reference is the base model with the adapters disabled (no copy)."""
    refuse_degenerate: bool = False
    """Play a degenerate rewrite (a string of repeats: evaluator.text.degenerate) as an empty
    action: it retrieves nothing, so it adds nothing to v(N) and every credit mode gives it 0
    (docs/methods.md §1.10)."""
    rollout: RolloutConfig = _section(RolloutConfig)
    """What one generation is (m, format, caps, prompt)."""
    sampler: SamplerConfig = _section(
        lambda: SamplerConfig(temperature=0.7), options=SAMPLER_OPTIONS
    )
    """How the training rollouts are drawn (temperature, top_p, the sampler's precision)."""
    update: UpdateConfig = _section(UpdateConfig)
    """The optimizer and the update's batching and precision."""
    params: ParamsConfig = _section(ParamsConfig)
    """Which weights train."""
    eval: HeldOutConfig = _section(HeldOutConfig, prefix="eval")
    """The run's held-out evaluations."""

    def __post_init__(self) -> None:
        if bad := nonfinite_fields(self):
            name, value = bad[0]
            _check(False, f"{name.rsplit('.', 1)[-1]} must be a finite number, got {value}")
        _check(0 <= self.seed < 2**63, f"seed must be in 0..2^63 - 1, got {self.seed}")
        _check(self.steps >= 1, f"steps must be >= 1, got {self.steps}")
        _check(self.queries >= 1, f"queries (B) must be >= 1, got {self.queries}")
        _check(
            self.samples >= 2,
            f"samples (G) must be >= 2: group advantages need a group, got {self.samples}",
        )
        _check(self.list_k >= 1, f"list_k must be >= 1, got {self.list_k}")
        _check(
            self.credit is None or self.credit in CREDIT_MODES,
            f"credit must be one of {list(CREDIT_MODES)}, got {self.credit!r}",
        )
        _check(
            self.update.warmup_steps < self.steps or self.update.warmup_steps == 0,
            f"warmup_steps must be in [0, steps), got {self.update.warmup_steps}",
        )
        _check(
            self.update.mini_batches <= self.queries,
            f"mini_batches must be in 1..queries ({self.queries}): each mini-batch holds whole query groups, got {self.update.mini_batches}",
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
            not self.eval.refuse_degenerate or self.rollout.format == "constrained",
            "eval_refuse_degenerate guards the constrained format only: drop --format free or "
            "--eval-refuse-degenerate",
        )
        _check(
            self.params.kind != "lora" or self.reference is None,
            "with params = lora the KL reference is the base model (adapters off); drop --reference",
        )
        # the stored sampler names the cap its draws use (the rollout's), not a stale default
        cap = self.rollout.response_cap
        if self.sampler.max_new_tokens != cap:
            object.__setattr__(
                self, "sampler", dataclasses.replace(self.sampler, max_new_tokens=cap)
            )

    # ------------------------------------------------------------------ derived views

    @property
    def n_actions(self) -> int:
        """m (``rollout.n_actions``): the players of every step's credit game."""
        return self.rollout.n_actions

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

    def draw(self, seed: int, *, greedy: bool = False) -> SamplerConfig:
        """The sampler settings of one draw (each step and purpose gets its own seed)."""
        return dataclasses.replace(self.sampler, seed=seed, do_sample=not greedy)

    def idle_options(self, given: Mapping[str, Any]) -> list[str]:
        """Of the flat options a user ``given`` (name → value), those this config never reads,
        each as ``"--flag has no effect here — why"`` (``--lora-rank 8`` with params = full): a
        command refuses them rather than ignore them in silence. A value equal to the option's
        default changes nothing and passes (``--eval-every 0``)."""
        needs = {
            **dict.fromkeys(
                ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets"),
                (self.params.kind == "lora", "it sets the LoRA adapters: add --params lora"),
            ),
            **dict.fromkeys(
                ("top_layers", "reuse_trunk"),
                (self.params.kind == "top", "it belongs to --params top: add --params top"),
            ),
            "feedback_words": (
                self.rollout.needs_context,
                "it sizes the feedback prompt's context: add --prompt feedback",
            ),
            "mipu_samples": (
                self.mipu_check is not None,
                f"the preset {self.preset!r} runs no MIPU check: choose a preset with [mipu] enabled",
            ),
            **dict.fromkeys(
                ("eval_every", "eval_split", "eval_refuse_degenerate"),
                (self.eval.queries > 0, "no held-out evaluation runs with eval_queries 0: set --eval-queries"),
            ),
        }  # fmt: skip
        options = {o.name: o for o in self.options()}
        return [
            f"--{options[name].flag} has no effect here — {needs[name][1]}"
            for name, value in given.items()
            if name in needs and not needs[name][0] and value != options[name].default
        ]

    # ------------------------------------------------------------------ options and (de)serialization

    @classmethod
    def options(cls) -> tuple[ConfigOption, ...]:
        """The user-settable leaves of the tree (flat name, path, type, default, docstring)."""
        return config_options(cls)

    @classmethod
    def from_preset(cls, preset: str, **overrides: Any) -> TrainConfig:
        """The preset's stack, [advantages] and [mipu] plus flat overrides (`options` names:
        ``lr=…``, ``n_actions=…``); None-valued overrides are ignored. An invalid preset
        raises ValueError naming the file and the fix."""
        from policy.losses.presets import load_preset, read_preset

        stack = load_preset(preset)
        path, table = read_preset(preset)
        try:
            sections = _preset_sections(table)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{path}: {err}") from err
        return cls(**build_tree(cls, overrides, {"preset": preset, "stack": stack, **sections}))

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: the nested tree, the resolved loss stack included (stored with the run)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        """Rebuild from `to_dict` output exactly (the stored stack, not today's preset file);
        a config stored in the flat layout (before the sections) is read too."""
        data = dict(data)
        stack_table = dict(data.pop("stack"))
        for name in PRESET_SECTIONS:  # runs stored when the stack carried these sections
            legacy = stack_table.pop(name, None)
            data.setdefault(name, legacy)
        base: dict[str, Any] = {
            "stack": build_config(StackConfig, stack_table, "stack"),
            **_preset_sections({k: data.pop(k) for k in PRESET_SECTIONS}),
        }
        if "rollout" not in data:  # the flat layout: every option at the top level
            if "format" not in data:  # runs stored before the constrained format sampled freely
                data["format"] = "free"
            table = option_table(cls)
            flat = {k: data.pop(k) for k in list(data) if k in table}
            top = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(data) - top)
            if unknown:
                raise ValueError(f"unknown key(s) {unknown} in the stored training config")
            base.update(data)
            return cls(**build_tree(cls, flat, base))
        return build_config(cls, {**data, **base}, "config")  # sections from their tables


def flat_view(stored: Mapping[str, Any]) -> dict[str, Any]:
    """For display: a stored config (either layout) with every option under its flat name
    (``lr``, ``eval_queries``; the preset's sections stay for `stored_section`, but ``params``
    is the option's value, not its section: never rebuild a config from this view); a flat
    config stored before the format existed shows ``format`` free, as it ran."""
    out = dict(stored)
    if "rollout" not in stored and "format" not in stored:
        out["format"] = "free"
    for opt in TrainConfig.options():
        section = stored.get(opt.path[0]) if len(opt.path) > 1 else None
        if isinstance(section, Mapping) and opt.path[1] in section:
            out[opt.name] = section[opt.path[1]]
    return out


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
