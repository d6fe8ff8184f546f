"""``casi report run RUN`` (curves + summary), ``casi report runs``, ``casi report policies``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from app.cli.common import fail
from app.progress import console
from app.settings import get_settings

report_app = typer.Typer(help="Reports of training runs and policy versions.", no_args_is_help=True)


@report_app.command("run")
def report_run(
    run_id: Annotated[int, typer.Argument(help="The run id (see `casi report runs`).")],
    out: Annotated[Path | None, typer.Option(help="Folder (default var/reports/run-<id>).")] = None,
) -> None:
    """PNG curves (reward, gain over the query, held-out nDCG, KL, clipped/masked, accept rate)
    and a Markdown summary of one run."""
    from app.cli.train import open_database

    settings = get_settings()
    factory = open_database(settings)
    try:
        png, md = write_report(
            factory, run_id, out or settings.var_dir / "reports" / f"run-{run_id}"
        )
    except LookupError as exc:
        fail(str(exc))
    console.print(f"curves {png}, summary {md}")


def write_report(factory: Any, run_id: int, out: Path) -> tuple[Path, Path]:
    """The run's curves and summary from the database (LookupError for an unknown run)."""
    from app.db import repositories as repo
    from app.db import session_scope
    from app.reports.run import write_run_report

    with session_scope(factory) as session:
        run = repo.get_run(session, run_id)
        if run is None:
            raise LookupError(f"no training run {run_id} (see `casi report runs`)")
        info = {
            "id": run.id,
            "name": run.name,
            "status": run.status,
            "preset": run.preset,
            "config": dict(run.config),
        }
        steps = [
            {"step": s.step, "metrics": dict(s.metrics)}
            for s in repo.step_metrics_for_run(session, run_id)
        ]
        evals = [{"step": e.step, "split": e.split, "n_queries": e.n_queries, "metrics": dict(e.metrics)}
                 for e in repo.evaluations_for_run(session, run_id)]  # fmt: skip
    return write_run_report(info, steps, evals, out)


@report_app.command("runs")
def report_runs(limit: Annotated[int, typer.Option(min=1)] = 20) -> None:
    """The latest training runs."""
    from sqlalchemy import select

    from app.cli.train import open_database
    from app.db import session_scope
    from app.db.models import TrainingRun

    factory = open_database(get_settings())
    table = Table(title="training runs")
    for col in ("id", "name", "preset", "status", "started"):
        table.add_column(col)
    with session_scope(factory) as session:
        for r in session.scalars(select(TrainingRun).order_by(TrainingRun.id.desc()).limit(limit)):
            table.add_row(
                str(r.id), r.name, r.preset, r.status, r.started_at.strftime("%Y-%m-%d %H:%M")
            )
    console.print(table)


@report_app.command("policies")
def report_policies(limit: Annotated[int, typer.Option(min=1)] = 30) -> None:
    """Registered policy versions with their latest held-out numbers."""
    from sqlalchemy import select

    from app.cli.train import open_database
    from app.db import repositories as repo
    from app.db import session_scope
    from app.db.models import PolicyVersion

    factory = open_database(get_settings())
    table = Table(title="policy versions")
    for col in ("version", "kind", "name", "step", "run", "held-out q+r nDCG@10 (gain)"):
        table.add_column(col)
    with session_scope(factory) as session:
        for p in session.scalars(
            select(PolicyVersion).order_by(PolicyVersion.id.desc()).limit(limit)
        ):
            evals = repo.evaluations_for_policy(session, p.id)
            last = evals[-1].metrics if evals else None
            held = (
                f"{last['combined_ndcg@10']:.4f} ({last['gain_ndcg@10']:+.4f}, {evals[-1].split})"
                if last
                else "—"
            )
            table.add_row(p.version, p.kind, p.name, str(p.step), str(p.run_id or "—"), held)
    console.print(table)
