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

from policy.model import load_policy, policy_version  # noqa: E402
from policy.rollout import collate, recompute_logprobs, sample_rollouts  # noqa: E402
from policy.sampler import PRECISIONS, SamplerConfig, build_sampler_model  # noqa: E402

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
    ok_share: float


def measure(
    model: torch.nn.Module, tok: object, device: str, precision: str, args: argparse.Namespace
) -> Row:
    sampler = build_sampler_model(model, precision, copy_weights=True)
    if precision != "int8":  # torch dynamic quantization runs on CPU only
        sampler = sampler.to(device)
    config = SamplerConfig(max_new_tokens=args.tokens, seed=0, precision=precision)
    queries = CLAIMS[: args.queries]
    warm = SamplerConfig(max_new_tokens=WARMUP_TOKENS, seed=1, precision=precision)
    warm_rollouts = sample_rollouts(
        model, tok, queries, args.samples, 4, warm, policy_version="warmup", sampler_model=sampler
    )
    recompute_logprobs(sampler, collate(warm_rollouts), micro_batch_size=args.micro_batch)
    start = time.perf_counter()
    rollouts = sample_rollouts(
        model, tok, queries, args.samples, 4, config, policy_version="bench", sampler_model=sampler
    )
    sample_s = time.perf_counter() - start
    batch = collate(rollouts)
    tokens = int(batch.response_mask.sum())
    start = time.perf_counter()
    recompute_logprobs(sampler, batch, micro_batch_size=args.micro_batch)
    recompute_s = time.perf_counter() - start
    logp_old = recompute_logprobs(model, batch, micro_batch_size=args.micro_batch)  # float32 π_old
    diff = (logp_old.cpu() - batch.sampler_logp)[batch.response_mask]
    ok = sum(r.status == "ok" for r in rollouts) / len(rollouts)
    return Row(
        device,
        precision,
        tokens / sample_s,
        tokens / recompute_s,
        float(diff.abs().mean()),
        tokens,
        ok,
    )


def print_table(rows: list[Row]) -> None:
    base = {r.device: r for r in rows if r.precision == "float32"}
    header = (
        f"{'device':6} {'precision':9} {'tokens':>6} {'sample tok/s':>12} {'x fp32':>6} "
        f"{'recompute tok/s':>15} {'x fp32':>6} {'mismatch':>9} {'ok fmt':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        b = base[r.device]
        print(
            f"{r.device:6} {r.precision:9} {r.tokens:6d} {r.sample_tps:12.1f} {r.sample_tps / b.sample_tps:6.2f} "
            f"{r.recompute_tps:15.1f} {r.recompute_tps / b.recompute_tps:6.2f} {r.mismatch:9.5f} {r.ok_share:6.0%}"
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, tok = load_policy(args.model, args.var_dir)
    print(
        f"loaded policy {policy_version(model)} in {time.perf_counter() - start:.1f} s; "
        f"{args.queries} queries x {args.samples} samples x {args.tokens} tokens"
    )
    rows = [measure(model, tok, "cpu", p, args) for p in PRECISIONS]
    if torch.cuda.is_available():
        gpu_model = model.to("cuda")
        rows += [measure(gpu_model, tok, "cuda", p, args) for p in PRECISIONS if p != "int8"]
    print_table(rows)


if __name__ == "__main__":
    main()
