"""Load loss-stack presets from configs/*.toml into a validated `StackConfig`.

A preset file has top-level stack keys (pg, terms, aggregation, horizon, entropy_coef, and an
optional free-text `description`), one table per nested section ([clip], [importance],
[seq_mask], [kl], [kl.dual], [critic], [sections.<name>] for a registered extension term, ...)
and the trainer's tables (TRAINER_SECTIONS: [advantages], [mipu]), which are not loss settings
and are read by `TrainConfig.from_preset`. Unknown keys are errors. Read `load_preset` first.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Final

from policy.losses.config import StackConfig, build_config
from policy.losses.stack import LossStack

PRESET_DIR = Path(__file__).resolve().parent / "_configs"
"""The presets: package data ``policy/losses/_configs/`` — in the source tree a symlink to
configs/ at the repository root (the one copy), in a wheel the files themselves."""

TRAINER_SECTIONS: Final = ("advantages", "mipu")
"""Preset tables that are not loss settings: the credit shaping ([advantages] →
`policy.advantages.ShapingConfig`) and the MIPU check ([mipu] → `policy.mipu.MipuConfig`).
`load_preset` leaves them out; `policy.train_config.TrainConfig.from_preset` builds them."""


def available_presets(directory: Path = PRESET_DIR) -> list[str]:
    """Sorted preset names (file stems) in `directory`."""
    return sorted(p.stem for p in directory.glob("*.toml"))


def _resolve(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise FileNotFoundError(f"preset file {p} not found")
        return p
    candidate = PRESET_DIR / f"{name_or_path}.toml"
    if not candidate.is_file():
        raise ValueError(f"unknown preset {str(name_or_path)!r}; valid: {available_presets()}")
    return candidate


def read_preset(name_or_path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The preset's file and its TOML table (the free-text `description` dropped)."""
    path = _resolve(name_or_path)
    with path.open("rb") as f:
        data = tomllib.load(f)
    data.pop("description", None)
    return path, data


def load_preset(name_or_path: str | Path) -> StackConfig:
    """Preset by name (configs/<name>.toml) or path → validated `StackConfig`.

    The file's TRAINER_SECTIONS are left out (`TrainConfig.from_preset` builds them). Raises
    ValueError naming the file and saying how to fix an invalid value or combination, and
    KeyError-derived ValueError for a term name that is not registered.
    """
    path, data = read_preset(name_or_path)
    stack = {k: v for k, v in data.items() if k not in TRAINER_SECTIONS}
    try:
        cfg = build_config(StackConfig, stack, "top level")
        LossStack(cfg)  # every term name must resolve in the registry
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"{path}: {err}") from err
    return cfg
