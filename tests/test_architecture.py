"""The dependency rule of docs/design.md: evaluator ← policy ← app (evaluator never imports policy
or app; policy never imports app), checked on every module's import statements."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"evaluator": {"policy", "app"}, "policy": {"app"}}


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependency_rule(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no modules found in {package}/"
    offenders = {
        str(f.relative_to(ROOT)): sorted(_imported_packages(f) & FORBIDDEN[package]) for f in files
    }
    assert {f: bad for f, bad in offenders.items() if bad} == {}


def test_the_checker_sees_imports(tmp_path: Path) -> None:
    probe = tmp_path / "m.py"
    probe.write_text("import app.settings\nfrom policy.losses import x\nfrom . import y\n")
    assert _imported_packages(probe) == {"app", "policy"}
