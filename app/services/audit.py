"""The evaluator-agreement audit: the ONE service behind ``casi audit`` and ``/v1/audits``.

Read :func:`run_audit`, top to bottom: rollouts (sampled from a policy on a split, or the
actions stored in a run's credit records) → ONE credit call that scores the same coalition
lists with the training and the reference evaluator (``extra_scorers``) → the pure audit math
(:func:`evaluator.audit.audit`) → the report JSON (validated against its schema) and the
self-contained HTML → one ``audit_reports`` row (the service owns the transaction).

Components arrive built (retrieval, scorers, session factory, a policy loader): the CLI builds
them from settings, the API's job process does the same; nothing heavy is built here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from sqlalchemy.orm import Session, sessionmaker

from app.db import repositories as repo
from app.db import session_scope
from app.errors import JobConflict
from app.reports.audit_html import render_html
from app.reports.audit_json import build_report, validate_report
from app.runtime import Retrieval
from app.training.policy_prompt import read_prompt
from app.training.splits import split_ids
from app.workers.audit_records import PENDING, plain_request

# the audit's request and its stored row (defined one layer down, where the audit job process
# reads them too), offered here as the service's own: `service.AuditRequest`, `service.get_audit`
from app.workers.audit_records import AuditRequest as AuditRequest
from app.workers.audit_records import add_pending as add_pending
from app.workers.audit_records import create_pending as create_pending
from app.workers.audit_records import get_audit as get_audit
from app.workers.audit_records import list_audits as list_audits
from app.workers.audit_records import set_status as set_status
from app.workers.audit_records import summary_row as summary_row
from evaluator.audit import Games, audit
from evaluator.credit import CreditResult, RolloutActions, compute_credits
from evaluator.scorers import SetScorer
from policy.constrain import free_response_cap
from policy.precision import build_sampler_model
from policy.rollout import sample_rollouts
from policy.sampler import SamplerConfig

AUDIT_SIZES: dict[str, tuple[int, int]] = {"quick": (20, 2), "full": (100, 4)}
"""(claims, samples per claim) of an audit of each size. quick, the API's default: 40
rollouts, about 5 minutes on 2 CPU cores; full, `casi audit run`'s default (AuditRequest's):
400 rollouts, about 50 minutes (docs/audits.md)."""
ProgressFn = Callable[[int, int], None]  # (done, total) queries sampled


@dataclass
class Rollouts:
    """The actions to audit and where they came from."""

    actions: list[RolloutActions]
    n_players: int
    anchor_query: bool
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class AuditOutcome:
    id: int
    report: dict[str, Any]
    json_path: Path
    html_path: Path


def sampled_rollouts(
    request: AuditRequest, retrieval: Retrieval, load_policy: Callable[[str | None], Any],
    progress: ProgressFn | None = None,
) -> Rollouts:  # fmt: skip
    """G samples × m rewrites for the first N judged queries of the split, batched."""
    ids = split_ids(retrieval.dataset, request.split)[: request.queries]
    if len(ids) < request.queries:
        raise ValueError(
            f"split {request.split!r} has {len(ids)} judged queries; asked for {request.queries}"
        )
    policy = load_policy(request.policy)
    # the feedback prompt's size: as the policy was trained (its folder's record)
    words = read_prompt(getattr(policy, "path", None)).feedback_words
    sampler = build_sampler_model(policy.model, request.precision, copy_weights=False)
    out: list[Any] = []
    for start in range(0, len(ids), request.batch_queries):
        chunk = ids[start : start + request.batch_queries]
        cap = request.max_new_tokens or free_response_cap(request.n_actions, request.line_cap)
        cfg = SamplerConfig(temperature=request.temperature, max_new_tokens=cap,
                            seed=request.seed + start, precision=request.precision)  # fmt: skip
        texts = [retrieval.dataset.queries[q] for q in chunk]
        contexts = (  # the game's feedback context, as in training and serving
            retrieval.feedback().contexts(texts, words, request.n_actions)
            if request.prompt == "feedback" else None
        )  # fmt: skip
        out += sample_rollouts(policy.model, policy.tokenizer, texts, request.samples, request.n_actions,
                               cfg, policy.version, sampler, query_ids=chunk, prompt_style=request.prompt,
                               format=request.format, line_cap=request.line_cap,
                               contexts=contexts)  # fmt: skip
        if progress is not None:
            progress(start + len(chunk), len(ids))
    statuses = [r.parsed.status for r in out]
    meta = {
        "source": "sampled", "policy_version": policy.version, "policy_name": policy.name,
        "split": request.split, "n_queries_asked": request.queries, "n_samples": request.samples,
        "n_actions": request.n_actions, "temperature": request.temperature,
        "max_new_tokens": request.max_new_tokens, "precision": request.precision,
        "format": request.format, "line_cap": request.line_cap, "prompt": request.prompt,
        "format_ok": statuses.count("ok") / len(statuses),
        "format_counts": {s: statuses.count(s) for s in sorted(set(statuses))},
    }  # fmt: skip
    actions = [RolloutActions(r.query_id, r.query, r.action_texts) for r in out]
    return Rollouts(actions, request.n_actions, request.anchor_query, meta)


def run_rollouts(request: AuditRequest, factory: sessionmaker[Session]) -> Rollouts:
    """The actions stored in a run's credit records (first N distinct queries), no sampling."""
    assert request.from_run is not None
    with session_scope(factory) as session:
        if repo.get_run(session, request.from_run) is None:
            raise LookupError(f"no training run with id {request.from_run}")
        records = repo.credit_records_for_run(session, request.from_run)
        rows = [
            (r.query_id, r.query_text, list(r.actions), r.anchor_query, r.policy_version, r.step)
            for r in records
        ]
    if not rows:
        raise ValueError(f"run {request.from_run} has no credit records to audit")
    keep = list(dict.fromkeys(q for q, *_ in rows))[: request.queries]
    rows = [r for r in rows if r[0] in set(keep)]
    anchors = {r[3] for r in rows}
    if len(anchors) != 1:
        raise ValueError(f"run {request.from_run} mixes anchor modes; audit one mode at a time")
    versions = sorted({r[4] for r in rows})
    meta = {
        "source": "run", "run_id": request.from_run, "split": None, "n_queries_asked": request.queries,
        "policy_version": versions[0] if len(versions) == 1 else None,
        "policy_versions": versions, "steps": sorted({r[5] for r in rows if r[5] is not None}),
    }  # fmt: skip
    actions = [RolloutActions(q, t, a) for q, t, a, *_ in rows]
    width = max(1, max(len(a.actions) for a in actions))
    return Rollouts(actions, width, anchors.pop(), meta)


def save_rollouts(rollouts: Rollouts, path: Path) -> None:
    """The audited actions (to inspect them, or re-audit with ``from_rollouts``)."""
    data = {
        "n_players": rollouts.n_players, "anchor_query": rollouts.anchor_query, "meta": rollouts.meta,
        "rollouts": [{"query_id": r.query_id, "query_text": r.query_text, "actions": r.actions} for r in rollouts.actions],
    }  # fmt: skip
    path.write_text(json.dumps(data, indent=1))


def load_rollouts(path: Path) -> Rollouts:
    """Rollouts written by :func:`save_rollouts` (source: the file; the rest of meta kept)."""
    if not path.is_file():
        raise FileNotFoundError(f"no saved rollouts at {path}")
    data = json.loads(path.read_text())
    actions = [
        RolloutActions(r["query_id"], r["query_text"], list(r["actions"])) for r in data["rollouts"]
    ]
    meta = {**data["meta"], "rollouts_file": str(path)}
    return Rollouts(actions, int(data["n_players"]), bool(data["anchor_query"]), meta)


def score_all(
    rollouts: Rollouts, retrieval: Retrieval, reference: SetScorer, train: list[SetScorer],
    list_k: int,
) -> tuple[CreditResult, dict[str, Games]]:  # fmt: skip
    """ONE credit call: every evaluator on the same coalition lists → one game pair each."""
    res = compute_credits(
        rollouts.actions, retrieval.executor, reference, list_k, anchor_query=rollouts.anchor_query,
        n_players=rollouts.n_players, extra_scorers=train,
    )  # fmt: skip
    qids = sorted({r.query_id for r in rollouts.actions})
    groups = torch.tensor([qids.index(r.query_id) for r in rollouts.actions])
    return res, {
        s.name: Games(res.extra[s.name].values, res.values, res.n_actions, groups) for s in train
    }


def _pick(scorers: Mapping[str, SetScorer], name: str) -> SetScorer:
    if name not in scorers:
        raise ValueError(f"evaluator {name!r} is not available here; available: {sorted(scorers)}")
    return scorers[name]


def run_audit(
    request: AuditRequest,
    *,
    retrieval: Retrieval,
    scorers: Mapping[str, SetScorer],
    factory: sessionmaker[Session],
    out_dir: Path,
    list_k: int,
    load_policy: Callable[[str | None], Any] | None = None,
    progress: ProgressFn | None = None,
    audit_id: int | None = None,
) -> list[AuditOutcome]:
    """Audit each training evaluator; write ``audit-<id>.json`` / ``.html`` under ``out_dir``
    and store one row each (the first fills the queued row ``audit_id`` of an API job)."""
    t0 = time.perf_counter()
    reference = _pick(scorers, request.reference)
    train = [_pick(scorers, name) for name in request.evaluators]
    if request.from_run is not None:
        rollouts = run_rollouts(request, factory)
    elif request.from_rollouts is not None:
        rollouts = load_rollouts(Path(request.from_rollouts))
    elif load_policy is None:
        raise ValueError("sampling rollouts needs a policy loader (or pass from_run)")
    else:
        rollouts = sampled_rollouts(request, retrieval, load_policy, progress)
    t_rollouts = time.perf_counter() - t0
    res, games = score_all(rollouts, retrieval, reference, train, list_k)
    meta = {
        **rollouts.meta, "anchor_query": rollouts.anchor_query, "request": plain_request(request),
        "index_version": res.versions["index_version"], "embedder_version": res.versions["embedder_version"],
        "rollouts_s": round(t_rollouts, 1),
    }  # fmt: skip
    outcomes = []
    for i, scorer in enumerate(train):
        result = audit(games[scorer.name], request.config())
        meta["elapsed_s"] = round(time.perf_counter() - t0, 1)
        report = build_report(result, train=_who(scorer), reference=_who(reference), meta=meta)
        validate_report(report)
        outcomes.append(_store(factory, report, out_dir, audit_id if i == 0 else None))
    save_rollouts(
        rollouts, outcomes[0].json_path.with_name(f"audit-{outcomes[0].id}-rollouts.json")
    )
    return outcomes


def _who(scorer: SetScorer) -> dict[str, str]:
    return {"name": scorer.name, "version": scorer.version}


def _store(
    factory: sessionmaker[Session], report: dict[str, Any], out_dir: Path, audit_id: int | None
) -> AuditOutcome:
    """One transaction: the row (id) → files named by it → the row's html_path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fields = {
        "train_evaluator": report["train_evaluator"]["name"],
        "reference_evaluator": report["reference_evaluator"]["name"],
        "n_rollouts": report["n_rollouts"], "report": report, "verdict": report["verdict"],
    }  # fmt: skip
    with session_scope(factory) as session:
        if audit_id is None:
            row = repo.add_audit_report(session, **fields)
        elif repo.move_audit_report(session, audit_id, PENDING, **fields):
            row = repo.update_audit_report(session, audit_id)  # the filled row, no new values
        else:  # cancelled (or marked failed) while it ran: that state stays
            found = repo.get_audit_report(session, audit_id)
            status = found.report.get("status") if found is not None else "gone"
            raise JobConflict(f"audit {audit_id} is {status}: its report is not stored")
        json_path, html_path = out_dir / f"audit-{row.id}.json", out_dir / f"audit-{row.id}.html"
        json_path.write_text(json.dumps(report, indent=1, sort_keys=True))
        html_path.write_text(render_html(report), encoding="utf-8")
        row.html_path = str(html_path)
        session.flush()
        return AuditOutcome(row.id, report, json_path, html_path)
