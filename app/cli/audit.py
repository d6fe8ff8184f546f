"""``casi audit run|list|show``: does the training evaluator agree with replay, size by size?

``casi audit run --evaluator surrogate|cosine`` samples rollouts from a policy on a split (or
reads the actions of a stored run with ``--from-run``), scores the same coalition lists with
both evaluators in one credit call, and writes ``var/audits/audit-<id>.{json,html}`` plus a
database row (the service: :mod:`app.services.audit`). ``list`` and ``show`` read the rows.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from app.cli.common import MaxDocsOpt, MaxNewTokensOpt, PolicyOpt, fail, open_database
from app.db.connect import connect
from app.errors import JobConflict
from app.limits import MAX_RECORD_ID
from app.progress import console, index_progress, progress_bar
from app.reports import credit_differences as text
from app.runtime import build_retrieval, build_scorer, build_scorers
from app.services import audit as service
from app.services import credit_report
from app.settings import Settings, get_settings
from app.training.policy_loader import LoadedPolicy, load_policy_ref
from app.training.splits import check_split, qrels_split
from evaluator.corpus import DatasetError
from evaluator.limits import MAX_PLAYERS
from policy.constrain import DEFAULT_LINE_CAP

audit_app = typer.Typer(
    help="Evaluator-agreement audits (training evaluator vs replay).", no_args_is_help=True
)


def _policy_loader(settings: Settings, factory: Any) -> Callable[[str | None], LoadedPolicy]:
    """Load a policy reference (version, folder or the default) on the configured device."""
    device = settings.resolved_device()
    return lambda ref: load_policy_ref(ref, settings.var_dir, factory, device=device)


def _f(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def print_report(report: dict, audit_id: int | None = None) -> None:  # type: ignore[type-arg]
    """The size table, φ agreement, cheap credit and the verdict, as rich tables."""
    train, ref = report["train_evaluator"]["name"], report["reference_evaluator"]["name"]
    table = Table(
        title=f"audit {audit_id or ''}: {train} vs {ref} — marginal sign agreement by size"
    )
    for col in (
        "size k",
        "pairs",
        "agree",
        "CI",
        "decisive",
        "ties both",
        "train only",
        "ref only",
        "",
    ):
        table.add_column(col, justify="right")
    for r in report["sizes"]:
        ok = "–" if not r["has_pairs"] else ("[green]passes[/]" if r["passed"] else "[red]fails[/]")
        table.add_row(
            str(r["k"]), str(r["n_pairs"]), _f(r["agree"]), f"[{_f(r['ci_low'])}, {_f(r['ci_high'])}]",
            _f(r["decisive_agree"]), _f(r["ties_both"]), _f(r["ties_train_only"]),
            _f(r["ties_reference_only"]), ok,
        )  # fmt: skip
    console.print(table)
    phi = report["phi"]
    sign, tau, top = phi["sign_agree"], phi["kendall_tau"], phi["top_agree"]
    console.print(
        f"φ sign agreement {_f(sign['estimate'])} [{_f(sign['ci_low'])}, {_f(sign['ci_high'])}]; "
        f"mean Kendall τ_b {_f(tau['estimate'])} (of {tau['n']:.0f} rollouts); "
        f"top action {_f(top['estimate'])} (of {top['n']:.0f})"
    )
    cheap = Table(title=f"cheap credit vs Shapley ({ref}): share of rollouts ranked differently")
    for col in ("m", "rollouts", "singleton", "pairs reversed", "leave-one-out", "pairs reversed"):
        cheap.add_column(col, justify="right")
    for r in report["cheap_credit"]["reference"]:
        cheap.add_row(
            str(r["m"]), str(r["n_rollouts"]), f"{r['singleton_rank_differs']:.3f}",
            f"{r['singleton_discordant_pairs']:.3f}", f"{r['leave_one_out_rank_differs']:.3f}",
            f"{r['leave_one_out_discordant_pairs']:.3f}",
        )  # fmt: skip
    console.print(cheap)
    colour = {"agrees": "green", "partial": "yellow", "disagrees": "red"}[report["verdict"]]
    console.print(
        f"[bold {colour}]verdict: {report['verdict']}[/] — {report['summary']}", soft_wrap=True
    )


def _with_progress(run_it, queries: int | None, samples: int):  # type: ignore[no-untyped-def]
    """Run with a progress bar over sampled queries (a spinner when nothing is sampled)."""
    if queries is None:
        with console.status("crediting the stored actions with every evaluator"):
            return run_it(None)
    with progress_bar(f"sampling {queries}×{samples} rollouts", queries) as advance:
        done = [0]

        def progress(n: int, total: int) -> None:
            advance(n - done[0])
            done[0] = n

        return run_it(progress)


@audit_app.command("run")
def run(
    evaluator: Annotated[list[str], typer.Option("--evaluator", help="Training evaluator: surrogate | cosine (repeat to audit several on the same rollouts).")],
    reference: Annotated[str, typer.Option("--reference", help="Reference evaluator.")] = "replay",
    policy: PolicyOpt = None,
    split: Annotated[str, typer.Option("--split", help="train | val | dev (where shipped) | test")] = "test",
    queries: Annotated[int, typer.Option("--queries", min=1, help="Queries (N).")] = 100,
    samples: Annotated[int, typer.Option("--samples", min=1, help="Samples per query (G).")] = 4,
    n_actions: Annotated[int, typer.Option("--n-actions", min=1, max=MAX_PLAYERS, help="Rewrites per generation (m).")] = 4,
    from_run: Annotated[int | None, typer.Option("--from-run", min=1, max=MAX_RECORD_ID, help="Audit a stored run's credit records (no sampling).")] = None,
    from_rollouts: Annotated[Path | None, typer.Option("--from-rollouts", help="Re-audit the rollouts an earlier audit saved (audit-<id>-rollouts.json).")] = None,
    max_docs: MaxDocsOpt = None,
    batch_queries: Annotated[int, typer.Option("--batch-queries", min=1, help="Queries per sampling call.")] = 8,
    format: Annotated[str, typer.Option("--format", help="constrained (exactly m lines) | free.")] = "constrained",
    line_cap: Annotated[int, typer.Option("--line-cap", min=2, help="Content tokens per rewrite line.")] = DEFAULT_LINE_CAP,
    prompt: Annotated[str, typer.Option("--prompt", help="Prompt style of the sampled policy: oneshot | short | feedback (what a warm start was taught; feedback: the game's context).")] = "oneshot",
    max_new_tokens: MaxNewTokensOpt = None,
    temperature: Annotated[float, typer.Option(min=0.05)] = 0.7,
    precision: Annotated[str, typer.Option(help="Sampler precision: float32 | bfloat16 | int8_weight")] = "float32",
    tol: Annotated[float, typer.Option(min=0.0, help="|Δ| ≤ tol is a tie (both evaluators).")] = 1e-3,
    threshold: Annotated[float, typer.Option(min=0.01, max=1.0, help="A size passes at ≥ this agreement.")] = 0.8,
    n_boot: Annotated[
        int, typer.Option("--n-boot", min=10, max=20000, help="Bootstrap resamples (10..20000, as the API).")
    ] = 1000,
    anchor: Annotated[bool, typer.Option("--anchor/--no-anchor", help="The query as an anchor player.")] = True,
    seed: int = 0,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Folder of the JSON + HTML (default var/audits).")] = None,
    into: Annotated[int | None, typer.Option("--into", min=1, max=MAX_RECORD_ID, hidden=True, help="Fill the queued row ID (API jobs).")] = None,
) -> None:  # fmt: skip
    """Audit a training evaluator against replay on fresh rollouts (or a stored run)."""
    settings = get_settings()
    try:
        request = service.AuditRequest(
            evaluators=tuple(evaluator), reference=reference, policy=policy, split=split, queries=queries,
            samples=samples, n_actions=n_actions, from_run=from_run, seed=seed,
            from_rollouts=str(from_rollouts) if from_rollouts else None, temperature=temperature,
            max_new_tokens=max_new_tokens, precision=precision, batch_queries=batch_queries,
            format=format, line_cap=line_cap, prompt=prompt,
            anchor_query=anchor, tol=tol, threshold=threshold, n_boot=n_boot,
        )  # fmt: skip
        if from_run is None and from_rollouts is None:
            check_split(split, settings.dataset)
        factory = open_database(settings)
        with console.status("loading data, index and Redis"):
            r = build_retrieval(settings, max_docs=max_docs, progress_factory=index_progress)
        scorers = build_scorers(settings, r, [*evaluator, reference])
        run_it = lambda progress: service.run_audit(  # noqa: E731
            request, retrieval=r, scorers=scorers, factory=factory,
            out_dir=out_dir or settings.var_dir / "audits", list_k=settings.list_k,
            load_policy=_policy_loader(settings, factory), progress=progress, audit_id=into,
        )  # fmt: skip
        sampling = from_run is None and from_rollouts is None
        outcomes = _with_progress(run_it, queries if sampling else None, samples)
    except (DatasetError, ValueError, FileNotFoundError, LookupError, JobConflict) as exc:
        if into is not None:  # refused (no-op) once the row ended: e.g. the audit was cancelled
            service.set_status(connect(settings).factory, into, "failed", error=str(exc))
        fail(str(exc))
        return
    for outcome in outcomes:
        print_report(outcome.report, outcome.id)
        console.print(
            f"report: {outcome.html_path} (JSON {outcome.json_path}); audit id {outcome.id}"
        )


def _environment(text: str) -> tuple[str, str]:
    retriever, sep, merge = text.partition(":")
    if not sep:
        raise ValueError(f"--env takes RETRIEVER:MERGE (e.g. bm25:rrf), got {text!r}")
    return retriever.strip(), merge.strip()


@audit_app.command("credits")
def credits(
    n_actions: Annotated[list[int] | None, typer.Option("--n-actions", min=1, max=MAX_PLAYERS, help="m values (space-separate: --n-actions 4 8); default 4 8.")] = None,
    more_m: Annotated[list[int] | None, typer.Argument(help="More m values after --n-actions.", show_default=False)] = None,
    env: Annotated[list[str] | None, typer.Option("--env", help="RETRIEVER:MERGE (repeat); default dense:max dense:rrf bm25:rrf bm25:max; MERGE pool = the pooled game (graded recall of the union).")] = None,
    anchor: Annotated[str, typer.Option("--anchor", help="on | off | both.")] = "both",
    rrf_k: Annotated[float, typer.Option("--rrf-k", min=0.0, help="rrf constant k.")] = 60.0,
    from_rollouts: Annotated[Path | None, typer.Option("--from-rollouts", help="Stored rollouts (audit-<id>-rollouts.json, e.g. docs/audits/scifact-test-rollouts.json: the untrained SmolLM2, free format): their m and policy, no sampling; not with --policy.")] = None,
    policy: PolicyOpt = None,
    split: Annotated[str, typer.Option("--split", help="train | val | dev (where shipped) | test")] = "test",
    queries: Annotated[int, typer.Option("--queries", min=1, help="Queries (N).")] = 100,
    samples: Annotated[int, typer.Option("--samples", min=1, help="Samples per query (G).")] = 4,
    max_docs: MaxDocsOpt = None,
    batch_queries: Annotated[int, typer.Option("--batch-queries", min=1)] = 8,
    format: Annotated[str, typer.Option("--format", help="constrained (exactly m lines) | free.")] = "constrained",
    line_cap: Annotated[int, typer.Option("--line-cap", min=2, help="Content tokens per rewrite line.")] = DEFAULT_LINE_CAP,
    temperature: Annotated[float, typer.Option(min=0.05)] = 0.7,
    precision: Annotated[str, typer.Option(help="Sampler precision: float32 | bfloat16 | int8_weight")] = "float32",
    prompt: Annotated[str, typer.Option("--prompt", help="Prompt style of the sampled policy: oneshot | short | feedback (what a warm start was taught; feedback: the game's context).")] = "oneshot",
    seed: int = 0,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Folder of the Markdown + JSON (default var/audits).")] = None,
    name: Annotated[str, typer.Option("--name", help="File name stem.")] = "credit-differences",
) -> None:  # fmt: skip
    """Where do the credits differ? Singleton / leave-one-out vs Shapley on real rollouts, per
    retrieval environment (dense|bm25 × max|rrf), m and anchor on/off; a table, Markdown, JSON.
    Prints which policy sampled the rollouts (version, format, format_ok) above the table."""
    settings = get_settings()
    anchors = {"on": (True,), "off": (False,), "both": (True, False)}
    try:
        if anchor not in anchors:
            raise ValueError(f"--anchor takes on | off | both, got {anchor!r}")
        ms = tuple(list(n_actions or []) + list(more_m or [])) or (4, 8)
        request = credit_report.CreditReportRequest(
            n_actions=ms, anchors=anchors[anchor], rrf_k=rrf_k,
            environments=tuple(_environment(e) for e in env) if env else credit_report.ENVIRONMENTS,
            from_rollouts=str(from_rollouts) if from_rollouts else None, policy=policy, split=split,
            queries=queries, samples=samples, seed=seed, temperature=temperature, format=format,
            line_cap=line_cap, precision=precision, batch_queries=batch_queries, prompt=prompt,
        )  # fmt: skip
        factory = open_database(settings)
        retrievals = {}
        for retriever in request.retrievers:
            with console.status(f"loading data, the {retriever} index and Redis"):
                retrievals[retriever] = build_retrieval(
                    settings,
                    max_docs=max_docs,
                    progress_factory=index_progress,
                    retriever=retriever,
                )
        first = retrievals[request.retrievers[0]]
        scorer = {  # the list game's nDCG@K, the pooled game's graded recall (bm25:pool)
            game: build_scorer(
                "replay", settings.model_copy(update={"game": game}), first,
                split=qrels_split(split, first.dataset),
            )
            for game in ("list", "pool")
        }  # fmt: skip

        def run_it(progress: Callable[[int, int], None] | None) -> dict[str, Any]:
            return credit_report.credit_report(
                request, retrievals, scorer, settings.list_k, progress=progress,
                load_policy=_policy_loader(settings, factory),
            )  # fmt: skip

        if from_rollouts is not None:
            with console.status("crediting the stored rollouts in every environment"):
                report = run_it(None)
        else:
            report = _with_progress(run_it, queries * len(ms), samples)
        md, js = text.write_report(report, out_dir or settings.var_dir / "audits", name)
    except (DatasetError, ValueError, FileNotFoundError, LookupError) as exc:
        fail(str(exc))
        return
    for line in text.rollout_sources(report):
        console.print(f"rollouts {line}", soft_wrap=True)
    table = Table(title="where do the credits differ? (cheap credit vs Shapley, per game)")
    for col in text.COLUMNS:
        table.add_column(col, justify="left" if col in ("retriever", "merge") else "right")
    for cells in text.table_rows(report):
        table.add_row(*cells)
    console.print(table)
    if report["skipped_m"]:
        console.print(f"not measured: m = {report['skipped_m']} (the stored rollouts fix m)")
    console.print(f"report: {md} (JSON {js}); {report['elapsed_s']}s")


@audit_app.command("list")
def list_cmd(
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 20,
) -> None:
    """Stored audits, newest first."""
    settings = get_settings()
    table = Table(title="audits")
    for col in (
        "id",
        "created",
        "training",
        "reference",
        "rollouts",
        "verdict",
        "credit",
        "agreement by size",
        "report",
    ):
        table.add_column(col)
    for a in service.list_audits(open_database(settings, device=False), limit=limit):
        sizes = " ".join("–" if x is None else f"{x:.2f}" for x in a["agreement_by_size"])
        table.add_row(
            str(a["id"]), (a["created_at"] or "")[:19], a["train_evaluator"], a["reference_evaluator"],
            str(a["n_rollouts"]), a["verdict"], a["recommended_credit"] or "", sizes, a["html_path"] or "",
        )  # fmt: skip
    console.print(table)


@audit_app.command("show")
def show(
    audit_id: Annotated[
        int, typer.Argument(min=1, max=MAX_RECORD_ID, help="Audit id (see `casi audit list`).")
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print the report JSON.")] = False,
) -> None:
    """One stored audit: the tables and the verdict (or its JSON)."""
    found = service.get_audit(open_database(get_settings(), device=False), audit_id)
    if found is None:
        fail(f"no audit {audit_id}; see `casi audit list`")
        return
    if as_json:
        typer.echo(json.dumps(found["report"], indent=1, sort_keys=True))
    elif found["status"] != "finished":
        console.print(f"audit {audit_id} is {found['status']}: {found['report'].get('error', '')}")
    else:
        print_report(found["report"], audit_id)
        console.print(f"report: {found['html_path']}")
