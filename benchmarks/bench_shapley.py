"""Batched exact Shapley (one matmul) versus shapiq's ExactComputer, one game at a time.

    python benchmarks/bench_shapley.py [--games 4096 --m 10 --shapiq-games 8 --repeats 200]

shapiq is timed on ``--shapiq-games`` games only and its per-game time is extrapolated to the
whole batch (it is a per-game API; running it on 4096 games would take minutes). Both results
are checked to agree on every game shapiq computed.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from evaluator.shapley import exact_shapley, shapley_weight_matrix  # noqa: E402

AGREEMENT_TOL = 1e-9


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of ``repeats`` runs (the machine is shared: the minimum is the least noisy)."""
    fn()  # warm-up (weight-matrix cache, allocator)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def shapiq_values(values: np.ndarray, m: int) -> tuple[np.ndarray, float]:
    """Shapley values of one game with shapiq's ExactComputer, and the seconds it took."""
    import shapiq

    players = 1 << np.arange(m)

    def game(coalitions: np.ndarray) -> np.ndarray:
        return values[coalitions.astype(np.int64) @ players]

    start = time.perf_counter()
    sv = shapiq.ExactComputer(game, n_players=m)("SV")
    seconds = time.perf_counter() - start
    return np.array([sv[(j,)] for j in range(m)]), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--games", type=int, default=4096)
    parser.add_argument("--m", type=int, default=10)
    parser.add_argument("--shapiq-games", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    g = torch.Generator().manual_seed(args.seed)
    values = torch.randn(args.games, 2**args.m, generator=g, dtype=torch.float64)
    shapley_weight_matrix(args.m)  # build the cached matrix outside the timings

    ours_batch = best_seconds(lambda: exact_shapley(values, args.m), args.repeats)
    ours_one = best_seconds(lambda: exact_shapley(values[0], args.m), args.repeats * 5)
    phi = exact_shapley(values, args.m)

    n_ref = min(args.shapiq_games, args.games)
    shapiq_values(values[0].numpy(), args.m)  # warm-up: imports, first-call overheads
    ref_seconds, max_err = [], 0.0
    for i in range(n_ref):
        ref, seconds = shapiq_values(values[i].numpy(), args.m)
        ref_seconds.append(seconds)
        max_err = max(max_err, float(np.abs(ref - phi[i].numpy()).max()))
    shapiq_per_game = min(ref_seconds)

    ours_rate = args.games / ours_batch
    shapiq_rate = 1.0 / shapiq_per_game
    rows = [
        ("", "ours (batched matmul)", "shapiq ExactComputer", "ratio"),
        (
            f"{args.games} games: seconds",
            f"{ours_batch:.4g}",
            f"{shapiq_per_game * args.games:.4g} (extrapolated)",
            f"{shapiq_per_game * args.games / ours_batch:,.0f}x",
        ),
        (
            "throughput (games/s)",
            f"{ours_rate:,.0f}",
            f"{shapiq_rate:,.1f}",
            f"{ours_rate / shapiq_rate:,.0f}x",
        ),
        (
            "one game: seconds",
            f"{ours_one:.3g}",
            f"{shapiq_per_game:.3g}",
            f"{shapiq_per_game / ours_one:,.0f}x",
        ),
    ]
    widths = [max(len(row[c]) for row in rows) for c in range(4)]
    print(f"exact Shapley, m = {args.m} players, {2**args.m} coalitions per game")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float64")
    for row in rows:
        print(
            "  ".join(
                cell.rjust(w) if c else cell.ljust(w)
                for c, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    print(
        f"shapiq timed on {n_ref} games (fastest game), extrapolated to {args.games}; "
        f"ours: fastest of {args.repeats} runs on all {args.games} games"
    )
    status = "OK" if max_err <= AGREEMENT_TOL else "MISMATCH"
    print(f"agreement on the {n_ref} shapiq games: max |diff| = {max_err:.2e} ({status})")
    if max_err > AGREEMENT_TOL:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
