"""Where do the credits differ? Cheap credits vs exact Shapley on real rollouts, per environment.

Read :func:`credit_report`. The same rollouts (sampled from a policy with the audit's sampling
helper, one set per m, or a stored rollouts file) are credited in every requested environment —
a retriever (dense MiniLM + FAISS, or bm25) × a merge rule for coalition lists (``max``, or
``rrf`` with constant k, or ``pool``: the pooled game) × the query as an anchor player or not —
by ONE credit call each (:func:`evaluator.credit.compute_credits` with ``merge=`` / ``rrf_k=``),
scored by replay nDCG@K against the split's qrels (graded recall of the pool under ``pool``). :func:`evaluator.credit_diff.credit_differences` then says,
for that game, how often singleton and leave-one-out rank a rollout's actions differently from
Shapley, how far they are from it relative to the rollout's gain, and how much the actions
interact. Nothing is trained: this is where Shapley credit can matter at all.

One row per (environment, m, anchor), with both readings of two questions side by side
(definitions: :mod:`evaluator.credit_diff`):

- ``v_any_changes`` (some coalition's v(S) ≠ v(∅)) and ``v_full_changes`` (v(N) ≠ v(∅));
- ``{singleton,leave_one_out}_rank_differs_tie_aware`` (a tie against a strict order counts) and
  ``…_rank_reversed_strict`` (only strictly opposite pairs count): shares of rollouts with ≥ 2
  actions in the ``*_of_ranked`` keys, of all rollouts in the plain keys;
- ``singleton_gap`` / ``leave_one_out_gap``: mean |φ − c| per action / |v(N) − v(∅)|;
- ``interaction_mean`` / ``interaction_abs_mean``: mean (|·|) pairwise Shapley interaction;
- ``gain_mean``: mean v(N) − v(∅) (with the anchor: query + rewrites over the query alone);
  ``v_empty_mean`` (the query alone, anchor on; 0 off) and ``v_full_mean``.

``rollouts`` says, per m, where the rollouts came from: the policy that sampled them (name and
version), the format (free / constrained) and the well-formed share ``format_ok``.

The report as table cells, Markdown and JSON: :mod:`app.reports.credit_differences`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

from app.runtime import Retrieval
from app.services.audit import AuditRequest, Rollouts, load_rollouts, sampled_rollouts
from app.training.evaluate import machine_info
from evaluator.credit import compute_credits
from evaluator.credit_diff import DEFAULT_TOL, RANK_KEYS, credit_differences
from evaluator.retrievers import check_merge, check_retriever
from evaluator.scorers import SetScorer
from policy.constrain import DEFAULT_LINE_CAP

ENVIRONMENTS: tuple[tuple[str, str], ...] = (
    ("dense", "max"),
    ("dense", "rrf"),
    ("bm25", "rrf"),
    ("bm25", "max"),
)
"""(retriever, merge rule): today's game first, then the fused-list and lexical ones."""
ProgressFn = Callable[[int, int], None]


@dataclass(frozen=True)
class CreditReportRequest:
    """Which games to measure and on which rollouts (sampled, or ``from_rollouts``)."""

    n_actions: tuple[int, ...] = (4, 8)
    anchors: tuple[bool, ...] = (True, False)
    environments: tuple[tuple[str, str], ...] = ENVIRONMENTS
    rrf_k: float = 60.0
    from_rollouts: str | None = None
    """A stored rollouts file (``audit-<id>-rollouts.json``): its m, no sampling."""
    policy: str | None = None
    split: str = "test"
    queries: int = 100
    samples: int = 4
    seed: int = 0
    temperature: float = 0.7
    format: str = "constrained"
    line_cap: int = DEFAULT_LINE_CAP
    precision: str = "float32"
    batch_queries: int = 8
    prompt: str = "oneshot"
    tol: float = DEFAULT_TOL

    def __post_init__(self) -> None:
        if not self.n_actions or not self.anchors or not self.environments:
            raise ValueError("give at least one m, one anchor mode and one environment")
        for retriever, merge in self.environments:
            check_retriever(retriever)
            check_merge(merge)
        if self.from_rollouts is not None and self.policy is not None:
            raise ValueError(
                "--from-rollouts measures stored rollouts (their own policy); --policy samples "
                "new ones: pass one of them"
            )
        if self.rrf_k < 0 or self.tol < 0:
            raise ValueError(f"rrf_k and tol must be >= 0, got {self.rrf_k}, {self.tol}")
        for m in self.n_actions:
            self.sampling(m)  # every m, split, format … checked now, not after sampling

    @property
    def retrievers(self) -> list[str]:
        return sorted({r for r, _ in self.environments})

    def sampling(self, m: int) -> AuditRequest:
        """The audit's sampling request for m rewrites (its evaluators are not used here)."""
        return AuditRequest(
            evaluators=("cosine",), policy=self.policy, split=self.split, queries=self.queries,
            samples=self.samples, n_actions=m, seed=self.seed, temperature=self.temperature,
            format=self.format, line_cap=self.line_cap, precision=self.precision,
            batch_queries=self.batch_queries, prompt=self.prompt,
        )  # fmt: skip


def rollout_sets(
    request: CreditReportRequest,
    retrieval: Retrieval,
    load_policy: Callable[[str | None], Any] | None,
    progress: ProgressFn | None = None,
) -> dict[int, Rollouts]:
    """The rollouts by m: the stored file (its m), or one sampled set per requested m."""
    if request.from_rollouts is not None:
        stored = load_rollouts(Path(request.from_rollouts))
        split = stored.meta.get("split")
        if split is not None and split != request.split:
            raise ValueError(
                f"the stored rollouts are of the {split!r} split; measure them with --split {split}"
            )
        return {stored.n_players: stored}
    if load_policy is None:
        raise ValueError("sampling rollouts needs a policy loader (or pass from_rollouts)")
    loader = cache(load_policy)  # one policy load for every m
    total = request.queries * len(request.n_actions)
    out = {}
    for i, m in enumerate(request.n_actions):
        done = i * request.queries

        def report(n: int, _: int, done: int = done) -> None:
            if progress is not None:
                progress(done + n, total)

        out[m] = sampled_rollouts(request.sampling(m), retrieval, loader, report)
    return out


def rollout_source(rollouts: Rollouts) -> dict[str, Any]:
    """Where a rollout set came from: its metadata (policy name and version, format_ok, …), its
    counts, and ``format``. Rollouts saved before the audit recorded ``format`` were sampled
    free-format (the only format then): ``format_recorded`` False says it was inferred."""
    meta = rollouts.meta
    recorded = "format" in meta or meta.get("source") != "sampled"
    return {
        **meta,
        "format": meta.get("format", None if recorded else "free"),
        "format_recorded": recorded,
        "n_rollouts": len(rollouts.actions),
        "n_players": rollouts.n_players,
        "n_queries": len({a.query_id for a in rollouts.actions}),
    }


def _same_documents(retrievals: Mapping[str, Retrieval]) -> None:
    """Replay scores row ids: every retriever must index the same documents in the same order."""
    ids = {name: [d.doc_id for d in r.dataset.documents] for name, r in retrievals.items()}
    first = next(iter(ids.values()))
    if any(other != first for other in ids.values()):
        raise ValueError(
            f"the retrievers {sorted(ids)} index different documents: build both on one corpus slice"
        )


def measure(
    rollouts: Rollouts,
    retrieval: Retrieval,
    scorer: SetScorer,
    list_k: int,
    *,
    merge: str,
    rrf_k: float,
    anchor: bool,
    tol: float = DEFAULT_TOL,
) -> dict[str, Any]:
    """One game: credit the rollouts once, then the credit-difference measurements."""
    res = compute_credits(
        rollouts.actions, retrieval.executor, scorer, list_k, anchor_query=anchor,
        n_players=rollouts.n_players, merge=merge, rrf_k=rrf_k,
    )  # fmt: skip
    diff = credit_differences(res.values, res.n_actions, tol=tol).as_dict()
    ranked_share = diff["n_rollouts"] / max(int(diff["n_ranked"]), 1)
    gain = res.values[:, -1] - res.values[:, 0]
    return {
        **diff,
        **{f"{key}_of_ranked": diff[key] * ranked_share for key in RANK_KEYS},
        "gain_mean": float(gain.mean()),
        "v_empty_mean": float(res.values[:, 0].mean()),
        "v_full_mean": float(res.values[:, -1].mean()),
        "actions_mean": float(res.n_actions.double().mean()),
        "index_version": res.versions.get("index_version"),
    }


def credit_report(
    request: CreditReportRequest,
    retrievals: Mapping[str, Retrieval],
    scorer: SetScorer | Mapping[str, SetScorer],
    list_k: int,
    *,
    load_policy: Callable[[str | None], Any] | None = None,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Every (environment, m, anchor) row on the same rollouts (see the module docstring).

    ``retrievals``: one :class:`Retrieval` per retriever the environments name (built on the
    same corpus slice: ``build_retrieval(settings, retriever=...)``); ``scorer``: replay nDCG@K
    on the qrels of the rollouts' split, or one per game (``{"list": …, "pool": …}``: an
    environment whose merge rule is ``pool`` plays the pooled game, scored by graded recall)."""
    scorers = {"list": scorer, "pool": scorer} if not isinstance(scorer, Mapping) else scorer
    missing = [r for r in request.retrievers if r not in retrievals]
    if missing:
        raise ValueError(f"no retrieval stack for {missing}; have {sorted(retrievals)}")
    used = {name: retrievals[name] for name in request.retrievers}
    _same_documents(used)
    t0 = time.perf_counter()
    sets = rollout_sets(request, used[request.retrievers[0]], load_policy, progress)
    skipped = sorted(set(request.n_actions) - set(sets)) if request.from_rollouts else []
    t_rollouts = time.perf_counter() - t0
    rows = []
    for m, rollouts in sorted(sets.items()):
        if not rollouts.actions:
            raise ValueError(f"no rollouts to measure for m = {m}")
        for retriever, merge in request.environments:
            for anchor in request.anchors:
                row = measure(
                    rollouts, used[retriever], scorers["pool" if merge == "pool" else "list"], list_k,
                    merge=merge, rrf_k=request.rrf_k, anchor=anchor, tol=request.tol,
                )  # fmt: skip
                rows.append(
                    {"retriever": retriever, "merge": merge, "m": m, "anchor": anchor, **row}
                )
    return {
        "kind": "credit_differences",
        "request": {**asdict(request), "environments": [list(e) for e in request.environments]},
        "rollouts": {str(m): rollout_source(ro) for m, ro in sets.items()},
        "skipped_m": skipped,
        "list_k": list_k,
        "scorer": scorers["list"].name,
        "scorer_versions": {game: s.version for game, s in scorers.items()},
        "indexes": {name: r.index.version for name, r in used.items()},
        "n_documents": len(next(iter(used.values())).dataset.documents),
        "machine": machine_info(),
        "rollouts_s": round(t_rollouts, 1),
        "elapsed_s": round(time.perf_counter() - t0, 1),
        "rows": rows,
    }


__all__: Sequence[str] = (
    "ENVIRONMENTS", "CreditReportRequest", "credit_report", "measure", "rollout_source",
)  # fmt: skip
