"""The cost of CASI's credit inside a TRL GRPO step, side by side in one run (tiny model, CPU).

    python benchmarks/bench_trl.py [--queries 4 --samples 4 --m 4 --steps 4 --max-docs 300]
                                   [--warm-cache]

Three `GRPOTrainer` runs on the same tiny policy (built from a config, taught in a few seconds to
answer each query with m short numbered rewrites of its own: pairs of its keywords, so every
completion carries m real, distinct actions), the same SciFact
train queries, the same seed and TRL settings:

(a) plain GRPO, format reward — the share of the m numbered lines the completion has (no
    retrieval): the cheapest step TRL can take;
(b) plain GRPO, CASI's reward v(N) — every completion's actions through CASI's action cache and
    scorer, TRL's own per-completion advantage;
(c) `CasiGRPOTrainer` — the same credit game, and CASI's per-token advantages (credit, shaping).

The action cache is cold at every step: each reward call reads and writes the cache under keys of
its own (a salt per call, entries kept 10 minutes), so every action of the step is retrieved, the
cost of a job whose rewrites are new (``--warm-cache``: one cache for all steps, as before, where
the steps after the first mostly hit). Reported: the median TRL ``step_time`` over the steps after
the first, each run's ratio to (a) and to (b), the seconds of CASI's own work per step in (c),
the actions per completion and the cache misses per step in (b) and (c).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]  # noqa: E402

from casi_integrations.credit import CasiCredit  # noqa: E402
from casi_integrations.trl import CasiGRPOTrainer, casi_dataset  # noqa: E402
from evaluator.corpus import load_dataset  # noqa: E402
from evaluator.text import keywords  # noqa: E402
from policy.model import build_tiny_policy, load_tokenizer  # noqa: E402
from policy.warmstart import WarmstartExample, warmstart  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def taught_answer(query: str, m: int) -> str:
    """The answer the tiny model is taught for ``query``: m short numbered lines, all different —
    line j is the query's keywords j and j + 1 (then j + 2 and so on past the last keyword)."""
    words = keywords(query).split() or ["query", "terms"]
    words = words if len(words) > 1 else [*words, "study"]
    n = len(words)
    lines = [" ".join(words[(j + k) % n] for k in range(1 + 1 + j // n)) for j in range(m)]
    return "\n".join(f"{j + 1}. {line}" for j, line in enumerate(lines))


def taught_policy(tok: Any, queries: list[str], m: int) -> torch.nn.Module:
    """The tiny model, taught to answer each query with m numbered rewrites of its own (300 epochs,
    5 minutes on 2 shared cores): pairs of its keywords, so the m actions of a completion are real
    and distinct, and differ from query to query. Measured at m = 4, temperature 1.0: 3.8 lines
    per completion (80 epochs, as before: 0.2)."""
    examples = [WarmstartExample(q, m, taught_answer(q, m)) for q in queries]
    model = build_tiny_policy(tok, seed=0)
    warmstart(model, tok, examples, epochs=300, lr=1e-2, batch_size=len(queries))
    return model


def cold_cache(casi: CasiCredit) -> None:
    """Make the credit source's action cache cold at every call: each cache read (one per credit
    call: the executor reads a batch's actions at once) moves to keys of its own (a salt, entries
    kept 10 minutes), and the writes that follow it use the same keys, so all its actions miss
    and are retrieved. The cache object is shared by every copy of ``casi`` (the trainer's too)."""
    source: Any = casi.source
    cache = source.executor.cache
    key, get_many, reads = cache.key, cache.get_many, [0]

    def salted(normalized_text: str) -> str:
        return f"{key(normalized_text)}:bench-trl-{os.getpid()}-{reads[0]}"

    def fresh_read(texts: Any) -> Any:
        reads[0] += 1
        return get_many(texts)

    cache.key, cache.get_many, cache.ttl_s = salted, fresh_read, 600


def run(kind: str, model: Any, tok: Any, casi: CasiCredit, ds: Any, args: Any) -> dict[str, float]:
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, report_to="none", save_strategy="no",
        seed=0, per_device_train_batch_size=args.queries * args.samples,
        num_generations=args.samples, max_completion_length=16 * args.m, max_steps=args.steps,
        logging_steps=1, learning_rate=1e-4, beta=0.0, temperature=1.0, scale_rewards="group",
    )  # fmt: skip
    m = casi.n_actions

    def format_reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
        parsed = casi.completions(
            completion_ids, ["?"] * len(completion_ids), [""] * len(completion_ids)
        )
        return [len(c.actions) / m for c in parsed]

    seen: list[tuple[float, float]] = []  # per reward call: (actions per completion, misses)

    def casi_value(
        completion_ids: list[list[int]], query_id: list[str], query: list[str], **_: Any
    ) -> list[float]:
        parsed = casi.completions(completion_ids, query_id, query)
        credit = casi.credit(parsed)
        seen.append((statistics.mean(len(c.actions) for c in parsed), _misses(credit)))
        return credit.value_full.tolist()

    common = dict(model=copy.deepcopy(model), args=cfg, train_dataset=ds, processing_class=tok)
    if kind == "casi":
        trainer: Any = CasiGRPOTrainer(casi=casi, **common)
        spent: list[float] = []
        reward, apply = trainer.casi_reward, trainer.casi_apply

        def timed_reward(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = reward(*a, **kw)
            spent.append(time.perf_counter() - t0)
            parsed, credit = trainer._casi_pending
            seen.append((statistics.mean(len(c.actions) for c in parsed), _misses(credit)))
            return out

        def timed_apply(out: Any) -> Any:
            t0 = time.perf_counter()
            res = apply(out)
            spent[-1] += time.perf_counter() - t0
            return res

        trainer.reward_funcs[0], trainer.casi_apply = timed_reward, timed_apply
    else:
        reward_func: Any = format_reward if kind == "format" else casi_value
        trainer = GRPOTrainer(reward_funcs=[reward_func], **common)
        spent = []
    trainer.train()
    steps = [h["step_time"] for h in trainer.state.log_history if "step_time" in h][1:]
    return {
        "step_s": statistics.median(steps),
        "casi_s": statistics.median(spent[1:]) if spent else 0.0,
        "actions": statistics.mean(a for a, _ in seen[1:]) if seen[1:] else float("nan"),
        "misses": statistics.median(n for _, n in seen[1:]) if seen[1:] else float("nan"),
    }


def _misses(credit: Any) -> float:
    """Cache misses of one credit call (the executor's batch: unique actions retrieved)."""
    cache = getattr(credit, "cache", None) or {}
    return float(cache.get("misses", 0))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--queries", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--m", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--max-docs", type=int, default=300)
    p.add_argument("--var", type=Path, default=ROOT / "var")
    p.add_argument("--warm-cache", action="store_true", help="one action cache for all steps")
    args = p.parse_args()
    torch.set_num_threads(2)
    converted = args.var / "models" / "smollm2-135m-instruct" / "tokenizer_config.json"
    tok = load_tokenizer(args.var if converted.exists() else None)
    beir = load_dataset(ROOT / "data" / "scifact", max_docs=args.max_docs)
    ds = casi_dataset(beir, "train", tok, args.m, limit=args.queries)
    model = taught_policy(tok, list(ds["query"]), args.m)
    casi = CasiCredit.from_beir(ROOT / "data" / "scifact", tok, n_actions=args.m, var_dir=args.var,
                                max_docs=args.max_docs)  # fmt: skip
    if not args.warm_cache:
        cold_cache(casi)
    print(f"TRL GRPO step, tiny model on CPU: B={args.queries} queries x G={args.samples}, m={args.m}, "
          f"{args.steps} steps (median of steps 2..), {len(beir.documents)} documents, "
          f"{'warm' if args.warm_cache else 'cold'} action cache")  # fmt: skip
    rows = {kind: run(kind, model, tok, casi, ds, args) for kind in ("format", "value", "casi")}
    base, value = rows["format"]["step_s"], rows["value"]["step_s"]
    names = {"format": "(a) plain GRPO, format reward", "value": "(b) plain GRPO, CASI v(N) reward",
             "casi": "(c) CasiGRPOTrainer (per-token credit)"}  # fmt: skip
    print(f"{'run':42s} {'step s':>8s} {'vs (a)':>8s} {'vs (b)':>8s} {'CASI s':>8s} "
          f"{'actions':>8s} {'misses':>8s}")  # fmt: skip
    for kind, r in rows.items():
        print(f"{names[kind]:42s} {r['step_s']:8.3f} {r['step_s'] / base:7.2f}x "
              f"{r['step_s'] / value:7.2f}x {r['casi_s']:8.3f} {r['actions']:8.2f} "
              f"{r['misses']:8.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
