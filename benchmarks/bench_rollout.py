"""Rollout throughput and train-inference mismatch per sampler precision, side by side.

For the default policy (SmolLM2-135M-Instruct; any local HF folder via --model) and each
sampler precision (float32, bfloat16, int8 = dynamic W8A8 quantization (CPU only),
int8_weight = weight-only int8; CUDA rows too when present), in one run:
  * sample tok/s  — generated tokens per second (KV-cached loop, seeded);
  * recompute tok/s — teacher-forced log-probs of the same response tokens with a model of
    that precision (the trainer-side cost if the trainer ran in that precision);
  * mismatch — mean |log π_old − log μ| over response tokens, π_old = the float32 model;
  * what the trainer does with those tokens, under the `casi` loss preset (token TIS, C = 2, and
    the CARM sequence mask, τ = 1.04, on ρ = π_old/μ): the share of sequences CARM masks, the
    share of kept tokens TIS truncates, and the mismatch over the tokens CARM keeps;
ratios are versus float32 on the same device. Small sizes by default (4 queries × 2 samples ×
48 tokens) so it finishes in a few minutes on 2 CPU cores.

``--constrained`` samples as training does (`casi experiment credit`'s protocol): short prompt,
constrained format (m = 4, line cap 24), temperature 0.7; π_old is then teacher-forced at 0.7
and the mismatch is over the tokens the loss sees (forced format tokens excluded).
``--policy`` takes a warm start's version (var/models/warmstart-<version>) or a model folder.

    .venv/bin/python benchmarks/bench_rollout.py [--queries 4 --samples 2 --tokens 48]
    .venv/bin/python benchmarks/bench_rollout.py --policy d67b684cf777 --constrained --queries 8 --samples 4
"""

from __future__ import annotations

import argparse
import math
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
from policy.losses.batch import LossBatch  # noqa: E402
from policy.losses.presets import load_preset  # noqa: E402
from policy.losses.stack import LossStack  # noqa: E402
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
    carm_masked: float  # share of sequences the casi preset's CARM mask drops
    tis_truncated: float  # share of CARM-kept tokens whose ρ = π_old/μ exceeds the TIS cap
    kept_mismatch: float  # mean |log π_old − log μ| over the tokens CARM keeps (nan: none kept)


def policy_folder(policy: str | None, var_dir: Path) -> Path | None:
    """A model folder, or var/models/warmstart-<version> for a warm start's version; None = the
    default policy."""
    if policy is None:
        return None
    path = Path(policy)
    return path if path.is_dir() else var_dir / "models" / f"warmstart-{policy}"


def stack_effect(batch: RolloutBatch, logp_old: torch.Tensor) -> tuple[float, float, float]:
    """(CARM-masked sequence share, TIS-truncated share of kept tokens, mismatch over kept
    tokens) of the `casi` preset on a batch sampled by μ, before any update (π = π_old)."""
    cfg = load_preset("casi")
    mask = batch.loss_mask
    loss_batch = LossBatch(
        logp=logp_old,
        old_logp=logp_old,
        sampler_logp=batch.sampler_logp.float(),
        advantages=torch.ones_like(logp_old),
        response_mask=mask,
    )
    with torch.no_grad():
        _, metrics = LossStack(cfg)(loss_batch)
    ell = (logp_old - batch.sampler_logp).masked_fill(~mask, 0)  # log ρ, 0 outside the loss
    kept_seq = ell.abs().sum(1) <= math.log(cfg.seq_mask.tau) * mask.sum(1)
    # CARM's test, as `policy.losses.masks.carm` makes it (checked against its metric below)
    kept = mask & kept_seq[:, None]
    masked = float(metrics["carm/masked_seq_frac"])
    assert abs(masked - float(1 - kept_seq.float().mean())) < 1e-6, (masked, kept_seq)
    if not bool(kept.any()):
        return masked, float("nan"), float("nan")
    truncated = float((ell[kept].exp() > cfg.importance.tis_cap).float().mean())
    return masked, truncated, float(ell[kept].abs().mean())


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

    temperature = 0.7 if args.constrained else 1.0
    shape = (
        {"prompt_style": "short", "format": "constrained", "line_cap": 24}
        if args.constrained
        else {}
    )

    def sample(p: str, tokens: int, seed: int = 0) -> list[Rollout]:
        config = SamplerConfig(
            max_new_tokens=tokens, seed=seed, precision=p, temperature=temperature
        )
        return sample_rollouts(
            model,
            tok,
            queries,
            args.samples,
            4,
            config,
            policy_version="bench",
            sampler_model=samplers[p],
            **shape,
        )

    for p in precisions:  # same batch shape, few steps: first-call costs stay out of the timings
        recompute_logprobs(samplers[p], collate(sample(p, WARMUP_TOKENS, seed=1)), temperature)
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
            recompute_logprobs(samplers[p], batch, temperature, micro_batch_size=args.micro_batch)
            seconds = time.perf_counter() - start
            best_recompute[p] = min(best_recompute[p], seconds)
    rows = []
    for p in precisions:
        batch = batches[p]
        logp_old = recompute_logprobs(
            model, batch, temperature, micro_batch_size=args.micro_batch
        )  # float32 π_old, 0 outside the loss mask (as μ is at forced tokens)
        diff = (logp_old - batch.sampler_logp.float())[batch.loss_mask]
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
                *stack_effect(batch, logp_old),
            )
        )
    return rows


def print_table(rows: list[Row]) -> None:
    base = {r.device: r for r in rows if r.precision == "float32"}
    header = (
        f"{'device':6} {'precision':11} {'tokens':>6} {'sample tok/s':>12} {'x fp32':>6} "
        f"{'recompute tok/s':>15} {'x fp32':>6} {'mismatch':>9} {'stopped':>7} "
        f"{'CARM masks':>10} {'TIS truncates':>13} {'kept mismatch':>13}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        b = base[r.device]
        print(
            f"{r.device:6} {r.precision:11} {r.tokens:6d} {r.sample_tps:12.1f} {r.sample_tps / b.sample_tps:6.2f} "
            f"{r.recompute_tps:15.1f} {r.recompute_tps / b.recompute_tps:6.2f} {r.mismatch:9.5f} {r.stopped:7.0%} "
            f"{r.carm_masked:10.0%} {r.tis_truncated:13.1%} {r.kept_mismatch:13.5f}"
        )
    print(
        "mismatch = mean |log pi_old - log mu| over the tokens the loss sees; pi_old = float32 "
        "model\nCARM masks = share of sequences the casi preset drops (mean |log rho| > log 1.04); "
        "TIS truncates = share of kept tokens with rho > 2; kept mismatch = over kept tokens"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="local HF folder (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--var-dir", type=Path, default=ROOT / "var")
    parser.add_argument("--policy", default=None, help="a warm start's version or a model folder")
    parser.add_argument(
        "--constrained",
        action="store_true",
        help="sample as training does: short prompt, constrained m = 4, temperature 0.7",
    )
    parser.add_argument(
        "--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS)
    )
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
    model, tok = load_policy(args.model or policy_folder(args.policy, args.var_dir), args.var_dir)
    print(
        f"loaded policy {policy_version(model)} in {time.perf_counter() - start:.1f} s; "
        f"{args.queries} queries x {args.samples} samples x {args.tokens} tokens"
    )
    precisions = ["float32"] + [p for p in args.precisions if p != "float32"]  # the baseline first
    rows = run_device(model, tok, "cpu", precisions, args)
    if torch.cuda.is_available():
        gpu_model = model.to("cuda")
        rows += run_device(gpu_model, tok, "cuda", [p for p in precisions if p != "int8"], args)
    print_table(rows)


if __name__ == "__main__":
    main()
