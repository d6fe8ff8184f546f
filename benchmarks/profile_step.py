"""Where a training step's time goes: the sampler's decode and the loss forward + backward,
per op, with the matmul GFLOP/s the profiler counts.

    .venv/bin/python benchmarks/profile_step.py [--policy VERSION|FOLDER] [--threads 2]
        [--queries 8] [--samples 4] [--micro 8] [--rows 20]

Generation: ``queries × samples`` constrained rollouts (m = 4, temperature 0.7, short prompt,
float32), once untimed (kernels), then once timed with the model forward timed apart from the
rest of the decode loop (log-softmax, format bias, draw, top-K, automaton), then once under
``torch.profiler``. Training: the teacher-forced forward + backward of one micro-batch of
``--micro`` of those rollouts (full parameters, float32), timed, then profiled.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def table(prof: Any, wall: float, title: str, rows: int) -> None:
    events = prof.key_averages()
    flops = sum(e.flops for e in events)
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    print(f"\n== {title}: {wall:.2f} s wall unprofiled; {flops / 1e9:.1f} GFLOP counted "
          f"({flops / 1e9 / wall:.1f} GFLOP/s of that wall); profiled self CPU {total:.2f} s")  # fmt: skip
    print(f"{'op':44s} {'self s':>8s} {'share':>7s} {'calls':>7s} {'GFLOP/s':>8s}")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:rows]:
        s = e.self_cpu_time_total / 1e6
        rate = f"{e.flops / 1e9 / s:8.1f}" if e.flops and s else f"{'':8s}"
        print(f"{e.key[:44]:44s} {s:8.3f} {s / total:7.1%} {e.count:7d} {rate}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--policy", default="warmstart")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--rows", type=int, default=20)
    args = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    import policy.sampler as sampler
    from app.cli.common import open_database
    from app.settings import get_settings
    from app.training.policy_loader import load_policy_ref
    from app.training.splits import train_val_ids
    from evaluator.corpus import load_dataset
    from policy.forward import policy_forward
    from policy.rollout import collate, sample_rollouts
    from policy.sampler import SamplerConfig

    torch.set_num_threads(args.threads)
    settings = get_settings()
    pol = load_policy_ref(args.policy, settings.var_dir, open_database(settings))
    ds = load_dataset(settings.dataset, splits=("train",))
    ids = train_val_ids(ds)[0][: args.queries]
    queries = [ds.queries[q] for q in ids]
    cfg = SamplerConfig(temperature=0.7, seed=1)

    def run() -> list[Any]:
        return sample_rollouts(
            pol.model, pol.tokenizer, queries, args.samples, 4, cfg, policy_version="p",
            prompt_style="short", format="constrained",
        )  # fmt: skip

    run()  # kernels
    spent = [0.0, 0]
    step = sampler._step

    def timed_step(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        out = step(*a, **kw)
        spent[0] += time.perf_counter() - t
        spent[1] += 1
        return out

    sampler._step = timed_step  # type: ignore[assignment]
    t0 = time.perf_counter()
    rollouts = run()
    wall = time.perf_counter() - t0
    sampler._step = step  # type: ignore[assignment]
    lengths = [len(r.response_ids) for r in rollouts]
    prompt = [len(r.prompt_ids) for r in rollouts]
    print(f"{args.threads} threads; {len(rollouts)} rows, prompt {min(prompt)}-{max(prompt)} tokens, "
          f"response mean {sum(lengths) / len(lengths):.1f} max {max(lengths)}")  # fmt: skip
    print(f"generate {wall:.2f} s: model forward {spent[0]:.2f} s in {spent[1]} calls "
          f"({spent[0] / wall:.0%}), the rest of the loop {wall - spent[0]:.2f} s")  # fmt: skip
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        run()
    table(prof, wall, f"generate ({len(rollouts)} rows)", args.rows)

    batch = collate(rollouts[: args.micro], pad_token_id=pol.tokenizer.pad_token_id or 0)
    model = pol.model.train()

    def fwd_bwd() -> None:
        out = policy_forward(model, batch, 0.7)
        out.logp.sum().backward()
        model.zero_grad(set_to_none=True)

    fwd_bwd()
    t0 = time.perf_counter()
    fwd_bwd()
    wall = time.perf_counter() - t0
    print(f"\nloss forward + backward of {args.micro} rows, width {batch.input_ids.shape[1]} "
          f"(prompt {batch.prompt_width}, response {batch.response_ids.shape[1]}): {wall:.2f} s")  # fmt: skip
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        fwd_bwd()
    table(prof, wall, f"forward + backward ({args.micro} rows)", args.rows)


if __name__ == "__main__":
    main()
