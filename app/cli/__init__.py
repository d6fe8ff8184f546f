"""The ``casi`` command line (typer + rich): one module per command group, each a thin
composition root that builds components from settings and calls one service.

| module | commands |
| --- | --- |
| `index` | `casi index build`, `casi index eval` |
| `db` | `casi db upgrade` |
| `credit` | `casi credit` |
| `evaluator` | `casi evaluator fit` |
| `policy` | `casi rewrite`, `casi policy warmstart`, `casi policy merge` |
| `step` | `casi step` (one step, a debug command) |
| `serve` | `casi serve` (the REST API) |
| `keys` | `casi keys create`, `casi keys list`, `casi keys revoke` |
| `audit` | `casi audit run`, `casi audit credits`, `casi audit list`, `casi audit show ID` |
| `train` | `casi train`, `casi eval` (+ `train_display`: the live display) |
| `report` | `casi report run RUN`, `casi report runs`, `casi report policies` |
| `experiment` | `casi experiment credit --protocol`, `casi experiment status`, `casi experiment aggregate` (the pre-registered credit experiment, `app.experiments`) |
| `estimate` | `casi estimate` (a job's expected duration on this machine, from a probe) |

`common.fail` is the one expected-failure exit; `common` also holds what several commands build
(the database, precisions, the held-out table). Run as `casi ...` or `python -m app.cli ...`
(what `torchrun` needs).
"""

from __future__ import annotations

import typer

from app.cli.audit import audit_app
from app.cli.common import fail, run_cli
from app.cli.credit import credit
from app.cli.db import db_app
from app.cli.estimate import estimate
from app.cli.evaluator import evaluator_app
from app.cli.experiment import experiment_app
from app.cli.index import index_app
from app.cli.keys import keys_app
from app.cli.policy import policy_app, rewrite
from app.cli.report import report_app
from app.cli.serve import serve
from app.cli.step import step
from app.cli.train import evaluate, train

__all__ = ["app", "fail", "main"]

app = typer.Typer(
    help="CASI: per-action credit assignment for agentic retrieval.", no_args_is_help=True
)
app.add_typer(index_app, name="index")
app.add_typer(audit_app, name="audit")
app.add_typer(db_app, name="db")
app.command("credit")(credit)
app.add_typer(evaluator_app, name="evaluator")
app.command("rewrite")(rewrite)
app.add_typer(policy_app, name="policy")
app.command("step")(step)
app.command("serve")(serve)
app.add_typer(keys_app, name="keys")
app.command("train")(train)
app.command("eval")(evaluate)
app.command("estimate")(estimate)
app.add_typer(report_app, name="report")
app.add_typer(experiment_app, name="experiment")


def main() -> None:
    """``casi``: every command runs inside the one error boundary (``common.run_cli``)."""
    run_cli(app)
