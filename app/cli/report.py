"""``casi report run RUN`` (curves + summary), ``casi report runs``, ``casi report policies``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from app.cli.common import fail, open_database
from app.db import repositories as repo
from app.db import session_scope
from app.limits import MAX_RECORD_ID
from app.progress import console
from app.settings import get_settings
from app.training.evaluate import short_family
from app.training.train import report_run

report_app = typer.Typer(help="Reports of training runs and policy versions.", no_args_is_help=True)


@report_app.command("run")
def report_run_cmd(
    run_id: Annotated[
        int, typer.Argument(min=1, max=MAX_RECORD_ID, help="The run id (see `casi report runs`).")
    ],
    out: Annotated[Path | None, typer.Option(help="Folder (default var/reports/run-<id>).")] = None,
) -> None:
    """PNG curves (reward, gain over the query, held-out nDCG, KL, clipped/masked, accept rate)
    and a Markdown summary of one run."""
    settings = get_settings()
    factory = open_database(settings, device=False)
    try:
        png, md = report_run(factory, run_id, out or settings.var_dir / "reports" / f"run-{run_id}")
    except LookupError as exc:
        fail(str(exc))
    console.print(f"curves {png}, summary {md}")


@report_app.command("runs")
def report_runs(limit: Annotated[int, typer.Option(min=1)] = 20) -> None:
    """The latest training runs."""
    factory = open_database(get_settings(), device=False)
    table = Table(title="training runs")
    for col in ("id", "name", "preset", "status", "started"):
        table.add_column(col)
    with session_scope(factory) as session:
        for r in repo.list_runs(session, limit=limit):
            table.add_row(
                str(r.id), r.name, r.preset, r.status, r.started_at.strftime("%Y-%m-%d %H:%M")
            )
    console.print(table)


@report_app.command("policies")
def report_policies(limit: Annotated[int, typer.Option(min=1)] = 30) -> None:
    """Registered policy versions with their latest held-out numbers."""
    factory = open_database(get_settings(), device=False)
    table = Table(title="policy versions")
    for col in ("version", "kind", "name", "step", "run", "made on",
                "held-out q+r nDCG@10 (gain)"):  # fmt: skip
        table.add_column(col)
    with session_scope(factory) as session:
        for p in repo.list_policy_versions(session, limit=limit):
            evals = repo.evaluations_for_policy(session, p.id)
            last = evals[-1].metrics if evals else None
            held = (
                f"{last['combined_ndcg@10']:.4f} ({last['gain_ndcg@10']:+.4f}, {evals[-1].split})"
                if last
                else "—"
            )
            meta = p.meta or {}
            made_on = short_family(meta["made_on"]) if meta.get("made_on") else "—"
            if "imported_from" in meta:  # `casi policy import`
                made_on = f"{made_on} (imported)"
            table.add_row(
                p.version, p.kind, p.name, str(p.step), str(p.run_id or "—"), made_on, held
            )
    console.print(table)
