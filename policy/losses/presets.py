"""Load loss-stack presets from configs/*.toml into a validated `StackConfig`.

A preset file has top-level stack keys (pg, terms, aggregation, horizon, entropy_coef, and an
optional free-text `description`) and one table per nested section ([clip], [importance],
[seq_mask], [kl], [kl.dual], [critic], [advantages], [mipu], ...). Unknown keys are errors.
Read `load_preset` first.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from policy.losses.config import StackConfig
from policy.losses.stack import LossStack

PRESET_DIR = Path(__file__).resolve().parent / "_configs"
"""The presets: package data ``policy/losses/_configs/`` — in the source tree a symlink to
configs/ at the repository root (the one copy), in a wheel the files themselves."""

T = TypeVar("T")


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


def load_preset(name_or_path: str | Path) -> StackConfig:
    """Preset by name (configs/<name>.toml) or path → validated `StackConfig`.

    Raises ValueError naming the file and saying how to fix an invalid value or combination,
    and KeyError-derived ValueError for a term name that is not registered.
    """
    path = _resolve(name_or_path)
    with path.open("rb") as f:
        data = tomllib.load(f)
    data.pop("description", None)
    try:
        cfg = build_config(StackConfig, data, "top level")
        LossStack(cfg)  # every term name must resolve in the registry
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"{path}: {err}") from err
    return cfg


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass type inside a hint like `X` or `X | None`, else None."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            if isinstance(arg, type) and dataclasses.is_dataclass(arg):
                return arg
    return None


def build_config(cls: type[T], table: dict[str, Any], where: str) -> T:
    """Build dataclass `cls` from a TOML table, recursing into nested dataclass sections."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(table) - set(names))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in [{where}]; valid: {names}")
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        sub = _dataclass_in(hints[key])
        if sub is not None and isinstance(value, dict):
            kwargs[key] = build_config(
                sub, value, key if where == "top level" else f"{where}.{key}"
            )
        else:
            kwargs[key] = tuple(value) if isinstance(value, list) else value
    return cls(**kwargs)
