"""The dependency rules of docs/design.md, checked on every module's import statements:

1. evaluator ← policy ← app ← casi_integrations (evaluator never imports policy or app; policy
   never imports app; none of the three imports the TRL / verl adapters, trl or verl);
2. no import cycle among the project's modules (evaluator/, policy/, app/), counting imports at
   module level and inside functions;
3. inside app/, no upward arrow: each module belongs to one layer of :data:`LAYERS` and imports
   only from its own layer or the ones below it; inside app/experiments/, each module is a layer
   of its own (:data:`EXPERIMENT_MODULES`).

The module graph (:func:`import_graph`) is built with ``ast`` from every statement, wherever it
stands. ``import a.b`` is an edge to ``a.b``; ``from a import b`` is an edge to the submodule
``a.b`` when there is one, else to ``a`` (a package's ``__init__``, whose own imports then count
only for what it really imports); relative imports are resolved against the importing module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ADAPTED = {"casi_integrations", "trl", "verl"}
"""The adapters (casi_integrations, above app) and the trainers they adapt: CASI's core never
imports them (docs/design.md §2)."""
FORBIDDEN = {
    "evaluator": {"policy", "app"} | ADAPTED,
    "policy": {"app"} | ADAPTED,
    "app": ADAPTED,
}
PACKAGES = ("evaluator", "policy", "app", "casi_integrations")

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # what everything else stands on: settings, errors (CLI boundary + domain errors), input
    # limits, console progress, request/response models, the database (models, sessions, the
    # one builder from settings, the stored credit record)
    (
        "base",
        (
            "app.settings",
            "app.errors",
            "app.limits",
            "app.progress",
            "app.schemas",
            "app.schemas_ops",
            "app.db",
        ),
    ),
    # built from settings once (retrieval stack, scorers, preflight) / plain data → JSON, HTML, PNG
    ("components", ("app.runtime", "app.reports")),
    # training orchestration: a run, its step, held-out evaluation, warm starts, policy loading
    ("training", ("app.training",)),
    # what runs many trainings or runs beside the API, on top of training: the pre-registered
    # experiment and its cells; the background workers (batcher, job processes, the audit's
    # request and row) — peers that import neither each other's modules nor anything above
    ("experiments and workers", ("app.experiments", "app.workers")),
    # one request each, owning its transaction (the audit, credits, policies, ...)
    ("services", ("app.services",)),
    # the ways in: the REST API (and its request-scoped state), the dashboard, the CLI
    ("surfaces", ("app.api", "app.ui", "app.cli")),
    # the composition root of the API process: nothing below imports it
    ("composition root", ("app.main", "app.lifespan")),
)
UNLAYERED = {"app"}  # the package itself (an empty __init__)
EXPERIMENT_MODULES = (
    "result_file", "protocol_keys", "protocol", "start", "results_folder", "cell", "render",
    "aggregate", "schedule",
)  # fmt: skip
"""app/experiments/, bottom up: a cell's path reads CLI → schedule → cell → app.training, and
no module imports one above it (one layer each, checked as :data:`LAYERS` are)."""
KNOWN_CYCLES: list[list[str]] = []
"""Cycles tolerated while they are being broken: none (the last, policy.model ↔ policy.params,
went when params stopped hashing the merged copy itself)."""


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


# --- the module graph ------------------------------------------------------------------------


def project_modules(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Dotted name → file of every module under ``packages`` (a package is its ``__init__``)."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _known(name: str, modules: Mapping[str, Path]) -> str | None:
    """``name`` or its longest prefix that is a project module (None: not ours)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """Dotted names one import statement of ``module`` may load (before matching the modules)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: from the module's package, one level up per extra dot
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(
            package[: len(package) - (node.level - 1)] + ([node.module] if node.module else [])
        )
    else:
        base = node.module or ""
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def import_graph(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    """Module → the project modules it imports, anywhere in the file (module level, functions,
    ``if TYPE_CHECKING:``)."""
    modules = project_modules(root, packages)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            targets = _targets(node, name, is_package)
            if isinstance(node, ast.ImportFrom):  # `from a import b`: the submodule a.b, else a
                subs = [t for t in targets[:-1] if t in modules]
                found = set(subs) if len(subs) == len(targets) - 1 else set(subs) | {targets[-1]}
            else:
                found = set(targets)
            graph[name] |= {k for t in found if (k := _known(t, modules)) is not None}
    return graph


def import_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module, or a module importing
    itself (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def layer_of(module: str, layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS) -> int | None:
    """The position of ``module``'s layer (its longest matching prefix), None when unplaced."""
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for rank, (_, prefixes) in enumerate(layers):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[0]):
                best = (len(p), rank)
    return None if best is None else best[1]


def upward_arrows(
    graph: Mapping[str, set[str]],
    layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS,
    package: str = "app",
) -> list[str]:
    """``importer → imported`` for every import of ``package`` from a higher layer."""
    found = []
    for importer, imported in sorted(graph.items()):
        low = layer_of(importer, layers)
        for target in sorted(imported):
            high = layer_of(target, layers)
            if low is not None and high is not None and high > low:
                found.append(f"{importer} ({layers[low][0]}) → {target} ({layers[high][0]})")
    return found


def test_no_import_cycles() -> None:
    graph = import_graph(ROOT)
    assert len(graph) > 100 and "app.cli.train" in graph["app.cli"]
    assert [c for c in import_cycles(graph) if c not in KNOWN_CYCLES] == []
    assert all(m.startswith("policy.") for c in KNOWN_CYCLES for m in c)


def test_every_app_module_has_a_layer() -> None:
    unplaced = [m for m in project_modules(ROOT, ["app"]) if layer_of(m) is None]
    assert sorted(set(unplaced) - UNLAYERED) == []
    assert ast.parse((ROOT / "app" / "__init__.py").read_text()).body == []


def test_no_upward_arrow_inside_app() -> None:
    assert upward_arrows(import_graph(ROOT)) == []


def test_inside_experiments_every_import_points_down() -> None:
    layers = tuple((m, (f"app.experiments.{m}",)) for m in EXPERIMENT_MODULES)
    modules = project_modules(ROOT, ["app"])
    placed = {m for m in modules if m.startswith("app.experiments.")}
    assert placed == {f"app.experiments.{m}" for m in EXPERIMENT_MODULES}
    assert upward_arrows(import_graph(ROOT), layers) == []


def test_the_layers_catch_the_upward_imports_that_were_removed() -> None:
    """Issue 52: training and the workers imported the audit and policy services (one layer,
    "domain", held all three, so the test let it pass). With training below the workers and
    both below the services, each such import is an upward arrow."""
    graph = {
        "app.training.credit_report": {"app.services.audit"},
        "app.workers.audit_jobs": {"app.services.audit", "app.workers.audit_records"},
        "app.workers.jobs": {"app.services.policies", "app.training.policy_loader"},
        "app.training.train": {"app.experiments.cell"},
        "app.experiments.cell": {"app.training.train"},
        "app.services.audit": {"app.workers.audit_records", "app.training.splits"},
    }
    assert upward_arrows(graph) == [
        "app.training.credit_report (training) → app.services.audit (services)",
        "app.training.train (training) → app.experiments.cell (experiments and workers)",
        "app.workers.audit_jobs (experiments and workers) → app.services.audit (services)",
        "app.workers.jobs (experiments and workers) → app.services.policies (services)",
    ]


def test_the_composition_root_is_imported_by_nothing_else() -> None:
    graph = import_graph(ROOT)
    root = {"app.main", "app.lifespan"}
    assert {m for m, imported in graph.items() if imported & root} <= root


def test_the_checker_catches_a_cycle_and_an_upward_arrow(tmp_path: Path) -> None:
    files = {
        "app/__init__.py": "",
        "app/settings.py": "def late():\n    from app.cli import main\n",  # base → surface
        "app/cli/__init__.py": "from . import train\n\ndef main():\n    pass\n",
        "app/cli/train.py": "from app.cli.report import write\n",
        "app/cli/report.py": "import app.settings\n\n\ndef write():\n    from .train import x\n",
        "app/cli/common.py": "import app.cli.report\nfrom app.settings import late\n",
        "app/db/__init__.py": "from app.db.models import Base\n",
        "app/db/models.py": "Base = object\n",
        "app/db/repositories.py": "from app.db import Base\n",  # via the package: no cycle
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ["app"])
    assert graph["app.cli"] == {"app.cli.train"}  # `from . import train`: the submodule
    assert graph["app.cli.common"] == {"app.cli.report", "app.settings"}
    assert graph["app.db.repositories"] == {"app.db"}
    assert import_cycles(graph) == [["app.cli", "app.cli.report", "app.cli.train", "app.settings"]]
    layers = (("base", ("app.settings", "app.db")), ("surfaces", ("app.cli",)))
    assert upward_arrows(graph, layers) == ["app.settings (base) → app.cli (surfaces)"]
    assert import_cycles({"a": {"a"}, "b": set()}) == [["a"]]
