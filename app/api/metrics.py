"""Prometheus metrics of one API process (`prometheus-client`, a private registry).

Request latency per route template and status, rewrite batch sizes and queue waits, the
action cache's hit ratio (read from the live counters at scrape time) and credits computed.
With ``--workers N`` each worker process exports its own numbers.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from evaluator.cache import CacheStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, cache_stats: CacheStats) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "casi_http_request_duration_seconds", "Request latency by route template.",
            ["method", "route", "status"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.batch_rows = Histogram(
            "casi_rewrite_batch_rows", "Rows (queries) per rewrite generation batch.",
            buckets=BATCH_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.queue_wait = Histogram(
            "casi_rewrite_queue_wait_seconds", "Time a rewrite request waited for its batch.",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.credits = Counter(
            "casi_credits_computed", "Credit computations (POST /v1/credits).",
            registry=self.registry,
        )  # fmt: skip
        hit_ratio = Gauge(
            "casi_cache_hit_ratio", "Action-cache hits / lookups since start.",
            registry=self.registry,
        )  # fmt: skip
        hit_ratio.set_function(lambda: float(cache_stats.as_dict()["hit_rate"]))
        degraded = Gauge(
            "casi_cache_degraded_calls", "Cache calls that found Redis unreachable.",
            registry=self.registry,
        )  # fmt: skip
        degraded.set_function(lambda: float(cache_stats.degraded_calls))

    def observe_batch(self, rows: int, waits: list[float]) -> None:
        self.batch_rows.observe(rows)
        for wait in waits:
            self.queue_wait.observe(wait)

    def render(self) -> bytes:
        return generate_latest(self.registry)
