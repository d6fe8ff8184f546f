# mypy: disable-error-code="no-untyped-call"
# (torch.Tensor.backward is unannotated)
"""Forward + backward time of every loss-stack preset against plain PPO-clip, side by side.

Per-token inputs only (B = 64, T = 256, K = 20 sampler top-K; values for critic presets), as a
trainer hands them to the stack after the model forward. Each configuration is timed in
interleaved rounds (warmup, then the median of N repeats) so machine noise hits all alike.
Targets: casi ≤ 1.3× PPO-clip, every preset ≤ 2×.

    python benchmarks/bench_losses.py [--repeats 50] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from policy.losses import LossBatch, LossStack, StackConfig, available_presets, load_preset
from policy.losses.synthetic import synthetic_batch

TARGETS = {"casi": 1.3}
DEFAULT_TARGET = 2.0


def _fresh(batch: LossBatch) -> LossBatch:
    """Same data, new leaf tensors (so .grad does not accumulate across repeats)."""
    leaves = {
        name: getattr(batch, name).detach().clone().requires_grad_(True)
        for name in ("logp", "values", "entropy")
    }
    return LossBatch(**{**batch.__dict__, **leaves})


def _time_once(stack: LossStack, batch: LossBatch) -> float:
    b = _fresh(batch)
    start = time.perf_counter()
    loss, _ = stack(b)
    loss.backward()
    return time.perf_counter() - start


def run(repeats: int, warmup: int) -> list[tuple[str, float, float]]:
    """Rows (name, median ms, ratio to ppo_clip)."""
    batch = synthetic_batch(64, 256, 20, seed=0, drift=0.01)
    stacks = {"ppo_clip": LossStack(StackConfig(pg="ppo_clip"))}
    stacks.update({name: LossStack(load_preset(name)) for name in available_presets()})
    times: dict[str, list[float]] = {name: [] for name in stacks}
    for i in range(warmup + repeats):
        for name, stack in stacks.items():  # interleaved: noise hits every config alike
            dt = _time_once(stack, batch)
            if i >= warmup:
                times[name].append(dt)
    base = statistics.median(times["ppo_clip"])
    return [(n, 1e3 * statistics.median(t), statistics.median(t) / base) for n, t in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    rows = run(args.repeats, args.warmup)
    print(f"B=64 T=256 K=20, threads={args.threads}, median of {args.repeats} (fwd+bwd)")
    print(f"{'preset':<14}{'ms':>9}{'× ppo_clip':>12}{'target':>9}  ok")
    for name, ms, ratio in rows:
        target = 1.0 if name == "ppo_clip" else TARGETS.get(name, DEFAULT_TARGET)
        ok = "yes" if ratio <= target else "NO"
        print(f"{name:<14}{ms:>9.3f}{ratio:>12.2f}{target:>9.1f}  {ok}")


if __name__ == "__main__":
    main()
