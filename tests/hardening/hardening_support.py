"""Helpers of the hardening suite (imported by its conftest and tests): a tiny BEIR dataset,
the real ``casi`` command as a subprocess, damage helpers, a private ``redis-server``.

``run_casi(args, var_dir, **env)`` returns a :class:`CasiRun` whose ``output`` is stdout and
stderr together; ``CasiRun.assert_one_error()`` is the contract every expected failure keeps:
exit status 2, exactly one ``error:`` line, no traceback.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[2]
CASI = str(Path(sys.executable).with_name("casi"))
N_DOCS = 20
TIMEOUT_S = 180  # one command; the slow ones embed 20 documents


def write_tiny_beir(root: Path) -> Path:
    """20 documents, 6 queries, train (q0-q3) and test (q4-q5) qrels."""
    (root / "qrels").mkdir(parents=True, exist_ok=True)
    with (root / "corpus.jsonl").open("w", encoding="utf-8") as fh:
        for i in range(N_DOCS):
            doc = {"_id": f"d{i}", "title": f"title {i}", "text": f"document {i} on topic {i % 5}"}
            fh.write(json.dumps(doc) + "\n")
    with (root / "queries.jsonl").open("w", encoding="utf-8") as fh:
        for i in range(6):
            fh.write(
                json.dumps({"_id": f"q{i}", "text": f"what is known about topic {i % 5}"}) + "\n"
            )
    for split, qids in (("train", range(4)), ("test", range(4, 6))):
        lines = ["query-id\tcorpus-id\tscore"] + [f"q{q}\td{q}\t1" for q in qids]
        (root / "qrels" / f"{split}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


@dataclass
class CasiRun:
    returncode: int
    output: str
    seconds: float

    def error_lines(self) -> list[str]:
        return [line for line in self.output.splitlines() if line.startswith("error:")]

    def assert_one_error(self, *fragments: str) -> str:
        """Exit 2, exactly one ``error:`` line (containing every fragment), no traceback."""
        lines = self.error_lines()
        assert self.returncode == 2, self.output
        assert len(lines) == 1, self.output
        assert "Traceback" not in self.output, self.output
        for fragment in fragments:
            assert fragment in lines[0], lines[0]
        return lines[0]


def casi_env(var_dir: Path, **overrides: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("CASI_") and k not in ("DATABASE_URL", "REDIS_URL")
    }
    env.update(
        CASI_VAR_DIR=str(var_dir),
        CASI_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        COLUMNS="200",
    )
    env.update(overrides)
    return env


def run_casi(args: list[str], var_dir: Path, timeout: float = TIMEOUT_S, **env: str) -> CasiRun:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [CASI, *args],
        env=casi_env(var_dir, **env),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    return CasiRun(proc.returncode, proc.stdout, time.perf_counter() - t0)


def start_casi(args: list[str], var_dir: Path, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [CASI, *args],
        env=casi_env(var_dir, **env),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def flip_byte(path: Path, offset: int | None = None, keep_mtime: bool = False) -> None:
    """Invert one byte (default: the middle one), optionally restoring the mtime."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@contextmanager
def read_only(path: Path) -> Iterator[Path]:
    """A folder (or file) unwritable while inside, for root too: ``chattr +i`` as root
    (nothing can be created, renamed or removed in the folder, nor the file opened for writing;
    root ignores mode bits), mode 0555 otherwise. Skips the test when neither takes (a file
    system without immutable flags)."""
    import pytest

    root, mode = os.geteuid() == 0, path.stat().st_mode
    if root:
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"running as root and chattr +i does not work here: {done.stderr.strip()}")
    else:
        path.chmod(0o555)
    try:
        if _writable(path):
            pytest.skip(f"{path} stays writable after chattr / chmod")
        yield path
    finally:
        if root:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        else:
            path.chmod(mode)


def _writable(path: Path) -> bool:
    try:
        if path.is_dir():
            (path / ".probe").write_text("x")
            (path / ".probe").unlink()
        else:
            path.open("ab").close()
    except OSError:
        return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A private ``redis-server`` on a free port with extra config; stopped by the fixture."""

    def __init__(self, *config: str) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        self.proc = subprocess.Popen([*args, *config], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                redis.Redis(port=self.port, socket_connect_timeout=0.2).ping()
                return
            except redis.exceptions.AuthenticationError:
                return  # up, and asks for a password
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
