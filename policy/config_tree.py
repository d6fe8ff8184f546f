"""A configuration tree's options, read off its dataclasses: one declaration per setting.

A setting is declared once, as a field of a frozen dataclass: its name, type, default, the
docstring under it (an attribute docstring, read here from the class source) and its
validation (the class's ``__post_init__``). :func:`config_options` walks a tree of such
dataclasses and returns one :class:`ConfigOption` per user-settable leaf, with the flat name
that the CLI (``--<name>``), the API's training jobs and ``TrainConfig.from_preset`` use, and
the path to the field inside the tree. The field metadata that steers the walk:

- on a field holding a section (a dataclass): ``{"section": prefix}`` — descend into it; its
  options are named ``<prefix>_<field>`` (prefix ``""``: the field's own name), and
  ``{"options": (names…)}`` limits them to those fields (the rest are set by the code, e.g.
  a sampler's per-draw seed);
- on a leaf: ``{"option": False}`` — not a user option; ``{"option": "name"}`` — a flat name
  of its own; ``{"flag": "anchor"}`` — the CLI flag's name when it differs (booleans become
  ``--flag/--no-flag``).

:func:`build_tree` turns flat options (given ones only; ``None`` = not given) into the nested
keyword arguments of the root's constructor, on top of a base of already built sections.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import textwrap
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ConfigOption:
    """One user-settable leaf of a configuration tree."""

    name: str
    """Flat name (``lr``, ``eval_queries``): keyword of ``from_preset``, ``--lr`` on the CLI."""
    path: tuple[str, ...]
    """Field names from the root to the leaf (``("update", "lr")``)."""
    type: Any
    """The field's type (resolved annotation: ``int``, ``str | None``, ``tuple[str, ...]``)."""
    default: Any
    """The field's default in the dataclass."""
    doc: str
    """The attribute docstring under the field (one paragraph, whitespace folded)."""
    flag: str
    """The CLI flag name without dashes (``n-actions``; booleans get ``--no-<flag>`` too)."""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field: docstring} of a dataclass: the string literal right under each annotated field
    (a subclass inherits its bases' and may redeclare them)."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__[1:]):
        if dataclasses.is_dataclass(base):
            docs.update(field_docs(base))
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return docs
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    for node, after in zip(body.body, body.body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _section_class(hint: Any) -> type | None:
    """The dataclass of a section field (``X`` or ``X | None``), else None."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    classes = [a for a in args if dataclasses.is_dataclass(a) and isinstance(a, type)]
    return classes[0] if len(classes) == 1 else None


_OPTIONS: dict[type, tuple[ConfigOption, ...]] = {}


def config_options(root: type) -> tuple[ConfigOption, ...]:
    """Every user option of the tree under ``root``, in declaration order; flat names unique
    (read once per class)."""
    if root in _OPTIONS:
        return _OPTIONS[root]
    out: list[ConfigOption] = []
    _walk(root, None, (), "", None, out)
    names = [o.name for o in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise TypeError(f"{root.__name__}: option names declared twice: {dup}")
    _OPTIONS[root] = tuple(out)
    return _OPTIONS[root]


def _walk(
    cls: type,
    defaults: Any,
    path: tuple[str, ...],
    prefix: str,
    only: tuple[str, ...] | None,
    out: list[Any],
) -> None:
    """Options of ``cls``'s fields; ``defaults``: the section's default instance (a section's
    factory may set fields differently from its class), None at the root."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        meta = f.metadata
        if "section" in meta:
            sub = _section_class(hints[f.name])
            if sub is None:
                raise TypeError(f"{cls.__name__}.{f.name}: a section must hold one dataclass")
            sub_default = _default(f) if defaults is None else getattr(defaults, f.name)
            _walk(sub, sub_default, (*path, f.name), meta["section"], meta.get("options"), out)
            continue
        option = meta.get("option", True)
        if option is False:
            continue
        name = option if isinstance(option, str) else f"{prefix}_{f.name}" if prefix else f.name
        out.append(
            ConfigOption(
                name=name,
                path=(*path, f.name),
                type=hints[f.name],
                default=_default(f) if defaults is None else getattr(defaults, f.name),
                doc=docs.get(f.name, ""),
                flag=str(meta.get("flag", name)).replace("_", "-"),
            )
        )


def option_table(root: type) -> dict[str, ConfigOption]:
    """{flat name: option} of the tree under ``root``."""
    return {o.name: o for o in config_options(root)}


def build_tree(root: type, flat: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments of ``root(...)``: ``base`` (sections already built, top-level values)
    with the given flat options placed at their paths (``None`` = not given); a top-level field
    that is not a user option (set by code) may be given by its name. An unknown name raises
    ValueError listing the known ones."""
    table = option_table(root)
    top = {f.name for f in dataclasses.fields(root)}  # plain fields set by code (list_k) too
    unknown = sorted(set(flat) - set(table) - top)
    if unknown:
        raise ValueError(f"unknown training option(s) {unknown}; known: {sorted(table)}")
    kwargs = dict(base)
    nested: dict[str, dict[str, Any]] = {}
    for name, value in flat.items():
        if value is None:
            continue
        path = table[name].path if name in table else (name,)
        if len(path) == 1:
            kwargs[path[0]] = value
        else:  # one level of sections (TrainConfig's): collect, then rebuild each section once
            nested.setdefault(path[0], {})[path[1]] = value
    hints = typing.get_type_hints(root)
    fields = {f.name: f for f in dataclasses.fields(root)}
    for section, values in nested.items():
        current = kwargs.get(section)
        if current is None:
            current = _default(fields[section])
        if current is None:  # an optional section that is off: build it from its class
            sub = _section_class(hints[section])
            assert sub is not None
            current = sub()
        kwargs[section] = dataclasses.replace(current, **values)
    return kwargs


def nonfinite_fields(config: Any, prefix: str = "") -> list[tuple[str, float]]:
    """(dotted name, value) of every float field of a config tree (nested dataclasses) that is
    NaN or infinite: no setting of the tree takes one (an infinite lr trains NaN weights)."""
    found = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            found += nonfinite_fields(value, f"{prefix}{f.name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            found.append((prefix + f.name, value))
    return found
