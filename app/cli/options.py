"""CLI options derived from a configuration tree: each setting is declared once, in its dataclass.

``@with_config_options(TrainConfig.options(), ...)`` on a command whose last parameter is
``**given: Any`` adds one typer option per `policy.config_tree.ConfigOption` to the command's
signature: the flag (``--lr``, ``--n-actions``, ``--anchor/--no-anchor``), the type (``X | None``
and tuples become optional / repeatable options), the help (the field's docstring and its
default) — nothing is re-declared here. Typer passes what the user gave in ``given`` (None =
not given), and the command hands that to ``TrainConfig.from_preset``, where the sections'
``__post_init__`` validate it (a bad value is one ``error:`` line, exit 2). A command may set
its own defaults for some options (the credit experiment trains on 8 queries a step) and drop
options it fixes itself (the experiment sets credit and seed per cell).
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, TypeVar

import typer

from app.cli.common import fail
from policy.config_tree import ConfigOption

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

AUTO_PRECISION = {
    "precision": "auto = bfloat16 where the CPU/GPU multiplies it natively, else float32.",
    "train_precision": "auto = bfloat16 autocast where native, else float32.",
}
"""What the CLI adds to two options: it resolves ``auto`` (`common.resolve_precisions`)."""


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return " ".join(str(v) for v in value)
    return "none" if value is None else str(value)


def _typer_type(hint: Any) -> Any:
    """The option's type for typer: ``X | None`` → ``X | None``; tuples → ``list[str]``."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    base = next(a for a in args if a is not type(None))
    if typing.get_origin(base) is tuple:
        return list[typing.get_args(base)[0]] | None  # type: ignore[misc]
    return base | None


def option_parameter(opt: ConfigOption, default: Any = None) -> inspect.Parameter:
    """One keyword parameter of a typer command for ``opt`` (``default`` None = not given)."""
    shown = opt.default if default is None else default
    text = " ".join(
        part for part in (opt.doc, AUTO_PRECISION.get(opt.name, ""), f"(default: {_show(shown)})")
        if part
    )  # fmt: skip
    flag = f"--{opt.flag}"
    base = _typer_type(opt.type)
    decl = f"{flag}/--no-{opt.flag}" if typing.get_args(base)[0] is bool else flag
    info = typer.Option(decl, help=text, show_default=False)
    return inspect.Parameter(
        opt.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[base, info]
    )


def with_config_options(
    options: Iterable[ConfigOption],
    *,
    defaults: Mapping[str, Any] | None = None,
    exclude: Iterable[str] = (),
) -> Callable[[F], F]:
    """Decorator: the command's explicit parameters, then one option per config option (minus
    ``exclude``; ``defaults`` = this command's own defaults). The command ends in ``**given``."""
    defaults, dropped = dict(defaults or {}), set(exclude)
    chosen = [o for o in options if o.name not in dropped]
    unknown = sorted(set(defaults) - {o.name for o in chosen})
    if unknown:
        raise TypeError(f"defaults for options that are not there: {unknown}")

    def wrap(fn: F) -> F:
        sig = inspect.signature(fn, eval_str=True)  # typer reads the resolved annotations
        own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        if len(own) == len(sig.parameters):
            raise TypeError(f"{fn.__name__} must end in **given to receive the config options")
        clash = {p.name for p in own} & {o.name for o in chosen}
        if clash:
            raise TypeError(f"{fn.__name__} declares config options itself: {sorted(clash)}")
        derived = [option_parameter(o, defaults.get(o.name)) for o in chosen]
        fn.__signature__ = sig.replace(parameters=[*own, *derived])  # type: ignore[attr-defined]
        return fn

    return wrap


def given_options(given: Mapping[str, Any]) -> dict[str, Any]:
    """The options the user set (typer passes None for the others); lists become tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in given.items() if v is not None}


def config_or_fail(build: Callable[[], T], command: str) -> T:
    """``build()`` (a config from the user's options); a value its section rejects is one
    ``error:`` line that says where the values are listed (exit 2)."""
    try:
        return build()
    except (ValueError, TypeError) as exc:
        fail(f"{exc} — `casi {command} --help` lists every option with its values and default")


def refuse_idle(idle: list[str], command: str) -> None:
    """Fail (exit 2) when the user gave options the built config never reads (`TrainConfig.
    idle_options`): a setting that is silently ignored reads as one that took effect."""
    if idle:
        fail(f"{'; '.join(idle)} — `casi {command} --help`")
