"""Rollout throughput and train-inference mismatch per sampler precision, side by side.

For the default policy (SmolLM2-135M-Instruct; any local HF folder via --model) and each
sampler precision (float32, bfloat16, int8 = dynamic W8A8 quantization (CPU only),
int8_weight = weight-only int8; CUDA rows too when present), in one run:
  * sample tok/s  — generated tokens per second (KV-cached loop, seeded);
  * recompute tok/s — teacher-forced log-probs of the same response tokens with a model of
    that precision (the trainer-side cost if the trainer ran in that precision);
  * mismatch — mean |log π_old − log μ| over response tokens, π_old = the float32 model;
ratios are versus float32 on the same device. Small sizes by default (4 queries × 2 samples ×
48 tokens) so it finishes in a few minutes on 2 CPU cores.

    .venv/bin/python benchmarks/bench_rollout.py [--queries 4 --samples 2 --tokens 48]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from policy.forward import logprobs as recompute_logprobs  # noqa: E402
from policy.model import load_policy, policy_version  # noqa: E402
from policy.precision import PRECISIONS, build_sampler_model  # noqa: E402
from policy.rollout import Rollout, RolloutBatch, collate, sample_rollouts  # noqa: E402
from policy.sampler import SamplerConfig  # noqa: E402

WARMUP_TOKENS = 6  # same batch shape, few steps: first-call allocations stay out of the timings
CLAIMS = [
    "0-dimensional biomaterials show inductive properties.",
    "Vitamin D deficiency increases the risk of multiple sclerosis.",
    "ALDH1 expression is associated with poorer prognosis for breast cancer primary tumors.",
    "Aspirin inhibits the production of PGE2.",
    "Statins reduce the incidence of cardiovascular events in older adults.",
    "Exposure to fine particulate air pollution is linked to increased mortality.",
    "BRCA1 mutations increase the risk of ovarian cancer.",
    "Sleep deprivation impairs glucose tolerance.",
]


@dataclass
class Row:
    device: str
    precision: str
    sample_tps: float
    recompute_tps: float
    mismatch: float
    tokens: int
    stopped: float  # share of responses that ended with a stop token (not truncated)


def run_device(
    model: torch.nn.Module,
    tok: object,
    device: str,
    precisions: list[str],
    args: argparse.Namespace,
) -> list[Row]:
    """Interleaved rounds (order reversed every other round); the best time of each counts."""
    queries = CLAIMS[: args.queries]
    samplers = {}
    for p in precisions:
        sampler = build_sampler_model(model, p, copy_weights=True)
        samplers[p] = sampler if p == "int8" else sampler.to(device)  # torch int8: CPU only

    def sample(p: str, tokens: int, seed: int = 0) -> list[Rollout]:
        config = SamplerConfig(max_new_tokens=tokens, seed=seed, precision=p)
        return sample_rollouts(
            model,
            tok,
            queries,
            args.samples,
            4,
            config,
            policy_version="bench",
            sampler_model=samplers[p],
        )

    for p in precisions:  # same batch shape, few steps: first-call costs stay out of the timings
        recompute_logprobs(samplers[p], collate(sample(p, WARMUP_TOKENS, seed=1)))
    best_sample = dict.fromkeys(precisions, float("inf"))
    best_recompute = dict.fromkeys(precisions, float("inf"))
    batches: dict[str, RolloutBatch] = {}
    for round_index in range(args.rounds):
        for p in precisions if round_index % 2 == 0 else precisions[::-1]:
            start = time.perf_counter()
            rollouts = sample(p, args.tokens)
            best_sample[p] = min(best_sample[p], time.perf_counter() - start)
            batch = batches.setdefault(p, collate(rollouts))  # same seed: same rollouts each round
            start = time.perf_counter()
            recompute_logprobs(samplers[p], batch, micro_batch_size=args.micro_batch)
            seconds = time.perf_counter() - start
            best_recompute[p] = min(best_recompute[p], seconds)
    rows = []
    for p in precisions:
        batch = batches[p]
        logp_old = recompute_logprobs(
            model, batch, micro_batch_size=args.micro_batch
        )  # float32 π_old
        diff = (logp_old.cpu() - batch.sampler_logp)[batch.response_mask]
        tokens = int(batch.response_mask.sum())
        stopped = float((~batch.truncated).float().mean())
        rows.append(
            Row(
                device,
                p,
                tokens / best_sample[p],
                tokens / best_recompute[p],
                float(diff.abs().mean()),
                tokens,
                stopped,
            )
        )
    return rows


def print_table(rows: list[Row]) -> None:
    base = {r.device: r for r in rows if r.precision == "float32"}
    header = (
        f"{'device':6} {'precision':11} {'tokens':>6} {'sample tok/s':>12} {'x fp32':>6} "
        f"{'recompute tok/s':>15} {'x fp32':>6} {'mismatch':>9} {'stopped':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        b = base[r.device]
        print(
            f"{r.device:6} {r.precision:11} {r.tokens:6d} {r.sample_tps:12.1f} {r.sample_tps / b.sample_tps:6.2f} "
            f"{r.recompute_tps:15.1f} {r.recompute_tps / b.recompute_tps:6.2f} {r.mismatch:9.5f} {r.stopped:7.0%}"
        )
    print("mismatch = mean |log pi_old - log mu| over response tokens; pi_old = float32 model")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="local HF folder (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--var-dir", type=Path, default=ROOT / "var")
    parser.add_argument("--queries", type=int, default=4)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--rounds", type=int, default=2, help="interleaved timing rounds (best counts)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, tok = load_policy(args.model, args.var_dir)
    print(
        f"loaded policy {policy_version(model)} in {time.perf_counter() - start:.1f} s; "
        f"{args.queries} queries x {args.samples} samples x {args.tokens} tokens"
    )
    rows = run_device(model, tok, "cpu", list(PRECISIONS), args)
    if torch.cuda.is_available():
        gpu_model = model.to("cuda")
        rows += run_device(gpu_model, tok, "cuda", [p for p in PRECISIONS if p != "int8"], args)
    print_table(rows)


if __name__ == "__main__":
    main()
