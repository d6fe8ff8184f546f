"""One training step, phase by phase: the lean step vs the first trainer's path, in one run.

    .venv/bin/python benchmarks/bench_train.py [--policy VERSION|FOLDER] [--rounds 2]

Both paths take a step of 8 TRAIN queries × 4 samples × m = 4 on the same policy (default:
the newest registered warm-start, else SmolLM2), the casi preset, the replay evaluator, the
500-document slice index. Each path runs one untimed warm-up step (oneDNN builds its kernels
on the first call), then ``--rounds`` timed steps; the table shows the median of each phase.

- previous: float32 sampler, float32 training forward, the one-shot prompt, a separate no-grad
  π_old pass before the loss pass (what `casi step` did before the Trainer);
- lean: bfloat16 sampler and bfloat16-autocast training forward (fp32 master weights; TIS
  corrects the sampler mismatch, reported), the short prompt, π_old = the loss forward itself.

Prompt prefill is shared by the G samples of a query in both (the sampler always does it).
Targets (2 CPU cores): lean step ≤ 20 s; actions + credit ≤ 10 % of the step.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PHASES = (
    ("generate", "time/generate_s"),
    ("actions (cached retrieval)", "time/credit_actions_s"),
    ("credit (coalitions, scoring, Shapley)", "time/credit_credit_s"),
    ("π_old / reference passes", None),
    ("loss + backward", "time/loss_backward_s"),
    ("optimizer", "time/optimizer_s"),
    ("MIPU validation", "time/mipu_s"),
    ("whole step", "time/step_s"),
)


def _phase(m: dict[str, float], key: str | None) -> float:
    if key is None:
        return m.get("time/old_pass_s", 0.0) + m.get("time/ref_pass_s", 0.0)
    return m.get(key, 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--policy", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--n-actions", type=int, default=4)
    ap.add_argument("--max-docs", type=int, default=500)
    ap.add_argument(
        "--paths", nargs="+", default=["previous", "lean"], choices=["previous", "lean"]
    )
    args = ap.parse_args()

    from sqlalchemy import select

    from app.cli.train import open_database
    from app.db import session_scope
    from app.db.models import PolicyVersion
    from app.runtime import build_retrieval, build_scorer
    from app.services.policy_loader import load_policy_ref
    from app.services.splits import train_val_ids
    from app.settings import get_settings
    from policy.train_config import TrainConfig
    from policy.trainer import Trainer

    settings = get_settings()
    factory = open_database(settings)
    ref = args.policy
    if ref is None:
        with session_scope(factory) as s:
            row = s.scalars(
                select(PolicyVersion)
                .where(PolicyVersion.kind == "warmstart")
                .order_by(PolicyVersion.id.desc())
            ).first()
            ref = row.version if row is not None else None
    r = build_retrieval(settings, max_docs=args.max_docs)
    scorer = build_scorer("replay", settings, r, split="train")
    pol = load_policy_ref(ref, settings.var_dir, factory)
    start = {k: v.clone() for k, v in pol.model.state_dict().items()}
    ids = train_val_ids(r.dataset)[0]
    paths = {
        "previous": dict(precision="float32", train_precision="float32", prompt="oneshot"),
        "lean": dict(precision="bfloat16", train_precision="bfloat16", prompt="short"),
    }
    shape = dict(
        steps=100,
        queries=args.queries,
        samples=args.samples,
        n_actions=args.n_actions,
        max_new_tokens=64,
        lr=1e-6,
    )
    results: dict[str, list[dict[str, float]]] = {}
    paths = {k: v for k, v in paths.items() if k in args.paths}
    for name, kw in paths.items():
        pol.model.load_state_dict(start)
        cfg = TrainConfig.from_preset("casi", **shape, **kw)
        trainer = Trainer(pol.model, pol.tokenizer, cfg, r.executor, scorer, version=pol.version)
        if name == "previous":
            trainer.spec = dataclasses.replace(trainer.spec, recompute_old=True)
        runs = []
        for step in range(args.rounds + 1):
            batch = ids[step * args.queries : (step + 1) * args.queries]
            res = trainer.train_step([(q, r.dataset.queries[q]) for q in batch])
            if step > 0:  # step 0 warms the kernels and the action cache of later rounds' queries
                runs.append(res.metrics)
            print(f"{name} step {step}: {res.metrics['time/step_s']:.1f}s", flush=True)
        results[name] = runs
    pol.model.load_state_dict(start)

    def med(name: str, key: str | None) -> float:
        return statistics.median(_phase(m, key) for m in results[name])

    print(f"\none step: {args.queries} queries × {args.samples} samples × m={args.n_actions}, policy {pol.version} "
          f"({pol.name}), median of {args.rounds}, {os.cpu_count()} CPU threads available")  # fmt: skip
    print(f"{'phase':40s} {'previous s':>11s} {'lean s':>8s} {'ratio':>7s}")
    if len(paths) < 2:
        for label, key in PHASES:
            print(f"{label:40s} " + " ".join(f"{med(n, key):8.2f}" for n in paths))
    for label, key in PHASES if len(paths) == 2 else ():
        a, b = med("previous", key), med("lean", key)
        ratio = f"{a / b:7.2f}×" if b > 0.01 else "      —"
        print(f"{label:40s} {a:11.2f} {b:8.2f} {ratio}")
    for name in paths:
        share = (med(name, "time/credit_actions_s") + med(name, "time/credit_credit_s")) / med(
            name, "time/step_s"
        )
        mm = statistics.median(m.get("mismatch/kl_k3", 0.0) for m in results[name])
        ab = statistics.median(m.get("mismatch/abs_log_ratio_mean", 0.0) for m in results[name])
        tok = statistics.median(m["response_tokens_mean"] for m in results[name])
        ok = statistics.median(m["format_ok_fraction"] for m in results[name])
        print(f"{name:9s}: actions + credit = {share:.1%} of the step; sampler mismatch KL(μ‖π_old) k3 {mm:.2e}, "
              f"mean |log π_old − log μ| {ab:.3f}; {tok:.0f} response tokens; well-formed {ok:.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
