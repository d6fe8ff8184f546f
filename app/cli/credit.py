"""``casi credit``: the credit path on one real query, printed as readable tables."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from app.cli.common import fail
from app.errors import InputError
from app.limits import check_actions, check_id, check_text
from app.progress import console, index_progress
from app.runtime import build_retrieval, build_scorer
from app.settings import get_settings
from evaluator.corpus import DatasetError
from evaluator.credit import CreditResult, RolloutActions, compute_credits
from evaluator.scorers import registered_scorers


def _members(mask: int, m: int) -> str:
    return "{" + ",".join(str(j + 1) for j in range(m) if mask >> j & 1) + "}" if mask else "∅"


def print_credit(res: CreditResult, i: int, dataset, show_values: bool = True) -> None:  # type: ignore[no-untyped-def]
    rec = res.record(i)
    m = len(rec["actions"])
    relevant = set(dataset.qrels_rows("train").get(rec["query_id"], {})) | set(
        dataset.qrels_rows("test").get(rec["query_id"], {}) if "test" in dataset.qrels else {}
    )
    table = Table(title=f"credit — query {rec['query_id']}: {rec['query_text'][:70]}")
    for col in ("#", "action", "hits", "φ (Shapley)", "singleton", "leave-one-out", "broadcast"):
        table.add_column(col, justify="left" if col in ("action", "hits") else "right")
    for j in range(m):
        rows = rec["action_rows"][j]
        hits = "".join("●" if r in relevant else ("·" if r >= 0 else " ") for r in rows)
        b = rec["baselines"]
        table.add_row(
            str(j + 1),
            rec["actions"][j][:60] or "(empty)",
            hits,
            f"{rec['credits'][j]:+.4f}",
            f"{b['singleton'][j]:+.4f}",
            f"{b['leave_one_out'][j]:+.4f}",
            f"{b['broadcast'][j]:+.4f}",
        )
    console.print(table)
    if show_values:
        vt = Table(title="value table v(S)")
        vt.add_column("S")
        vt.add_column("|S|", justify="right")
        vt.add_column("v(S)", justify="right")
        for mask, v in enumerate(rec["value_table"]):
            vt.add_row(_members(mask, m), str(bin(mask).count("1")), f"{v:.4f}")
        console.print(vt)
    console.print(
        f"v(N) = {rec['value_full']:.4f}   Σφ − (v(N) − v(∅)) = {rec['efficiency_residual']:.2e}   "
        f"evaluator {rec['evaluator_name']}@{rec['evaluator_version']}   index {rec['index_version']}"
    )


def refuse_blank(actions: list[str], option: str = "--rewrites") -> None:
    """A rewrite with no text (empty, or only spaces) typed on the command line is a mistake,
    not an action to credit: it retrieves nothing and would be credited 0 as a null player.
    Refused at the edge, naming which one."""
    blank = [j + 1 for j, a in enumerate(actions) if not a.strip()]
    if blank:
        which = ", ".join(map(str, blank))
        raise InputError(
            f"rewrite{'s' if len(blank) > 1 else ''} {which} of {len(actions)} "
            f"{'are' if len(blank) > 1 else 'is'} blank",
            option,
            "give each rewrite some text, or leave the blank one out",
        )


def credit(
    query: Annotated[
        str | None, typer.Option("--query", help="Query text (a SciFact claim).")
    ] = None,
    query_id: Annotated[
        str | None, typer.Option("--query-id", help="Or a SciFact query id.")
    ] = None,
    rewrites: Annotated[
        list[str] | None, typer.Option("--rewrites", help="The actions (repeat or space-separate).")
    ] = None,
    evaluator: Annotated[
        str, typer.Option("--evaluator", help="replay | surrogate | cosine")
    ] = "replay",
    extra: Annotated[
        list[str] | None, typer.Argument(help="More rewrites after --rewrites", show_default=False)
    ] = None,
    max_docs: Annotated[int | None, typer.Option("--max-docs", min=1)] = None,
) -> None:
    """Credit each rewrite of one query: value table, Shapley φ, baselines, efficiency residual."""
    settings = get_settings()
    # input limits at the edge, before the index and models load
    actions = check_actions(list(rewrites or []) + list(extra or []))
    refuse_blank(actions)
    if query is None and query_id is None:
        fail("give --query TEXT or --query-id ID")
    query = None if query is None else check_text(query, "--query")
    query_id = None if query_id is None else check_id(query_id, "--query-id")
    if evaluator not in registered_scorers():
        fail(f"unknown --evaluator {evaluator!r} — use one of: {', '.join(registered_scorers())}")
    try:
        r = build_retrieval(settings, max_docs=max_docs, progress_factory=index_progress)
        ds = r.dataset
        if query_id is None:
            if query is None:
                fail("give --query TEXT or --query-id ID")
                return
            query_id = next((q for q, t in ds.queries.items() if t.strip() == query.strip()), None)
            if query_id is None and evaluator == "replay":
                fail(
                    "the replay evaluator needs a judged SciFact query: pass its exact text or --query-id"
                )
        elif query_id not in ds.queries:
            fail(f"unknown query id {query_id!r}")
        elif query is not None and query.strip() != ds.queries[query_id].strip():
            fail(f"--query and --query-id {query_id!r} name different queries — give one of them")
        text = ds.queries.get(query_id or "", query or "")
        scorer = build_scorer(evaluator, settings, r)
        res = compute_credits(
            [RolloutActions(query_id or "adhoc", text, actions)],
            r.executor,
            scorer,
            settings.list_k,
        )
    except (DatasetError, ValueError, FileNotFoundError) as exc:
        fail(str(exc))
        return
    print_credit(res, 0, ds)
    st = res.cache
    console.print(f"cache: {st['status']}, {st['hits']} hits / {st['misses']} misses this call")
