"""Headroom of self-training in the pooled game: what the best of G samples finds over greedy.

A warm start trained on its own samples can only learn what its samples hold. On the first N
queries of a held-out split (DEV; never TEST), this prints the pool recall (the game's v(N):
graded recall of the query's top k ∪ each rewrite's top k) of

- the start's greedy rewrites, decoded as served (the degenerate guard), and keyword expansion;
- the mean of G samples per query at temperature T (constrained format, line cap 16; a sampled
  string of repeats is played as an empty action, as training plays it);
- the best of the G samples (an oracle: it picks with the split's judgments) and the m actions
  with the highest Shapley credit across the G samples, played together (an oracle too).

``--expert-iteration N``: the test of whether the oracle's gain carries to unseen queries. G
samples for N TRAIN queries (after the ones the warm start saw), per query the best sample
(``best``) or the best only where it beats greedy by 0.005 and greedy elsewhere (``margin``);
the start is fine-tuned on them (`policy.warmstart.warmstart`, the warm start's SFT) at every
``--lr`` × ``--epochs``, and each fine-tuned policy is scored greedy on the same held-out
queries. Settings come from the environment (``CASI_*``), as for `casi train`:

    CASI_GAME=pool CASI_MERGE=pool CASI_RETRIEVER=bm25 CASI_BM25_STEMMER=none \\
    CASI_BM25_RULES=2 CASI_RETRIEVAL_K=50 CASI_DATASET=data/nfcorpus CASI_THREADS=1 \\
    .venv/bin/python benchmarks/headroom_dev.py var/models/warmstart-<version> --out h.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from app.runtime import Retrieval, build_retrieval, build_scorer, configure_threads
from app.settings import Settings
from app.training.evaluate import EvalRequest, evaluate_request, held_out_request
from app.training.policy_loader import load_policy_ref
from app.training.splits import train_val_ids
from evaluator.credit import CreditResult, RolloutActions, compute_credits
from evaluator.scorers import SetScorer
from evaluator.text import degenerate
from policy.rollout import RolloutConfig, sample_rollouts
from policy.sampler import SamplerConfig
from policy.warmstart import WarmstartExample, numbered, warmstart

M, LINE_CAP, WORDS, MARGIN = 4, 16, 30, 0.005
START_QUERIES = 384  # the warm start's TRAIN queries (48 steps × 8): expert iteration skips them


class Game:
    """The pooled game of the configured retrieval, the policy's prompt and its decoding."""

    def __init__(self, retrieval: Retrieval, scorer: SetScorer, settings: Settings) -> None:
        self.retrieval, self.scorer, self.list_k = retrieval, scorer, settings.list_k
        self.feedback = retrieval.feedback()

    def credit(
        self, qids: Sequence[str], texts: Sequence[str], sets: Sequence[Sequence[str]]
    ) -> CreditResult:
        players = [RolloutActions(q, t, list(a)) for q, t, a in zip(qids, texts, sets, strict=True)]
        return compute_credits(
            players, self.retrieval.executor, self.scorer, self.list_k, n_players=M
        )

    def value(
        self, qids: Sequence[str], texts: Sequence[str], sets: Sequence[Sequence[str]]
    ) -> np.ndarray:
        return self.credit(qids, texts, sets).values[:, -1].numpy()

    def samples_credit(
        self, qids: Sequence[str], texts: Sequence[str], samples: Sequence[Sequence[Sequence[str]]]
    ) -> CreditResult:
        """One credit call over every query's G sampled sets (query-major)."""
        g = len(samples[0])
        return self.credit([q for q in qids for _ in range(g)], [t for t in texts for _ in range(g)],
                           [s for row in samples for s in row])  # fmt: skip

    def held_out(self, policy: Any, request: EvalRequest) -> tuple[dict[str, float], np.ndarray]:
        """Greedy rewrites decoded as served, scored by the one held-out path (`casi eval`'s):
        its metrics, and each query's pool recall of query + rewrites."""
        result = evaluate_request(policy.model, policy.tokenizer, request)
        return result.metrics, np.array([row["pool"][2] for row in result.per_query])

    def decode(self, policy: Any, qids: list[str], texts: list[str], g: int, temperature: float | None,
               seed: int = 0) -> list[list[list[str]]]:  # fmt: skip
        """Each query's G rewrite sets: greedy with the guard (``temperature`` None, G = 1), or
        sampled, a string of repeats played as an empty action."""
        contexts = self.feedback.contexts(texts, WORDS, M)
        out: list[list[list[str]]] = []
        chunk = 25 if temperature is None else 10
        for b in range(0, len(texts), chunk):
            config = (SamplerConfig(do_sample=False, precision="float32") if temperature is None
                      else SamplerConfig(temperature=temperature, seed=seed + b, precision="float32"))  # fmt: skip
            rollouts = sample_rollouts(
                policy.model, policy.tokenizer, texts[b : b + chunk], g, M, config,
                query_ids=qids[b : b + chunk], prompt_style="feedback", format="constrained",
                line_cap=LINE_CAP, contexts=contexts[b : b + chunk],
                refuse_degenerate=temperature is None,
            )  # fmt: skip
            sets = [
                ["" if degenerate(a.text) else a.text for a in r.parsed.actions] for r in rollouts
            ]
            out += [sets[i : i + g] for i in range(0, len(sets), g)]
        return out


def top_shapley(sets: Sequence[Sequence[str]], phi: np.ndarray) -> list[str]:
    """The m distinct non-empty actions with the highest Shapley credit across a query's samples."""
    ranked = sorted(((phi[s, j], a) for s, row in enumerate(sets) for j, a in enumerate(row)),
                    key=lambda x: -x[0])  # fmt: skip
    chosen: list[str] = []
    for _, action in ranked:
        if action and action not in chosen:
            chosen.append(action)
    return chosen[:M]


def headroom(
    game: Game, policy: Any, request: EvalRequest, g: int, temperature: float
) -> dict[str, Any]:
    t0 = time.perf_counter()
    qids, texts = [q for q, _ in request.queries], [t for _, t in request.queries]
    metrics, v_greedy = game.held_out(policy, request)
    samples = game.decode(policy, qids, texts, g, temperature)
    res = game.samples_credit(qids, texts, samples)
    values = res.values[:, -1].numpy().reshape(len(qids), g)
    phi = res.phi.numpy().reshape(len(qids), g, M)
    v_top = game.value(qids, texts, [top_shapley(s, p) for s, p in zip(samples, phi, strict=True)])
    best = values.max(1)
    return {
        "temperature": temperature, "samples": g,
        "greedy": round(metrics["combined_pool_recall"], 4),
        "keyword_expansion": round(metrics["prf_pool_recall"], 4),
        "sample_mean": round(float(values.mean()), 4),
        "best_of_g": round(float(best.mean()), 4),
        "shapley_top_m": round(float(v_top.mean()), 4),
        "queries_best_above_greedy": int((best > v_greedy + MARGIN).sum()),
        "distinct_sets_per_query": round(float(np.mean([len({tuple(s) for s in row}) for row in samples])), 2),
        "seconds": round(time.perf_counter() - t0, 1),
    }  # fmt: skip


def expert_iteration(
    game: Game, policy: Any, args: argparse.Namespace, held: EvalRequest
) -> dict[str, Any]:
    dataset = game.retrieval.dataset
    qids = train_val_ids(dataset)[0][START_QUERIES : START_QUERIES + args.expert_iteration]
    texts = [dataset.queries[q] for q in qids]
    t0 = time.perf_counter()
    greedy = [s[0] for s in game.decode(policy, qids, texts, 1, None)]
    samples = game.decode(policy, qids, texts, args.samples, args.temperature, seed=START_QUERIES)
    v_greedy = game.value(qids, texts, greedy)
    values = game.samples_credit(qids, texts, samples).values[:, -1].numpy()
    values = values.reshape(len(qids), -1)
    out: dict[str, Any] = {
        "train_queries": len(qids), "train_greedy": round(float(v_greedy.mean()), 4),
        "train_sample_mean": round(float(values.mean()), 4),
        "train_best_of_g": round(float(values.max(1).mean()), 4),
        "sample_seconds": round(time.perf_counter() - t0, 1), "runs": [],
    }  # fmt: skip
    contexts = game.feedback.contexts(texts, WORDS, M)
    start = {k: v.clone() for k, v in policy.model.state_dict().items()}
    for select in args.select:
        targets = []
        for i, row in enumerate(samples):
            whole = [s for s in range(len(row)) if all(row[s])] or [0]
            b = max(whole, key=lambda s: values[i, s])
            keep = select == "best" or values[i, b] > v_greedy[i] + MARGIN
            targets.append(row[b] if keep and all(row[b]) else greedy[i])
        examples = [WarmstartExample(query=t, n_actions=M, answer=numbered(a), context=c)
                    for t, c, a in zip(texts, contexts, targets, strict=True)]  # fmt: skip
        for lr in args.lr:
            for epochs in args.epochs:
                policy.model.load_state_dict(start)
                t1 = time.perf_counter()
                torch.manual_seed(0)
                sft = warmstart(policy.model, policy.tokenizer, examples, epochs=epochs, lr=lr,
                                batch_size=8, seed=0, prompt_style="feedback")  # fmt: skip
                tuned = game.held_out(policy, held)[0]["combined_pool_recall"]
                out["runs"].append({
                    "select": select, "lr": lr, "epochs": epochs, "sft_steps": sft.steps,
                    "loss_first_last": [round(sft.losses[0], 4), round(sft.losses[-1], 4)],
                    "targets_value": round(float(game.value(qids, texts, targets).mean()), 4),
                    "held_out": round(tuned, 4),
                    "seconds": round(time.perf_counter() - t1, 1),
                })  # fmt: skip
                print(json.dumps(out["runs"][-1]), flush=True)
    policy.model.load_state_dict(start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policy", help="the warm start's folder (or a registered version)")
    parser.add_argument("--split", default="dev", choices=["dev", "val"])
    parser.add_argument("--queries", type=int, default=100, help="the first N of the split")
    parser.add_argument("--samples", type=int, default=8, help="G samples per query")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument(
        "--expert-iteration",
        type=int,
        default=0,
        metavar="N",
        help="TRAIN queries to sample and fine-tune on (0: headroom only)",
    )
    parser.add_argument(
        "--select", nargs="+", default=["best", "margin"], choices=["best", "margin"]
    )
    parser.add_argument("--lr", type=float, nargs="+", default=[5e-5])
    parser.add_argument("--epochs", type=int, nargs="+", default=[1])
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()

    settings = Settings()
    configure_threads(settings)
    retrieval = build_retrieval(settings)
    game = Game(retrieval, build_scorer("replay", settings, retrieval), settings)
    policy = load_policy_ref(args.policy, settings.var_dir)
    rollout = RolloutConfig(n_actions=M, line_cap=LINE_CAP, prompt="feedback", feedback_words=WORDS)
    request = held_out_request(retrieval, rollout, args.split, args.queries, refuse_degenerate=True)
    result: dict[str, Any] = {
        "policy": policy.version, "dataset": str(settings.dataset), "split": args.split,
        "queries": len(request.queries), "m": M, "retrieval_k": settings.retrieval_k,
        "threads": settings.threads,
        "headroom": headroom(game, policy, request, args.samples, args.temperature),
    }  # fmt: skip
    print(json.dumps(result, indent=1), flush=True)
    if args.expert_iteration:
        result["expert_iteration"] = expert_iteration(game, policy, args, request)
        print(json.dumps(result["expert_iteration"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
