"""benchmarks/bench_trl.py measures what it says: every taught completion carries m real,
distinct actions, and the action cache is cold at every step (issue 51, item 7)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the bench runs TRL: pip install -e '.[trl]'")

from casi_integrations.credit import CasiCredit  # noqa: E402
from policy.parse import parse_actions  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_trl.py"


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_trl", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_taught_answers_hold_m_distinct_actions(smol_tokenizer, slice_dataset) -> None:  # type: ignore[no-untyped-def]
    bench = _bench()
    queries = [slice_dataset.queries[q] for q in slice_dataset.split_query_ids("train")[:4]]
    seen = set()
    for m in (2, 4, 8):
        for q in queries:
            ids = smol_tokenizer(bench.taught_answer(q, m), add_special_tokens=False)["input_ids"]
            actions = [a.text for a in parse_actions(ids, smol_tokenizer, m).actions]
            assert len(actions) == len(set(actions)) == m, actions
            seen.update(actions)
    assert len(seen) > 4 * 4, "the queries' answers share their actions"


def test_the_cache_is_cold_at_every_call(smol_tokenizer, slice_dataset, embedder, slice_index,
                                         redis_client, train_scorer) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """The same completions credited twice: without cold_cache the second call hits every
    action; with it, both calls miss every action (and the credit is the same), through a copy
    of the CasiCredit too."""
    from evaluator.actions import ActionExecutor
    from evaluator.cache import ActionCache

    bench = _bench()
    qids = slice_dataset.split_query_ids("train")[:2]
    answers = [bench.taught_answer(slice_dataset.queries[q], 3) for q in qids]
    ids = [smol_tokenizer(a, add_special_tokens=False)["input_ids"] for a in answers]

    def casi() -> CasiCredit:
        cache = ActionCache(redis_client, slice_index.version, embedder.version, 10)
        executor = ActionExecutor(embedder, slice_index, cache)
        return CasiCredit.from_components(
            executor, train_scorer, smol_tokenizer, n_actions=3,
            queries={q: slice_dataset.queries[q] for q in qids},
        )  # fmt: skip

    def misses(source: CasiCredit) -> list[tuple[int, Any]]:
        out = []
        for _ in range(2):
            credit = source.credit(source.completions(ids, list(qids)))
            out.append((int(credit.cache["misses"]), credit.value_full.tolist()))
        return out

    warm = misses(casi())
    assert warm[1][0] == 0
    cold = casi()
    bench.cold_cache(cold)
    got = misses(cold)
    assert got[0][0] == got[1][0] >= 6 and got[0][1] == got[1][1] == warm[1][1]
    # a copy of the CasiCredit (as CasiGRPOTrainer makes: trl_matched, stop ids) stays cold
    copied = misses(cold.with_shaping(std_eps=1e-4))
    assert copied[0][0] == copied[1][0] == got[0][0]
