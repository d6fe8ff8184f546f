"""The credit path, side by side in one run: exact Shapley algebra, then end-to-end credit.

    python benchmarks/bench_credit.py [--rollouts 256 --group 8 --m 5 --max-docs 500]

1. Exact Shapley algebra (reuses ``bench_shapley``): 4096 games at m = 10, batched matmul vs
   shapiq's ExactComputer one game at a time (extrapolated from ``--shapiq-games`` games),
   and one game. Targets: ≥ 5,000× on the batch, > 1× on one game.
2. Credit: ``--rollouts`` rollouts of m actions (rewrites of real SciFact train queries,
   ``--group`` rollouts per query), from a WARM action cache, for the ``replay`` and the
   ``surrogate`` scorer:
   (a) engine — ``compute_credits`` end to end;
   (b) naive loop — per rollout: fetch its cached actions and (memoised) query embedding, per coalition merge
       the lists in Python and call the scorer on that one list, Shapley by the subset
       formula in Python; timed on ``--naive-rollouts`` rollouts and extrapolated;
   (c) the scorer's own batched forward on the same (R, 2^m, K) lists.
   Targets: engine ≥ 50× faster than naive; engine / scorer forward ≤ 1.5× (meaningful for the
   neural scorer; replay's forward is ~1 ms). A per-stage profile of the naive loop follows
   each table. Engine and naive φ (and lists) are checked to agree.

Fast paths report the median of ``--repeats`` runs (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_shapley helpers

from bench_shapley import shapiq_values  # noqa: E402

from app.runtime import Retrieval, build_retrieval  # noqa: E402
from app.settings import get_settings  # noqa: E402
from evaluator.credit import CreditResult, RolloutActions, compute_credits  # noqa: E402
from evaluator.scorers import SetScorer, make_scorer  # noqa: E402
from evaluator.scorers.surrogate import (  # noqa: E402
    SurrogateConfig,
    SurrogateNet,
    SurrogateScorer,
    load_surrogate,
)
from evaluator.shapley import (  # noqa: E402
    exact_shapley,
    shapley_weight_matrix,
)

KEYWORDS = [
    "evidence",
    "mechanism",
    "clinical trial",
    "risk factors",
    "review",
    "in mice",
    "meta-analysis",
    "cohort",
]
PHI_TOL = {"replay": 1e-12, "surrogate": 1e-5}  # surrogate: float32 forward, batch 1 vs 8192


def paired_seconds(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each fn over ``repeats`` rounds, run round-robin (one warm-up each), so that
    load from other users of the machine hits every path alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        print(
            "  ".join(
                cell.rjust(w) if c else cell.ljust(w)
                for c, (cell, w) in enumerate(zip(r, widths, strict=True))
            )
        )


# ---------------------------------------------------------------- 1. exact Shapley algebra


def shapley_section(games: int, m: int, shapiq_games: int, repeats: int) -> None:
    values = torch.randn(
        games, 2**m, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    shapley_weight_matrix(m)
    t = paired_seconds(
        {"batch": lambda: exact_shapley(values, m), "one": lambda: exact_shapley(values[0], m)},
        repeats,
    )
    batch, one = min(t["batch"]), min(t["one"])
    phi = exact_shapley(values, m)
    shapiq_values(values[0].numpy(), m)  # warm-up
    ref_t, err = [], 0.0
    for i in range(shapiq_games):
        ref, sec = shapiq_values(values[i].numpy(), m)
        ref_t.append(sec)
        err = max(err, float(np.abs(ref - phi[i].numpy()).max()))
    per_game = min(ref_t)
    print(
        f"== 1. exact Shapley algebra: m = {m} ({2**m} coalitions), float64, {torch.get_num_threads()} threads"
    )
    print_table(
        [
            ("", "ours (batched matmul)", "shapiq ExactComputer", "ratio", "target"),
            (
                f"{games} games: s",
                f"{batch:.4g}",
                f"{per_game * games:.4g} (extrapolated)",
                f"{per_game * games / batch:,.0f}x",
                ">= 5,000x",
            ),
            ("one game: s", f"{one:.3g}", f"{per_game:.3g}", f"{per_game / one:,.0f}x", "> 1x"),
        ]
    )
    print(
        f"shapiq: fastest of {shapiq_games} games, extrapolated; ours: fastest of {repeats} runs. "
        f"max |phi diff| = {err:.1e} ({'OK' if err <= 1e-9 else 'MISMATCH'})\n"
    )


# ---------------------------------------------------------------- 2. credit: workload


def variants(query: str, g: int, m: int) -> list[str]:
    """m deterministic rewrites of ``query`` for group member ``g``: the query, keywords
    appended, one word dropped, a prefix kept."""
    words = query.rstrip(".").split()
    n = len(words)
    pool = [
        f"{query} {KEYWORDS[g % len(KEYWORDS)]}",
        " ".join(words[: g % n] + words[g % n + 1 :]) or query,
        f"{query} {KEYWORDS[(g + 3) % len(KEYWORDS)]} {KEYWORDS[(g + 5) % len(KEYWORDS)]}",
        " ".join(words[: max(2, n - 1 - g % 3)]),
        " ".join(words[1 + g % 2 :]) or query,
    ]
    return [query] + [pool[(j + g) % len(pool)] for j in range(m - 1)]


def make_rollouts(r: Retrieval, n: int, group: int, m: int) -> list[RolloutActions]:
    qrels = r.dataset.qrels_rows("train")
    judged = [q for q in r.dataset.split_query_ids("train") if qrels.get(q)]
    out = []
    for i in range(n):
        qid = judged[i // group]
        out.append(
            RolloutActions(
                qid, r.dataset.queries[qid], variants(r.dataset.queries[qid], i % group, m)
            )
        )
    return out


# ---------------------------------------------------------------- 2. credit: naive reference


def python_merge(rows: np.ndarray, scores: np.ndarray, mask: int, k: int) -> list[int]:
    """Coalition ``mask``'s list: best score per document, sorted (ties: smaller row), top k."""
    best: dict[int, float] = {}
    for j in range(rows.shape[0]):
        if mask >> j & 1:
            for row, s in zip(rows[j].tolist(), scores[j].tolist(), strict=True):
                if row >= 0 and (row not in best or s > best[row]):
                    best[row] = s
    ranked = sorted(best, key=lambda d: (-best[d], d))[:k]
    return ranked + [-1] * (k - len(ranked))


def python_shapley(v: list[float], m: int) -> list[float]:
    """φ_j = Σ_{S ∌ j} |S|!(m−|S|−1)!/m! (v(S∪{j}) − v(S)), one Python loop per term."""
    phi = [0.0] * m
    for j in range(m):
        for s in range(2**m):
            if not s >> j & 1:
                size = bin(s).count("1")
                w = math.factorial(size) * math.factorial(m - size - 1) / math.factorial(m)
                phi[j] += w * (v[s | 1 << j] - v[s])
    return phi


def naive_credit(
    ro: RolloutActions, r: Retrieval, scorer: SetScorer, k: int, spent: dict[str, float]
) -> tuple[list[float], list[list[int]]]:
    """One rollout the obvious way → (φ, the 2^m lists); adds its stage seconds to ``spent``."""
    m = len(ro.actions)
    t0 = time.perf_counter()
    batch = r.executor.run(ro.actions)  # cached
    t1 = time.perf_counter()
    emb = (  # same rule as the engine: embed (memoised) only when the scorer reads it
        torch.from_numpy(r.executor.embed_queries([ro.query_text]))
        if scorer.uses_query_emb
        else torch.zeros(1, 0)
    )
    t2 = time.perf_counter()
    lists = [python_merge(batch.rows, batch.scores, mask, k) for mask in range(2**m)]
    t3 = time.perf_counter()
    v = [float(scorer.score([ro.query_id], emb, torch.tensor([[lst]]))[0, 0]) for lst in lists]
    t4 = time.perf_counter()
    phi = python_shapley(v, m)
    _ = ([v[1 << j] - v[0] for j in range(m)], [v[-1] - v[(2**m - 1) ^ 1 << j] for j in range(m)])
    t5 = time.perf_counter()
    for key, sec in zip(NAIVE_STAGES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
        spent[key] = spent.get(key, 0.0) + sec
    return phi, lists


NAIVE_STAGES = (
    "fetch cached actions (executor.run)",
    "query embedding (memoised)",
    "Python merge of 2^m lists",
    "2^m scorer calls of 1 list",
    "Python Shapley + baselines",
)


# ---------------------------------------------------------------- 2. credit: section


def distinct_lists(res: CreditResult) -> int:
    """How many of the R·2^M (query, list) pairs are distinct (a scorer could score only those)."""
    qidx = {q: i for i, q in enumerate(sorted({ro.query_text for ro in res.rollouts}))}
    q = torch.tensor([qidx[ro.query_text] for ro in res.rollouts])
    lists = res.lists.doc_idx  # (R, 2^M, K)
    keyed = torch.cat([q[:, None, None].expand(-1, lists.shape[1], 1), lists], dim=2)
    return int(torch.unique(keyed.reshape(-1, keyed.shape[2]), dim=0).shape[0])


def credit_section(
    name: str,
    scorer: SetScorer,
    rollouts: list[RolloutActions],
    r: Retrieval,
    args: argparse.Namespace,
) -> None:
    k, n = args.list_k, len(rollouts)
    res = compute_credits(rollouts, r.executor, scorer, k)
    texts = sorted({ro.query_text for ro in rollouts})
    qe = torch.from_numpy(r.embedder.encode(texts))
    query_emb = qe[[texts.index(ro.query_text) for ro in rollouts]]
    qids = [ro.query_id for ro in rollouts]
    t = paired_seconds(  # engine and the scorer's own forward, round-robin
        {
            "engine": lambda: compute_credits(rollouts, r.executor, scorer, k),
            "forward": lambda: scorer.score(qids, query_emb, res.lists.doc_idx),
        },
        args.repeats,
    )
    engine, fwd = min(t["engine"]), min(t["forward"])

    sub = rollouts[: args.naive_rollouts]
    naive_credit(sub[0], r, scorer, k, {})  # warm-up
    spent: dict[str, float] = {}
    start = time.perf_counter()
    ref = [naive_credit(ro, r, scorer, k, spent) for ro in sub]
    naive = (time.perf_counter() - start) / len(sub) * n
    phi_err = max(
        float(np.abs(np.array(p) - res.phi[i].numpy()).max()) for i, (p, _) in enumerate(ref)
    )
    lists_ok = all(
        torch.equal(torch.tensor(lst), res.lists.doc_idx[i]) for i, (_, lst) in enumerate(ref)
    )

    shape = tuple(res.lists.doc_idx.shape)
    print(
        f"== 2. credit, scorer '{name}' ({scorer.version}): {n} rollouts x m = {args.m}, "
        f"lists {shape} ({distinct_lists(res)} distinct (query, list) pairs), warm cache"
    )
    med = statistics.median
    print_table(
        [
            ("path", "min s", "median s", "per rollout ms", "vs engine (min)"),
            ("(a) engine compute_credits", f"{engine:.4f}", f"{med(t['engine']):.4f}",
             f"{engine / n * 1e3:.3f}", "1x"),
            (f"(b) naive loop (extrapolated from {len(sub)})", f"{naive:.3f}", "-",
             f"{naive / n * 1e3:.2f}", f"{naive / engine:,.0f}x slower"),
            ("(c) scorer.score forward only", f"{fwd:.4f}", f"{med(t['forward']):.4f}",
             f"{fwd / n * 1e3:.3f}", f"{fwd / engine:.3f}x"),
        ]
    )  # fmt: skip
    hit = lambda ok: "MET" if ok else "MISSED"  # noqa: E731
    print(
        f"engine vs naive: {naive / engine:,.0f}x faster (target >= 50x: {hit(naive / engine >= 50)}); "
        f"engine total / scorer forward: {engine / fwd:.2f}x (target <= 1.5x: {hit(engine / fwd <= 1.5)})"
    )
    tol = PHI_TOL[name]
    ok = phi_err <= tol and lists_ok
    print(
        f"check on the {len(sub)} naive rollouts: lists identical: {lists_ok}; max |phi engine - "
        f"phi naive| = {phi_err:.1e} (tol {tol:g}: {'OK' if ok else 'MISMATCH'}); "
        f"max |efficiency residual| = {float(res.residual.abs().max()):.1e}"
    )
    rows = [("naive stage, per rollout", "mean ms", "share")]
    naive_total = sum(spent.values())
    rows += [
        (key, f"{sec / len(sub) * 1e3:.2f}", f"{sec / naive_total:.0%}")
        for key, sec in spent.items()
    ]
    print_table(rows)
    print()


def build_surrogate(r: Retrieval, args: argparse.Namespace, device: str) -> tuple[SetScorer, str]:
    doc_emb = torch.from_numpy(r.index.embeddings)
    path = get_settings().resolved_surrogate_path()
    if path.is_file():
        return load_surrogate(
            path, doc_emb=doc_emb, k=args.list_k, device=device, doc_fingerprint=r.index.version
        ), f"fitted, {path}"
    with torch.random.fork_rng():
        torch.manual_seed(args.seed)
        net = SurrogateNet(SurrogateConfig(dim=doc_emb.shape[1], k_max=args.list_k))
    scorer = SurrogateScorer(
        net, doc_emb=doc_emb, k=args.list_k, device=device, doc_fingerprint=r.index.version
    )
    return (
        scorer,
        f"UN-FITTED frozen SurrogateNet (seed {args.seed}): same architecture and cost as a fitted one",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--games", type=int, default=4096)
    ap.add_argument("--shapley-m", type=int, default=10)
    ap.add_argument("--shapiq-games", type=int, default=8)
    ap.add_argument("--rollouts", type=int, default=256)
    ap.add_argument("--group", type=int, default=8, help="rollouts per query (GRPO group)")
    ap.add_argument("--m", type=int, default=5, help="actions per rollout")
    ap.add_argument("--naive-rollouts", type=int, default=16)
    ap.add_argument("--max-docs", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-shapley", action="store_true")
    args = ap.parse_args()

    settings = get_settings()
    r = build_retrieval(settings, max_docs=args.max_docs)
    args.list_k = settings.list_k
    device = settings.resolved_device()
    if not args.skip_shapley:
        shapley_section(args.games, args.shapley_m, args.shapiq_games, args.repeats * 20)

    rollouts = make_rollouts(r, args.rollouts, args.group, args.m)
    warm = r.executor.run([a for ro in rollouts for a in ro.actions])  # warm the action cache
    qrels = {qid: rows for qid, rows in r.dataset.qrels_rows("train").items()}
    print(
        f"index {r.index.version} ({len(r.index)} docs), k = {r.cache.k}, K = {args.list_k}, device {device}, "
        f"{torch.get_num_threads()} torch threads; {len({ro.query_id for ro in rollouts})} train queries x "
        f"{args.group} rollouts; {warm.stats['unique']} distinct rewrites (cache warmed: {warm.stats['misses']} misses now)\n"
    )
    replay = make_scorer("replay", qrels=qrels, k=args.list_k, device=device)
    credit_section("replay", replay, rollouts, r, args)
    surrogate, how = build_surrogate(r, args, device)
    print(f"surrogate: {how}")
    credit_section("surrogate", surrogate, rollouts, r, args)


if __name__ == "__main__":
    main()
