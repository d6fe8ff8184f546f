"""Dynamic batching of rewrite generation: concurrent requests → one generation, in a thread.

Read :class:`RewriteBatcher`. Requests `submit` rows (query, m, sampling settings) and get a
`concurrent.futures.Future`; ONE worker thread takes the first waiting request, then keeps
taking requests until the batch holds ``max_batch`` rows or ``max_wait_s`` has passed, and
runs one `policy.sampler.generate` call per distinct sampling setting in the batch. The event
loop never runs torch: routes await the future (`asyncio.wrap_future`).

The policy is read ONCE per batch from a plain attribute, so `swap` (policy activation) is an
atomic reference assignment: a batch in flight finishes on the policy it started with, the
next batch uses the new one, and no request fails.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from app.errors import Overloaded
from policy.constrain import DEFAULT_LINE_CAP, FormatAutomaton
from policy.parse import ParsedOutput, parse_actions
from policy.prefix import PromptPrefix, build_prefix, common_prefix, generate_with_prefix
from policy.prompts import DEFAULT_FEEDBACK_WORDS, ContextSource, build_prompt
from policy.rollout import format_automaton
from policy.sampler import SamplerConfig, generate, serving_guard

log = logging.getLogger(__name__)
POLL_S = 0.1  # how often an idle worker checks for shutdown
MIN_PREFIX_TOKENS = 16  # a shorter shared prefix is not worth a cached KV copy
MAX_PREFIXES = 32  # cached prefix KV entries per policy (one per n_actions, a few mixes)


@dataclass(frozen=True)
class ServingPolicy:
    """A loaded policy ready to generate: model, sampler copy, tokenizer, identity."""

    model: nn.Module
    sampler_model: nn.Module
    tokenizer: Any
    version: str
    name: str
    path: str
    stop_ids: tuple[int, ...]
    pad_id: int
    prompt: str = "oneshot"  # the prompt style the policy was trained with (its version's meta)
    feedback_words: int = DEFAULT_FEEDBACK_WORDS  # prompt feedback: the context's size
    # Prompt prefixes and their KV caches; touched only by the batcher's worker thread.
    templates: dict[int, tuple[int, ...]] = field(default_factory=dict, compare=False)
    prefixes: dict[tuple[int, ...], PromptPrefix] = field(default_factory=dict, compare=False)

    def template_prefix(self, n_actions: int) -> tuple[int, ...]:
        """Tokens every prompt for ``n_actions`` starts with (system + example turn)."""
        if n_actions not in self.templates:
            probes = [self.prompt_ids(q, n_actions, q) for q in ("x", "y")]
            self.templates[n_actions] = common_prefix(probes)
        return self.templates[n_actions]

    @property
    def needs_context(self) -> bool:
        return self.prompt == "feedback"

    def prompt_ids(self, query: str, n_actions: int, context: str | None) -> list[int]:
        """The prompt of one row in the policy's own style (``context``: feedback only)."""
        return build_prompt(
            self.tokenizer, query, n_actions, self.prompt, context if self.needs_context else None
        )

    def prefix(self, ids: tuple[int, ...]) -> PromptPrefix:
        if ids not in self.prefixes:
            if len(self.prefixes) >= MAX_PREFIXES:
                self.prefixes.clear()
            self.prefixes[ids] = build_prefix(self.sampler_model, ids)
        return self.prefixes[ids]


@dataclass(frozen=True)
class Row:
    """One generation to run: a query, m rewrites, and how to sample."""

    query: str
    n_actions: int
    temperature: float  # 0 = greedy
    max_new_tokens: int  # format free only
    format: str = "constrained"  # exactly n_actions numbered lines (policy.constrain) | free
    line_cap: int = DEFAULT_LINE_CAP

    def sampler_key(self) -> tuple[float, int, str, int]:
        return (self.temperature, self.max_new_tokens, self.format, self.line_cap)


@dataclass(frozen=True)
class RowResult:
    parsed: ParsedOutput
    finish_reason: str
    n_tokens: int
    policy_version: str


@dataclass
class _Job:
    rows: list[Row]
    future: Future[tuple[list[RowResult], dict[str, float]]]
    submitted: float = field(default_factory=time.perf_counter)


BatchHook = Callable[[int, list[float]], None]  # (rows in batch, queue wait of each job in s)


class RewriteBatcher:
    """One worker thread that turns waiting requests into batched generations."""

    def __init__(
        self,
        policy: ServingPolicy,
        *,
        max_batch: int,
        max_wait_s: float,
        max_queue: int,
        on_batch: BatchHook | None = None,
        contexts: ContextSource | None = None,
    ) -> None:
        self.policy = policy  # read once per batch; replaced atomically by `swap`
        self.contexts = contexts  # the game's feedback contexts, for a policy prompted with them
        self.max_batch, self.max_wait_s, self.max_queue = max_batch, max_wait_s, max_queue
        self._on_batch = on_batch
        self._queue: queue.Queue[_Job] = queue.Queue()
        self._carry: _Job | None = None
        self._waiting_rows = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="casi-rewrite-batcher", daemon=True)

    def start(self) -> RewriteBatcher:
        self._thread.start()
        return self

    def close(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def swap(self, policy: ServingPolicy) -> ServingPolicy:
        """Serve ``policy`` from the next batch on; returns the previous one."""
        old, self.policy = self.policy, policy
        return old

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def waiting_rows(self) -> int:
        return self._waiting_rows

    def submit(self, rows: list[Row]) -> Future[tuple[list[RowResult], dict[str, float]]]:
        """Queue rows; the future gives their results and {queue_wait_s, batch_rows}."""
        job = _Job(rows, Future())
        with self._lock:  # the worker drains under this lock once stopped: no job is stranded
            if self._stop.is_set():
                raise Overloaded("the API is shutting down")
            if self._waiting_rows + len(rows) > self.max_queue:
                raise Overloaded(
                    f"{self._waiting_rows} rows already waiting (max {self.max_queue})"
                )
            self._waiting_rows += len(rows)
            self._queue.put(job)
        return job.future

    # --- worker thread ----------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            batch = self._collect()
            if batch:
                self._run(batch)
        with self._lock:
            stranded = self._drain()
        for job in stranded:
            job.future.set_exception(Overloaded("the API is shutting down"))

    def _next(self, timeout: float) -> _Job | None:
        if self._carry is not None:
            job, self._carry = self._carry, None
            return job
        try:
            return self._queue.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None

    def _collect(self) -> list[_Job]:
        first = self._next(POLL_S)
        if first is None:
            return []
        batch, rows = [first], len(first.rows)
        deadline = time.perf_counter() + self.max_wait_s
        while rows < self.max_batch:
            job = self._next(deadline - time.perf_counter())
            if job is None:
                break
            if rows + len(job.rows) > self.max_batch:
                self._carry = job  # first in the next batch
                break
            batch.append(job)
            rows += len(job.rows)
        return batch

    def _drain(self) -> list[_Job]:
        jobs = [self._carry] if self._carry is not None else []
        while not self._queue.empty():
            jobs.append(self._queue.get_nowait())
        return jobs

    def _run(self, batch: list[_Job]) -> None:
        started = time.perf_counter()
        n_rows = sum(len(j.rows) for j in batch)
        with self._lock:
            self._waiting_rows -= n_rows
        waits = [started - j.submitted for j in batch]
        policy = self.policy  # ONE read: the whole batch uses one policy
        try:
            flat = [row for job in batch for row in job.rows]
            contexts = None
            if policy.needs_context:  # the query's own list: usually one cache read
                if self.contexts is None:
                    raise RuntimeError("this server has no feedback context for the policy")
                contexts = row_contexts(self.contexts, flat, policy.feedback_words)
            results = generate_rows(policy, flat, self.max_batch, contexts)
        except Exception as exc:  # a bug or an OOM must fail these requests, not the thread
            log.exception("rewrite batch of %d rows failed", n_rows)
            for job in batch:
                job.future.set_exception(exc)
            return
        if self._on_batch is not None:
            try:  # a metrics hook that fails must neither strand these requests nor the thread
                self._on_batch(n_rows, waits)
            except Exception:
                log.exception("the batch hook failed")
        start = 0
        for job, wait in zip(batch, waits, strict=True):
            info = {"queue_wait_s": wait, "batch_rows": float(n_rows)}
            job.future.set_result((results[start : start + len(job.rows)], info))
            start += len(job.rows)


def row_contexts(source: ContextSource, rows: list[Row], n_words: int) -> list[str]:
    """Each row's feedback context (one call per distinct m: the layout depends on it)."""
    out: list[str] = [""] * len(rows)
    for m in sorted({row.n_actions for row in rows}):
        idx = [i for i, row in enumerate(rows) if row.n_actions == m]
        for i, text in zip(idx, source([rows[i].query for i in idx], n_words, m), strict=True):
            out[i] = text
    return out


def generate_rows(
    policy: ServingPolicy,
    rows: list[Row],
    max_batch: int,
    contexts: Sequence[str] | None = None,
) -> list[RowResult]:
    """Generate every row (one call per sampling setting), results in row order. The prompt
    prefix the rows share is prefilled once and reused (`policy.prefix`). ``contexts``: each
    row's feedback context (`evaluator.feedback`), for a policy prompted with them."""
    if policy.needs_context and (contexts is None or len(contexts) != len(rows)):
        raise ValueError(f"the policy's feedback prompt needs one context per row ({len(rows)})")
    out: list[RowResult | None] = [None] * len(rows)
    groups: dict[tuple[float, int, str, int], list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(row.sampler_key(), []).append(i)
    for (temperature, max_new, fmt, line_cap), idx in groups.items():
        config = SamplerConfig(
            temperature=temperature if temperature > 0 else 1.0,
            do_sample=temperature > 0,
            max_new_tokens=max_new,
            batch_size=max_batch,
            top_k_logprobs=1,
        )
        prompts = [
            policy.prompt_ids(rows[i].query, rows[i].n_actions, contexts[i] if contexts else None)
            for i in idx
        ]
        automaton = format_automaton(policy.tokenizer, fmt, line_cap)
        gens = _generate(policy, prompts, config, idx, rows, automaton)
        for i, gen in zip(idx, gens, strict=True):
            parsed = parse_actions(
                gen.response_ids, policy.tokenizer, rows[i].n_actions, policy.stop_ids
            )
            out[i] = RowResult(parsed, gen.finish_reason, len(gen.response_ids), policy.version)
    return [r for r in out if r is not None]


def _generate(
    policy: ServingPolicy, prompts: list[list[int]], config: SamplerConfig, idx: list[int],
    rows: list[Row], automaton: FormatAutomaton | None,
) -> list[Any]:  # fmt: skip
    """A greedy, format-constrained group is decoded with the degenerate guard: no served
    rewrite is a string of repeats (`policy.constrain.RowConstraints.refuse_degenerate`)."""
    templates = [policy.template_prefix(m) for m in sorted({rows[i].n_actions for i in idx})]
    shared = common_prefix([*templates, *prompts]) if len(templates) > 1 else templates[0]
    fits = all(tuple(p[: len(shared)]) == shared and len(p) > len(shared) for p in prompts)
    fmt: dict[str, Any] = {
        "automaton": automaton,
        "n_actions": [rows[i].n_actions for i in idx],
        "refuse_degenerate": serving_guard(config, automaton is not None),
    }
    if len(shared) < MIN_PREFIX_TOKENS or not fits:
        return generate(
            policy.sampler_model, prompts, config, policy.stop_ids, policy.pad_id, **fmt
        )
    return generate_with_prefix(
        policy.sampler_model, policy.prefix(shared), prompts, config, policy.stop_ids,
        policy.pad_id, **fmt,
    )  # fmt: skip
