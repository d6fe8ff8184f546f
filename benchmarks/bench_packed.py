"""The float32 sampler on prepacked weights (`policy.precision.PACK_LINEAR`) against `F.linear`,
side by side in one run, on the threads CASI_THREADS gives (default 2).

1. The decode step's matrix products at SmolLM2-135M's shapes (32 rows: 8 queries × 4
   samples), per call: `F.linear` on the plain weight vs `PackedLinear`; then their sum over one
   decode step (30 layers × 7 projections + the output head).
2. Rollouts of the credit experiment's shape (8 TRAIN-like claims × 4 samples × m = 4,
   constrained, temperature 0.7, float32, short prompt) and greedy rollouts of 32 claims (what a
   held-out evaluation decodes), plain and packed in alternating rounds: wall and CPU seconds,
   the share of identical responses, and |μ − π| per kept token against the teacher-forced
   float32 forward (`F.linear`) for each.

CPU seconds (`time.process_time`) are the fair measure when other processes share the cores;
wall seconds are the measure on free cores.

    .venv/bin/python benchmarks/bench_packed.py [--policy VERSION|FOLDER] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_rollout import CLAIMS, policy_folder  # noqa: E402  (the same claims)
from torch import nn  # noqa: E402

import policy.precision as precision  # noqa: E402
from policy.precision import PackedLinear, build_sampler_model  # noqa: E402

# (in, out, calls per decode step) of SmolLM2-135M: q/o, k/v, gate/up, down; the tied head
SHAPES = [(576, 576, 60), (576, 192, 60), (576, 1536, 60), (1536, 576, 30), (576, 49152, 1)]
ROWS = 32


def timed(fn: Callable[[], Any], calls: int) -> tuple[float, float]:
    """(wall, CPU) milliseconds per call of ``fn``, after one untimed call."""
    fn()
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - w0) / calls * 1e3, (time.process_time() - c0) / calls * 1e3


def matmuls(rounds: int) -> None:
    gen = torch.Generator().manual_seed(0)
    print(f"1. decode-step products, {ROWS} rows, float32, {torch.get_num_threads()} threads "
          f"(median of {rounds} rounds, ms per call)")  # fmt: skip
    print(f"{'in × out':>14} {'calls':>6} {'F.linear wall':>14} {'packed wall':>12} "
          f"{'F.linear CPU':>13} {'packed CPU':>11} {'× CPU':>6}")  # fmt: skip
    step = [0.0, 0.0, 0.0, 0.0]
    for fan_in, fan_out, per_step in SHAPES:
        lin = nn.Linear(fan_in, fan_out, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(fan_out, fan_in, generator=gen) * 0.04)
        packed, x = PackedLinear(lin), torch.randn(ROWS, fan_in, generator=gen)
        calls = max(3, int(2e8 / (fan_in * fan_out * ROWS)))
        weight = lin.weight.detach()
        plain, pack = [], []
        with torch.no_grad():
            for _ in range(rounds):  # alternating: the same load on both
                plain.append(timed(lambda x=x, w=weight: F.linear(x, w), calls))
                pack.append(timed(lambda x=x, p=packed: p(x), calls))
        pw, pc = (statistics.median(v) for v in zip(*plain, strict=True))
        kw, kc = (statistics.median(v) for v in zip(*pack, strict=True))
        for i, v in enumerate((pw, kw, pc, kc)):
            step[i] += v * per_step
        print(f"{fan_in:>6} × {fan_out:<6} {per_step:>6} {pw:>14.3f} {kw:>12.3f} {pc:>13.3f} "
              f"{kc:>11.3f} {pc / kc:>5.2f}×")  # fmt: skip
    print(f"{'one decode step':>21} {step[0]:>14.1f} {step[1]:>12.1f} {step[2]:>13.1f} "
          f"{step[3]:>11.1f} {step[2] / step[3]:>5.2f}×   (wall × {step[0] / step[1]:.2f})")  # fmt: skip


def rollouts(policy: str | None, rounds: int) -> None:
    from app.settings import get_settings
    from policy.forward import policy_forward
    from policy.model import load_policy
    from policy.rollout import collate, sample_rollouts
    from policy.sampler import SamplerConfig

    var_dir = Path(get_settings().var_dir)
    model, tok = load_policy(policy_folder(policy, var_dir), var_dir, progress=False)
    model.eval()
    samplers = {"plain": model, "packed": build_sampler_model(model, "float32", copy_weights=False)}
    assert precision.is_packed(samplers["packed"]), "oneDNN is not available in this torch"
    shapes = {
        "sampled 8 × 4 × m 4": (CLAIMS, 4, SamplerConfig(temperature=0.7, seed=3)),
        "greedy 32 claims": (CLAIMS * 4, 1, SamplerConfig(do_sample=False)),
    }
    print(f"\n2. rollouts, {getattr(model, 'name_or_path', '') or 'policy'}, float32, "
          f"{torch.get_num_threads()} threads (median of {rounds} rounds)")  # fmt: skip
    print(f"{'shape':>20} {'kernels':>8} {'wall s':>8} {'CPU s':>8} {'tokens':>7} "
          f"{'same':>6} {'max |μ−π|':>10} {'mean |μ−π|':>11}")  # fmt: skip
    for label, (claims, samples, cfg) in shapes.items():
        times: dict[str, list[tuple[float, float]]] = {"plain": [], "packed": []}
        outs: dict[str, Any] = {}
        for _ in range(rounds):
            for name, sampler in samplers.items():  # alternating: the same load on both
                w0, c0 = time.perf_counter(), time.process_time()
                with torch.no_grad():
                    outs[name] = sample_rollouts(
                        model, tok, claims, samples, 4, cfg, sampler_model=sampler,
                        prompt_style="short", format="constrained", line_cap=24,
                    )  # fmt: skip
                times[name].append((time.perf_counter() - w0, time.process_time() - c0))
        same = sum(
            a.response_ids == b.response_ids
            for a, b in zip(outs["plain"], outs["packed"], strict=True)
        ) / len(outs["plain"])
        for name in samplers:
            batch = collate(outs[name])
            with torch.no_grad():
                teacher = policy_forward(
                    model, batch, cfg.temperature if cfg.do_sample else 1.0
                ).logp
            gap = (teacher - batch.sampler_logp)[batch.response_mask].abs()
            wall, cpu = (statistics.median(v) for v in zip(*times[name], strict=True))
            print(f"{label:>20} {name:>8} {wall:>8.2f} {cpu:>8.2f} {int(batch.response_mask.sum()):>7} "
                  f"{same:>6.0%} {float(gap.max()):>10.2e} {float(gap.mean()):>11.2e}")  # fmt: skip
        (pw, pc), (kw, kc) = (
            [statistics.median(v) for v in zip(*times[n], strict=True)] for n in ("plain", "packed")
        )
        print(f"{label:>20} {'×':>8} {pw / kw:>7.2f}× {pc / kc:>7.2f}×")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--policy", default=None, help="a warm start's version or a model folder")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-rollouts", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("CASI_THREADS", "2")))
    flags = open("/proc/cpuinfo").read() if Path("/proc/cpuinfo").exists() else ""
    model_name = next(
        (ln.split(":", 1)[1].strip() for ln in flags.splitlines() if "model name" in ln), "?"
    )
    isa = "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "no AVX2")
    print(f"CPU: {model_name} ({isa}), torch {torch.__version__}, {time.strftime('%Y-%m-%d')}\n")
    matmuls(args.rounds)
    if not args.skip_rollouts:
        rollouts(args.policy, args.rounds)


if __name__ == "__main__":
    main()
