"""`POST /v1/credits` and `GET /v1/credits/{id}`: THE credit path on one query, persisted.

Read :func:`compute_and_store`. It resolves the query (dataset id or text), calls
`evaluator.credit.compute_credits` — the same function the trainer calls — shapes φ with
`policy.advantages.shape_credits`, and stores one credit record (`app.db.records.credit_record`,
the form training stores too: in the pooled game with who found what, as counts) in its own
transaction. It is
blocking (embedding, FAISS, scoring): the route runs it in the API's compute thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from sqlalchemy.orm import Session, sessionmaker

from app.db import repositories as repo
from app.db import session_scope
from app.db.models import CreditRecord
from app.db.records import credit_record, game_of
from app.errors import InvalidField, QueryConflict, UnknownQuery
from app.runtime import Retrieval
from app.schemas import CreditRequest, CreditResponse
from evaluator.credit import RolloutActions, compute_credits
from evaluator.scorers import SetScorer
from evaluator.scorers.replay import ReplayScorer
from policy.advantages import shape_credits

EXTERNAL_POLICY = "external"  # rewrites sent by the caller, not sampled by a served policy
ADHOC_QUERY_ID = "adhoc"


def resolve_query(
    req: CreditRequest, retrieval: Retrieval, judged: Callable[[str], bool] | None = None
) -> tuple[str, str]:
    """(query id, text): a dataset id, or text (matched to its dataset id when it is one).

    ``judged``: under an evaluator that scores against the judgments (replay), whether a query
    id has any; None: every query can be scored. A query the dataset lacks is UnknownQuery (404,
    like an unknown policy version): an unknown id, or under replay an unjudged id or a text no
    judged query has. Input that clashes with the dataset is QueryConflict (409): a text that is
    several scorable queries' text, or query and query_id that disagree. The OpenAPI cannot
    state what the dataset holds (so these are not 422s); it states the rest (query or query_id).
    """
    queries = retrieval.dataset.queries
    text = req.query.strip() if req.query is not None else None
    if req.query_id is not None:
        if req.query_id not in queries:
            raise UnknownQuery("body.query_id", f"unknown query id {req.query_id!r}")
        own = queries[req.query_id]
        if text is not None and text != own.strip():
            raise QueryConflict(
                "body.query",
                f"differs from the text of query {req.query_id!r} ({own[:80]!r}): send one of "
                "the two, or both alike",
            )
        if judged is not None and not judged(req.query_id):
            raise UnknownQuery("body.query_id", _unjudged(req.query_id))
        return req.query_id, own
    if text is None:
        raise InvalidField("body.query", "give query (text) or query_id (a dataset id)")
    ids = [q for q, t in queries.items() if t.strip() == text]
    scorable = [q for q in ids if judged is None or judged(q)]
    if len(scorable) > 1:
        raise QueryConflict(
            "body.query",
            f"is the text of {len(scorable)} dataset queries ({', '.join(scorable[:5])}), "
            "whose judgments differ: send query_id to choose one",
        )
    if not scorable and judged is not None:
        raise UnknownQuery(
            "body.query",
            _unjudged(ids[0])
            if ids
            else "no judged query has this text, and the replay evaluator needs one: pass "
            "query_id or a judged query's exact text",
        )
    return (scorable[0] if scorable else ADHOC_QUERY_ID), text


def _unjudged(qid: str) -> str:
    return (
        f"query {qid!r} has no relevance judgments in this dataset, so the replay evaluator "
        "cannot score it: choose a judged query, or evaluator cosine"
    )


def compute_and_store(
    req: CreditRequest,
    retrieval: Retrieval,
    scorers: Mapping[str, SetScorer],
    factory: sessionmaker[Session],
    *,
    list_k: int,
) -> CreditResponse:
    """Credit the request's rewrites, persist the record, return it."""
    scorer = scorers.get(req.evaluator)
    if scorer is None:
        raise InvalidField(
            "body.evaluator", f"{req.evaluator!r} is not available here; valid: {sorted(scorers)}"
        )
    judged = None  # an evaluator scoring against the judgments: which queries it can score
    if isinstance(scorer, ReplayScorer) and not scorer.allow_unjudged:
        judged = scorer.qrels.position.__contains__
    qid, text = resolve_query(req, retrieval, judged)
    res = compute_credits(
        [RolloutActions(qid, text, list(req.rewrites))],
        retrieval.executor,
        scorer,
        list_k,
        anchor_query=req.anchor_query,
    )
    m = len(req.rewrites)
    mask = torch.ones(1, 1, m, dtype=torch.bool)
    shaped = shape_credits(res.phi[:, :m].reshape(1, 1, m), mask)[0, 0].tolist()  # (m,)
    record = credit_record(
        res, 0, run_id=None, step=None, sample_index=0, policy_version=EXTERNAL_POLICY,
        format_status="ok", advantages={"shaped": shaped, "shaping": "projection"},
    )  # fmt: skip
    with session_scope(factory) as session:
        row = repo.add_credit_records(session, [record])[0]
        return to_response(row)


def get_credit(factory: sessionmaker[Session], record_id: int) -> CreditResponse | None:
    with session_scope(factory) as session:
        row = repo.get_credit_record(session, record_id)
        return None if row is None else to_response(row)


def to_response(row: CreditRecord) -> CreditResponse:
    baselines = row.baselines or {}
    table = list(row.value_table)
    return CreditResponse(
        id=row.id,
        query_id=row.query_id,
        query_text=row.query_text,
        actions=list(row.actions),
        anchor_query=row.anchor_query,
        value_table=table,
        phi=list(row.credits),
        baselines={k: baselines.get(k, []) for k in ("singleton", "leave_one_out", "broadcast")},
        shaped_advantages=(row.advantages or {}).get("shaped"),
        value_empty=table[0],
        value_full=row.value_full,
        efficiency_residual=row.efficiency_residual,
        versions={
            "index_version": row.index_version,
            "embedder_version": row.embedder_version,
            "evaluator_name": row.evaluator_name,
            "evaluator_version": row.evaluator_version,
        },
        cache=row.cache_stats,
        created_at=row.created_at,
        game=game_of(row.merge),
        merge=row.merge,
        pool=row.pool,
    )
