"""One --policy everywhere: every command that takes a policy takes the same option (a version
hash or prefix, `warmstart`, a folder, or nothing for the default), resolved by one function."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import typer

from app.cli import app
from app.cli.common import PolicyOpt

ROOT = Path(__file__).resolve().parents[2]


def _commands(cmd: Any, path: str = "casi") -> dict[str, Any]:
    """Every command under ``cmd`` by its full name (typer's own click: duck-typed)."""
    out = {path: cmd}
    for name, sub in (getattr(cmd, "commands", None) or {}).items():
        out.update(_commands(sub, f"{path} {name}"))
    return out


def test_every_policy_option_is_the_shared_one() -> None:
    shared = PolicyOpt.__metadata__[0].help  # type: ignore[attr-defined]
    commands = _commands(typer.main.get_command(app))
    with_policy = {
        path: p
        for path, cmd in commands.items()
        for p in cmd.params
        if getattr(p, "param_type_name", "") == "option" and "--policy" in p.opts
    }
    assert {"casi train", "casi eval", "casi rewrite", "casi step", "casi policy warmstart",
            "casi audit run"} <= set(with_policy)  # fmt: skip
    # a protocol's cells train from the start the protocol pins: no --policy to override it
    assert "casi experiment credit" not in with_policy
    for path, option in with_policy.items():
        assert option.help == shared, f"{path} --policy is not the shared option"


def test_policies_are_loaded_through_the_one_resolver() -> None:
    """No CLI module loads a policy by folder only (policy.model.load_policy): every --policy
    goes through app.training.policy_loader (versions, prefixes, warmstart, folders)."""
    for path in sorted((ROOT / "app" / "cli").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module == "policy.model"
            for alias in node.names
        }
        assert "load_policy" not in names, f"{path.name} loads a policy by folder only"
