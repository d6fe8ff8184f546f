"""One configuration tree: TrainConfig's sections, the options read off it, the stored layouts,
and CLI options derived from the dataclass fields (a new option is one field declaration)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Annotated, Any

import pytest
import typer
from pydantic import ValidationError
from typer.testing import CliRunner

from app.cli.options import given_options, with_config_options
from app.schemas_ops import TrainJobRequest
from app.workers.jobs import JOB_FIELDS, job_args, job_flag, train_argv
from policy.config_tree import build_tree, config_options, field_docs
from policy.evaluate import HeldOutConfig
from policy.params import ParamsConfig
from policy.rollout import RolloutConfig
from policy.sampler import SamplerConfig
from policy.train_config import TrainConfig, flat_view
from policy.update import UpdateConfig


def _at(cfg: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        cfg = getattr(cfg, key)
    return cfg


def test_sections_are_frozen_dataclasses_of_their_modules() -> None:
    cfg = TrainConfig()
    kinds = {
        "rollout": RolloutConfig, "sampler": SamplerConfig, "update": UpdateConfig,
        "params": ParamsConfig, "eval": HeldOutConfig,
    }  # fmt: skip
    for name, cls in kinds.items():
        section = getattr(cfg, name)
        assert type(section) is cls and cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.update.lr = 1.0  # type: ignore[misc]


def test_every_option_is_one_documented_field() -> None:
    cfg, options = TrainConfig(), TrainConfig.options()
    names = [o.name for o in options]
    assert len(names) == len(set(names))
    for opt in options:
        assert opt.doc, f"{opt.name} has no docstring under its field"
        assert _at(cfg, opt.path) == opt.default  # the default shown is the one used
    # the names the CLI, the API's jobs and from_preset share (today's flags unchanged)
    paths = {o.name: o.path for o in options}
    assert paths["lr"] == ("update", "lr") and paths["n_actions"] == ("rollout", "n_actions")
    assert paths["eval_queries"] == ("eval", "queries") and paths["params"] == ("params", "kind")
    assert paths["temperature"] == ("sampler", "temperature")
    assert "seed" in paths and ("sampler", "seed") not in paths.values()  # per-draw: set by code
    assert {"preset", "stack", "advantages", "mipu", "list_k"}.isdisjoint(paths)
    assert field_docs(UpdateConfig)["lr"] == "AdamW peak learning rate."


def test_flat_overrides_land_in_their_sections_and_validate_there() -> None:
    cfg = TrainConfig.from_preset(
        "casi", lr=1e-3, n_actions=3, eval_queries=5, eval_split="val", params="top",
        top_layers=4, temperature=1.0, line_cap=10, train_precision="bfloat16", seed=None,
    )  # fmt: skip
    assert cfg.update == UpdateConfig(lr=1e-3, train_precision="bfloat16")
    assert cfg.rollout == RolloutConfig(n_actions=3, line_cap=10)
    assert cfg.params == ParamsConfig(kind="top", top_layers=4)
    assert cfg.eval == HeldOutConfig(queries=5, split="val")
    guarded = TrainConfig.from_preset("casi", eval_queries=5, eval_refuse_degenerate=True)
    assert guarded.eval == HeldOutConfig(queries=5, refuse_degenerate=True)
    assert TrainConfig.from_dict(guarded.to_dict()) == guarded
    # a config stored before the option existed reads as unguarded
    stored = guarded.to_dict()
    del stored["eval"]["refuse_degenerate"]
    assert TrainConfig.from_dict(stored).eval == HeldOutConfig(queries=5)
    assert cfg.sampler.temperature == 1.0 and cfg.seed == 0  # None = not given
    # the sampler names the cap its draws use; a draw sets only seed and greedy
    assert cfg.sampler.max_new_tokens == cfg.rollout.response_cap
    draw = cfg.draw(7, greedy=True)
    assert draw == dataclasses.replace(cfg.sampler, seed=7, do_sample=False)
    for bad, fragment in (
        ({"line_cap": 1}, "line_cap must be >= 2"),
        ({"params": "half"}, "params must be one of"),
        ({"schedule": "step"}, "schedule must be one of"),
        ({"eval_split": "holdout"}, "eval_split must be one of"),
        ({"mini_batches": 9, "queries": 4}, "mini_batches must be in 1..queries"),
        ({"max_new_tokens": 64}, "format 'free' only"),
        ({"eval_refuse_degenerate": True, "format": "free"}, "constrained format only"),
        ({"warp": 1}, "unknown training option(s) ['warp']"),
    ):
        with pytest.raises(ValueError, match=re.escape(fragment)):
            TrainConfig.from_preset("casi", **bad)


def test_options_the_config_never_reads_are_named_not_ignored() -> None:
    full = TrainConfig.from_preset("casi")
    given = {"lora_rank": 8, "top_layers": 3, "mipu_samples": 4, "eval_every": 2, "lr": 1e-3,
             "eval_refuse_degenerate": True}  # fmt: skip
    idle = full.idle_options(given)
    assert [line.split()[0] for line in idle] == [
        "--lora-rank", "--top-layers", "--mipu-samples", "--eval-every", "--eval-refuse-degenerate",
    ]  # fmt: skip
    assert "--params lora" in idle[0] and "'casi' runs no MIPU check" in idle[2]
    # a value equal to the default changes nothing; options that are read pass
    assert full.idle_options({"lora_rank": 16, "eval_every": 0, "reuse_trunk": True}) == []
    read = TrainConfig.from_preset(
        "mipu", params="lora", lora_rank=8, mipu_samples=4, eval_queries=5, eval_every=2
    )
    assert read.idle_options({"lora_rank": 8, "mipu_samples": 4, "eval_every": 2}) == []
    assert TrainConfig.from_preset("casi", params="top").idle_options({"top_layers": 3}) == []
    # the API's training job refuses the one such field it carries at the request
    with pytest.raises(ValidationError, match="eval_every needs eval_queries > 0"):
        TrainJobRequest(preset="casi", eval_every=5)
    assert TrainJobRequest(preset="casi", eval_every=5, eval_queries=3).eval_every == 5


def test_stored_config_round_trips_and_the_flat_layout_still_loads() -> None:
    cfg = TrainConfig.from_preset("mipu", lr=2e-5, params="lora", lora_rank=4, eval_every=3)
    stored = cfg.to_dict()
    assert stored["update"]["lr"] == 2e-5 and "lr" not in stored  # nested on disk
    assert TrainConfig.from_dict(stored) == cfg
    # a run stored before the sections: every option at the top level
    flat = {
        k: v
        for k, v in stored.items()
        if k not in ("rollout", "sampler", "update", "params", "eval")
    }
    for opt in TrainConfig.options():
        if len(opt.path) == 2:
            value = _at(cfg, opt.path)
            flat[opt.name] = list(value) if isinstance(value, tuple) else value
    flat["precision"] = cfg.sampler.precision
    assert TrainConfig.from_dict(flat) == cfg
    view = flat_view(stored)
    assert view["lr"] == 2e-5 and view["eval_every"] == 3 and view["params"] == "lora"
    assert flat_view(flat)["lr"] == 2e-5


def test_api_job_fields_map_to_the_derived_flags() -> None:
    flags = [job_flag(f) for f in JOB_FIELDS]
    assert "--n-actions" in flags and "--eval-queries" in flags and "--lr" in flags
    argv = train_argv(7, "casi", {"n_actions": 3, "lr": 0.01, "policy": "abc123", "seed": None})
    assert argv[argv.index("--n-actions") + 1] == "3" and argv[argv.index("--lr") + 1] == "0.01"
    assert argv[argv.index("--policy") + 1] == "abc123" and "--seed" not in argv
    # any option type a request may carry becomes valid `casi train` arguments
    assert job_args("anchor_query", False) == ["--no-anchor"]
    assert job_args("anchor_query", True) == ["--anchor"]
    assert job_args("lora_targets", ["q_proj", "v_proj"]) == [
        "--lora-targets", "q_proj", "--lora-targets", "v_proj",
    ]  # fmt: skip
    # the API refuses a free-format cap on a constrained job at the request, not in the job
    with pytest.raises(ValidationError, match="format 'free' only"):
        TrainJobRequest(preset="casi", max_new_tokens=64)
    free = TrainJobRequest(preset="casi", format="free", max_new_tokens=64)
    assert (
        TrainConfig.from_preset(
            "casi", **free.model_dump(exclude={"preset"}, exclude_none=True)
        ).rollout.response_cap
        == 64
    )


def test_a_legacy_config_with_an_unknown_key_is_refused_not_dropped() -> None:
    flat = flat_view(TrainConfig().to_dict())
    legacy = {k: v for k, v in flat.items() if k not in ("rollout", "sampler", "update", "eval")}
    legacy["params"] = "full"
    assert TrainConfig.from_dict(legacy) == TrainConfig()
    with pytest.raises(ValueError, match=re.escape("unknown key(s) ['warp']")):
        TrainConfig.from_dict({**legacy, "warp": 3})


# ---------------------------------------------------------------------- one place per option


@dataclass(frozen=True)
class KnobUpdate(UpdateConfig):
    """UpdateConfig with one more setting: the field below is its whole declaration."""

    lr_floor: float = 0.25
    """Lowest LR factor of the schedule (a new option, declared in this test only)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.lr_floor <= 1:
            raise ValueError(f"lr_floor must be in [0, 1], got {self.lr_floor}")


@dataclass(frozen=True)
class KnobTrain(TrainConfig):
    update: KnobUpdate = field(default_factory=KnobUpdate, metadata={"section": ""})
    """The update section, with the new knob."""


def _command(root: type) -> typer.Typer:
    app = typer.Typer()

    @app.command()
    @with_config_options(config_options(root))
    def train(
        preset: Annotated[str, typer.Option(help="Loss preset.")] = "casi", **given: Any
    ) -> None:
        try:
            cfg = root(**build_tree(root, given_options(given), {"preset": preset}))
        except ValueError as exc:
            typer.echo(f"error: {exc}")
            raise typer.Exit(2) from exc
        typer.echo(
            f"lr={cfg.update.lr} floor={cfg.update.lr_floor} m={cfg.n_actions} anchor={cfg.anchor_query}"
        )

    @app.command()
    def other() -> None:  # a second command so typer keeps `train` as a subcommand
        pass

    return app


def test_a_new_field_is_a_cli_option_with_its_docstring_default_and_validation() -> None:
    runner, app = CliRunner(), _command(KnobTrain)
    help_text = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "200"}).output
    assert "--lr-floor" in help_text and "Lowest LR factor of the schedule" in help_text
    assert (
        "(default: 0.25)" in help_text and "--n-actions" in help_text and "--no-anchor" in help_text
    )
    out = runner.invoke(
        app, ["train", "--lr-floor", "0.5", "--lr", "0.001", "--n-actions", "3", "--no-anchor"]
    )
    assert out.exit_code == 0, out.output
    assert out.output.strip() == "lr=0.001 floor=0.5 m=3 anchor=False"
    assert runner.invoke(app, ["train"]).output.strip() == "lr=1e-05 floor=0.25 m=4 anchor=True"
    bad = runner.invoke(app, ["train", "--lr-floor", "2"])
    assert bad.exit_code == 2 and "lr_floor must be in [0, 1], got 2.0" in bad.output


def test_the_casi_commands_offer_every_option_of_the_tree() -> None:
    from app.cli import app as casi

    runner = CliRunner()
    train_help = runner.invoke(casi, ["train", "--help"], env={"COLUMNS": "250"}).output
    for opt in TrainConfig.options():
        assert f"--{opt.flag}" in train_help, opt.name
    exp_help = runner.invoke(
        casi, ["experiment", "credit", "--help"], env={"COLUMNS": "250"}
    ).output
    # offered, and refused under --protocol, which fixes every setting, credit included
    # (tests/hardening/test_cli_errors.py: "--protocol fixes every training setting")
    assert "--lora-rank" in exp_help and "--credit " in exp_help
    eval_help = runner.invoke(casi, ["eval", "--help"], env={"COLUMNS": "250"}).output
    assert all(f"--{o.flag}" in eval_help for o in config_options(RolloutConfig))


def test_no_float_setting_takes_an_infinite_or_nan_value() -> None:
    """Every float leaf of the tree (``--lr``, ``--temperature``, ``--weight-decay``, …) refuses
    inf and NaN by name: an infinite lr trained NaN weights and registered them as a policy."""
    floats = [o for o in TrainConfig.options() if o.type is float or o.type == float | None]
    assert {"lr", "temperature", "weight_decay"} <= {o.name for o in floats}
    for option in floats:
        for bad in (float("inf"), float("-inf"), float("nan")):
            with pytest.raises(ValueError, match=rf"\b{option.name}\b"):
                TrainConfig.from_preset("casi", **{option.name: bad})
