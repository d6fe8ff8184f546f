"""The cost of CASI's credit inside a TRL GRPO step, side by side in one run (tiny model, CPU).

    python benchmarks/bench_trl.py [--queries 4 --samples 4 --m 4 --steps 4 --max-docs 300]

Three `GRPOTrainer` runs on the same tiny policy (built from a config, taught the numbered format
in a few seconds), the same SciFact train queries, the same seed and TRL settings:

(a) plain GRPO, format reward — the share of the m numbered lines the completion has (no
    retrieval): the cheapest step TRL can take;
(b) plain GRPO, CASI's reward v(N) — every completion's actions through CASI's action cache and
    scorer, TRL's own per-completion advantage;
(c) `CasiGRPOTrainer` — the same credit game, and CASI's per-token advantages (credit, shaping).

Reported: the median TRL ``step_time`` over the steps after the first (the first fills the action
cache), each run's ratio to (a) and to (b), and the seconds of CASI's own work per step in (c).
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
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from casi_integrations.credit import CasiCredit  # noqa: E402
from casi_integrations.trl import CasiGRPOTrainer, casi_dataset  # noqa: E402
from evaluator.corpus import load_dataset  # noqa: E402
from policy.model import build_tiny_policy, load_tokenizer  # noqa: E402
from policy.warmstart import WarmstartExample, keywords, warmstart  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def taught_policy(tok: Any, queries: list[str], m: int) -> torch.nn.Module:
    """The tiny model, taught to answer each query with m numbered rewrites (seconds)."""
    junk = ["zebra", "cell biology", "clinical study", "risk factors"]
    examples = [
        WarmstartExample(q, m, "\n".join(f"{j + 1}. {([keywords(q)] + junk)[j]}" for j in range(m)))
        for q in queries
    ]
    model = build_tiny_policy(tok, seed=0)
    warmstart(model, tok, examples, epochs=80, lr=1e-2, batch_size=len(queries))
    return model


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

    def casi_value(
        completion_ids: list[list[int]], query_id: list[str], query: list[str], **_: Any
    ) -> list[float]:
        return casi.credit(casi.completions(completion_ids, query_id, query)).value_full.tolist()

    common = dict(model=copy.deepcopy(model), args=cfg, train_dataset=ds, processing_class=tok)
    if kind == "casi":
        trainer: Any = CasiGRPOTrainer(casi=casi, **common)
        spent: list[float] = []
        reward, apply = trainer.casi_reward, trainer.casi_apply

        def timed_reward(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = reward(*a, **kw)
            spent.append(time.perf_counter() - t0)
            return out

        def timed_apply(out: Any) -> Any:
            t0 = time.perf_counter()
            res = apply(out)
            spent[-1] += time.perf_counter() - t0
            return res

        trainer.reward_funcs[0], trainer.casi_apply = timed_reward, timed_apply
    else:
        trainer = GRPOTrainer(
            reward_funcs=[format_reward if kind == "format" else casi_value], **common
        )
        spent = []
    trainer.train()
    steps = [h["step_time"] for h in trainer.state.log_history if "step_time" in h][1:]
    return {
        "step_s": statistics.median(steps),
        "casi_s": statistics.median(spent[1:]) if spent else 0.0,
    }


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
    args = p.parse_args()
    torch.set_num_threads(2)
    converted = args.var / "models" / "smollm2-135m-instruct" / "tokenizer_config.json"
    tok = load_tokenizer(args.var if converted.exists() else None)
    beir = load_dataset(ROOT / "data" / "scifact", max_docs=args.max_docs)
    ds = casi_dataset(beir, "train", tok, args.m, limit=args.queries)
    model = taught_policy(tok, list(ds["query"]), args.m)
    casi = CasiCredit.from_beir(ROOT / "data" / "scifact", tok, n_actions=args.m, var_dir=args.var,
                                max_docs=args.max_docs)  # fmt: skip
    print(f"TRL GRPO step, tiny model on CPU: B={args.queries} queries x G={args.samples}, m={args.m}, "
          f"{args.steps} steps (median of steps 2..), {len(beir.documents)} documents")  # fmt: skip
    rows = {kind: run(kind, model, tok, casi, ds, args) for kind in ("format", "value", "casi")}
    base, value = rows["format"]["step_s"], rows["value"]["step_s"]
    names = {"format": "(a) plain GRPO, format reward", "value": "(b) plain GRPO, CASI v(N) reward",
             "casi": "(c) CasiGRPOTrainer (per-token credit)"}  # fmt: skip
    print(f"{'run':42s} {'step s':>8s} {'vs (a)':>8s} {'vs (b)':>8s} {'CASI s':>8s}")
    for kind, r in rows.items():
        print(f"{names[kind]:42s} {r['step_s']:8.3f} {r['step_s'] / base:7.2f}x "
              f"{r['step_s'] / value:7.2f}x {r['casi_s']:8.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
