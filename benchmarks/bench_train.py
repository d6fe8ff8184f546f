"""One training step, phase by phase, for each way of taking it — side by side in one run.

    .venv/bin/python benchmarks/bench_train.py [--policy VERSION|FOLDER] [--rounds 2]
        [--configs previous lean constrained lora top4 constrained-m8]

Every configuration takes steps of 8 TRAIN queries × 4 samples × m = 4 (m = 8 where named) on
the same policy (default: the newest registered warm start, else SmolLM2), the casi preset, the
replay evaluator, the 500-document slice index. Each configuration runs in its OWN process (so
its peak resident memory is its own), one untimed warm-up step (oneDNN builds its kernels on
the first call, the action cache fills), then ``--rounds`` timed steps; the table shows the
median of each phase, the peak RSS, the sampler mismatch and the well-formed fraction.

- previous: float32 sampler and forward, one-shot prompt, a separate π_old pass, free format;
- lean: bfloat16 sampler + bfloat16-autocast forward where the CPU multiplies bf16 natively
  (AVX512-BF16 / AMX; float32 elsewhere: emulated bf16 is ~65× slower), short prompt, π_old =
  the loss forward, free format with a fixed 64-token cap (the step the credit experiment used);
- constrained: lean + format-constrained decoding (the derived cap; every rollout m lines);
- lora: constrained + LoRA (r 16 on every attention / MLP projection; base frozen);
- top4: constrained + only the top 4 of 30 layers train (the backward stops there), and the
  26 frozen layers below run once, in the sampler (the training forward starts from the hidden
  state it recorded at layer 26); top4-recompute: the same, recomputing the frozen layers;
- *-m8: the same at m = 8 (256 coalitions per rollout: the credit's share of the step);
- f32-full, f32-top4: the credit experiment's step (float32 sampler and forward on every CPU,
  short prompt, constrained, full parameters or the top 4 layers on the trunk) with the lean
  step's levers (a prompt shared by the G samples and trimmed pads in the forward; a
  preallocated KV cache, finished rows leaving the batch, the common prompt prefix
  prefilled once and the sampler's weights prepacked in decoding);
  f32-full-previous, f32-top4-previous: the same with every lever
  off (the previous code path, kept behind module switches for this benchmark);
  f32-full-unpacked, f32-top4-unpacked: every lever on but the prepacked sampler weights
  (`policy.precision.PACK_LINEAR`), the sampler multiplying with `F.linear`.

``--eval-claims N`` also times a greedy float32 held-out evaluation of the first N TEST claims
in each configuration's process (the lean levers apply to it too).

Targets (2 CPU cores, warm-started policy, m = 4): median step ≤ 9 s; well-formed 100 %.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

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
    ("whole step", "time/step_s"),
)
LEAN = dict(precision="auto", train_precision="auto", prompt="short")  # bf16 where native
F32 = dict(precision="float32", train_precision="float32", prompt="short")
LEVERS = {  # module switches of the lean step: on (the default) or off (the previous path)
    "policy.forward": ("SHARE_PROMPT", "TRIM_PADS"),
    "policy.sampler": ("ROOMY_CACHE", "SHARE_PREFIX", "LEAVE_EVERY"),
    "policy.precision": ("PACK_LINEAR",),
}
CONFIGS: dict[str, dict[str, Any]] = {
    "previous": dict(
        precision="float32", train_precision="float32", prompt="oneshot", format="free",
        max_new_tokens=64, recompute_old=True,
    ),
    "lean": dict(LEAN, format="free", max_new_tokens=64),
    "constrained": dict(LEAN),
    "lora": dict(LEAN, params="lora"),
    "top4": dict(LEAN, params="top", top_layers=4),
    "top4-recompute": dict(LEAN, params="top", top_layers=4, reuse_trunk=False),
    "constrained-m8": dict(LEAN, n_actions=8),
    "lora-m8": dict(LEAN, params="lora", n_actions=8),
    "top4-m8": dict(LEAN, params="top", top_layers=4, n_actions=8),
    "f32-full-previous": dict(F32, previous=True),
    "f32-full": dict(F32),
    "f32-top4-previous": dict(F32, params="top", top_layers=4, previous=True),
    "f32-top4": dict(F32, params="top", top_layers=4),
    "f32-full-unpacked": dict(F32, unpacked=True),
    "f32-top4-unpacked": dict(F32, params="top", top_layers=4, unpacked=True),
}  # fmt: skip


def previous_path() -> None:
    """Every lean lever off: the code path before them."""
    import importlib

    for module, names in LEVERS.items():
        mod = importlib.import_module(module)
        for name in names:
            setattr(mod, name, type(getattr(mod, name))(0))


def _phase(m: dict[str, float], key: str | None) -> float:
    if key is None:
        return m.get("time/old_pass_s", 0.0) + m.get("time/ref_pass_s", 0.0)
    return m.get(key, 0.0)


def run_one(name: str, args: argparse.Namespace, out: Path) -> None:
    """Steps of configuration ``name`` in this process; metrics + peak RSS to ``out`` (JSON)."""
    import dataclasses

    from sqlalchemy import select

    from app.cli.common import open_database
    from app.db import session_scope
    from app.db.models import PolicyVersion
    from app.runtime import build_retrieval, build_scorer
    from app.settings import get_settings
    from app.training.policy_loader import load_policy_ref
    from app.training.splits import train_val_ids
    from policy.params import trainable_count
    from policy.precision import resolve_precision
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
    ids = train_val_ids(r.dataset)[0]
    kw = dict(CONFIGS[name])
    recompute = kw.pop("recompute_old", False)
    if kw.pop("previous", False):
        previous_path()
    if kw.pop("unpacked", False):  # only the newest lever off: F.linear in the sampler
        import policy.precision

        policy.precision.PACK_LINEAR = False
    for key in ("precision", "train_precision"):  # auto: bf16 only where it is native
        kw[key] = resolve_precision(kw[key], settings.resolved_device())
    shape = dict(steps=100, queries=args.queries, samples=args.samples, n_actions=args.n_actions)
    cfg = TrainConfig.from_preset("casi", **{**shape, "lr": 1e-6, **kw})
    if recompute:  # not a user option: the first trainer's separate π_old pass
        cfg = dataclasses.replace(cfg, update=dataclasses.replace(cfg.update, recompute_old=True))
    trainer = Trainer(pol.model, pol.tokenizer, cfg, r.executor, scorer, version=pol.version)
    runs = []
    for step in range(args.rounds + 1):
        batch = ids[step * args.queries : (step + 1) * args.queries]
        res = trainer.train_step([(q, r.dataset.queries[q]) for q in batch])
        if step > 0:  # step 0 warms the kernels and the action cache
            runs.append(res.metrics)
        print(f"  {name} step {step}: {res.metrics['time/step_s']:.1f}s", flush=True)
    trained, total = trainable_count(trainer.model)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    eval_s = None
    if args.eval_claims:
        eval_s = _time_evaluation(trainer.model, pol.tokenizer, r, cfg, args.eval_claims)
        print(f"  {name} evaluation of {args.eval_claims} TEST claims: {eval_s:.1f}s", flush=True)
    info = {"policy": f"{pol.version} ({pol.name})", "m": cfg.n_actions, "trainable": trained,
            "total": total, "peak_rss_mb": peak_mb, "precision": cfg.sampler.precision,
            "train_precision": cfg.update.train_precision, "eval_s": eval_s}  # fmt: skip
    out.write_text(json.dumps({"runs": runs, "info": info}))


def _time_evaluation(model: Any, tokenizer: Any, r: Any, cfg: Any, n: int) -> float:
    """Seconds of a greedy float32 held-out evaluation of the first ``n`` TEST claims."""
    import time

    from app.training.evaluate import held_out_request
    from policy.evaluate import evaluate_policy

    request = held_out_request(r, cfg.rollout, "test", n)
    t0 = time.perf_counter()
    evaluate_policy(
        model, tokenizer, request.queries, request.executor, request.ndcg, request.recall,
        request.config, recall_executor=request.recall_executor,
    )  # fmt: skip
    return time.perf_counter() - t0


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
    ap.add_argument("--eval-claims", type=int, default=0)
    ap.add_argument(
        "--configs",
        nargs="+",
        default=["previous", "lean", "constrained", "lora", "top4", "top4-m8"],
        choices=list(CONFIGS),
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child process: run this configuration
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        run_one(args.one, args, Path(args.out))
        return

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            out = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, __file__, "--one", name, "--out", str(out),
                   "--rounds", str(args.rounds), "--queries", str(args.queries),
                   "--samples", str(args.samples), "--n-actions", str(args.n_actions),
                   "--max-docs", str(args.max_docs), "--eval-claims", str(args.eval_claims)]  # fmt: skip
            if args.policy:
                cmd += ["--policy", args.policy]
            print(f"{name} …", flush=True)
            subprocess.run(cmd, check=True)
            results[name] = json.loads(out.read_text())
    _print(results, args)


def _print(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    def med(name: str, key: str | None) -> float:
        return statistics.median(_phase(m, key) for m in results[name]["runs"])

    def stat(name: str, key: str) -> float:
        return statistics.median(m.get(key, 0.0) for m in results[name]["runs"])

    names = list(results)
    first = results[names[0]]["info"]
    print(f"\none step: {args.queries} queries × {args.samples} samples × m={args.n_actions} (m=8 in *-m8), "
          f"policy {first['policy']}, median of {args.rounds} steps, {os.cpu_count()} CPU threads")  # fmt: skip
    print(f"{'phase (s)':40s} " + " ".join(f"{n:>14s}" for n in names))
    for label, key in PHASES:
        print(f"{label:40s} " + " ".join(f"{med(n, key):14.2f}" for n in names))
    base = med(names[0], "time/step_s")
    rows = {
        f"speed-up over {names[0]}": [f"{base / med(n, 'time/step_s'):13.2f}×" for n in names],
        "actions + credit share": [
            f"{(med(n, 'time/credit_actions_s') + med(n, 'time/credit_credit_s')) / med(n, 'time/step_s'):14.1%}"
            for n in names
        ],
        "peak RSS (MB)": [f"{results[n]['info']['peak_rss_mb']:14.0f}" for n in names],
        "sampler / forward precision": [
            f"{results[n]['info']['precision'][:4] + '/' + results[n]['info']['train_precision'][:4]:>14s}"
            for n in names
        ],
        "trainable parameters": [f"{results[n]['info']['trainable'] / 1e6:13.2f}M" for n in names],
        "response tokens (mean)": [f"{stat(n, 'response_tokens_mean'):14.0f}" for n in names],
        "well-formed": [f"{stat(n, 'format_ok_fraction'):14.0%}" for n in names],
        "duplicate rewrites": [f"{stat(n, 'duplicate_rate'):14.1%}" for n in names],
        "|log π_old − log μ| per kept token": [
            f"{stat(n, 'mismatch/abs_log_ratio_mean'):14.4f}" for n in names
        ],
    }  # fmt: skip
    for label, key in (("generate", "time/generate_s"), ("loss + backward", "time/loss_backward_s"),
                       ("whole step", "time/step_s")):  # fmt: skip
        rows[f"{label}: × over its -previous path"] = [
            f"{med(n + '-previous', key) / med(n, key):13.2f}×"
            if n + "-previous" in results
            else f"{'—':>14s}"
            for n in names
        ]
    if args.eval_claims:
        first_eval = results[names[0]]["info"]["eval_s"]
        rows[f"evaluation, {args.eval_claims} TEST claims (s)"] = [
            f"{results[n]['info']['eval_s']:14.1f}" for n in names
        ]
        rows[f"evaluation speed-up over {names[0]}"] = [
            f"{first_eval / results[n]['info']['eval_s']:13.2f}×" for n in names
        ]
    for label, cells in rows.items():
        print(f"{label:40s} " + " ".join(cells))


if __name__ == "__main__":
    main()
