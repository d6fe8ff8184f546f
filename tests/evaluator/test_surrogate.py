"""Surrogate set scorer: the fit improves agreement with replay; frozen; save/load; batching.

The setting is synthetic but real: seeded random unit doc embeddings (d = 32); each query has
1-4 relevant docs close to it (cos ≈ 0.78) and 3 unjudged "hard negatives" a bit farther
(cos ≈ 0.55); every other doc is random (cos ≈ 0 ± 0.18). Training lists come from the real
generator (:func:`make_training_lists`), targets from the real replay scorer.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from evaluator.scorers import QrelsTable, ReplayScorer, make_scorer
from evaluator.scorers.surrogate import (
    SurrogateConfig,
    SurrogateNet,
    SurrogateScorer,
    load_surrogate,
    save_surrogate,
    weights_hash,
)
from evaluator.scorers.surrogate_fit import (
    FitConfig,
    SurrogateData,
    _merge_best,
    agreement,
    fit_surrogate,
    make_training_lists,
)

K = 10
DIM = 32


@dataclass(frozen=True)
class World:
    ids: list[str]
    query_emb: torch.Tensor  # (Q, d)
    doc_emb: torch.Tensor  # (N, d)
    qrels: QrelsTable
    train: SurrogateData
    val: SurrogateData


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Fits are tiny; on a shared 2-core machine one thread is ~10× faster than two."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _near(q: torch.Tensor, scale: float, gen: torch.Generator) -> torch.Tensor:
    return F.normalize(q + scale * torch.randn(q.shape[-1], generator=gen) / math.sqrt(DIM), dim=0)


@pytest.fixture(scope="module")
def world(one_thread: None) -> World:
    gen = torch.Generator().manual_seed(0)
    n_queries, n_docs = 160, 2000
    query_emb = F.normalize(torch.randn(n_queries, DIM, generator=gen), dim=-1)
    doc_emb = F.normalize(torch.randn(n_docs, DIM, generator=gen), dim=-1)
    qrels: dict[str, dict[int, int]] = {}
    row = 0
    for i in range(n_queries):
        rel = {}
        for _ in range(int(torch.randint(1, 5, (1,), generator=gen))):
            doc_emb[row], rel[row], row = _near(query_emb[i], 0.8, gen), 1, row + 1
        for _ in range(3):  # hard negatives: close but unjudged
            doc_emb[row], row = _near(query_emb[i], 1.5, gen), row + 1
        qrels[f"q{i}"] = rel
    table = QrelsTable.from_dict(qrels)
    ids = [f"q{i}" for i in range(n_queries)]
    common = {"k": K, "n_lists_per_query": 16}
    train = make_training_lists(ids[:120], query_emb[:120], doc_emb, table, seed=1, **common)
    val = make_training_lists(ids[120:], query_emb[120:], doc_emb, table, seed=2, **common)
    return World(ids, query_emb, doc_emb, table, train, val)


@pytest.fixture(scope="module")
def fitted(world: World) -> tuple[SurrogateNet, dict[str, float]]:
    logs: list[dict[str, float]] = []
    config = FitConfig(epochs=20, hidden=64, lr=3e-3, batch=128, seed=0)
    model, metrics = fit_surrogate(
        world.train,
        world.val,
        doc_emb=world.doc_emb,
        config=config,
        progress=lambda epoch, m: logs.append(m),
    )
    assert len(logs) == 20 and logs[-1]["loss"] < logs[0]["loss"]
    # select_best keeps the epoch of the lowest validation MSE, and the final metrics agree
    best = min(range(20), key=lambda e: logs[e]["val_mse"])
    assert metrics["best_epoch"] == best
    assert metrics["val_mse"] == pytest.approx(logs[best]["val_mse"], rel=1e-6)
    return model, metrics


def test_fit_improves_held_out_agreement_with_replay(
    fitted: tuple[SurrogateNet, dict[str, float]],
) -> None:
    _, m = fitted
    print({name: round(value, 4) for name, value in m.items()})
    assert m["after_pearson"] > m["before_pearson"] + 0.15
    assert m["after_spearman"] > m["before_spearman"] + 0.08
    assert m["after_pair_sign"] > m["before_pair_sign"] + 0.05
    assert m["after_pearson"] > 0.85 and m["after_pair_sign"] > 0.9
    assert m["after_pearson"] > m["cosine_pearson"]  # learned beats the zero-shot baseline
    assert m["n_params"] < 300_000


def test_training_lists_are_coalition_like(world: World) -> None:
    data = world.train
    assert data.lists.shape == (120, 16, K) and data.targets.shape == (120, 16)
    valid = data.lists >= 0
    assert bool((valid[..., :-1] | ~valid[..., 1:]).all())  # padding only at the end
    cos = torch.einsum("qd,qnkd->qnk", data.query_emb, world.doc_emb[data.lists.clamp(min=0)])
    cos = cos.masked_fill(~valid, -math.inf)
    # random-subset lists (the first half) are sorted by cosine; perturbed merges are sorted by
    # their rewrites' best scores instead, so they differ from the query's own order
    assert bool((cos[:, :8, :-1] >= cos[:, :8, 1:] - 1e-6).all())
    assert not bool((cos[:, 8:, :-1] >= cos[:, 8:, 1:] - 1e-6).all())
    rows = data.lists.masked_fill(~valid, -1).sort(-1).values
    assert not bool(((rows[..., 1:] == rows[..., :-1]) & (rows[..., 1:] >= 0)).any())
    replay = ReplayScorer(world.qrels, k=K)
    assert_close(replay.score(data.query_ids, data.query_emb, data.lists), data.targets)
    assert 0.2 < float(data.targets.mean()) < 0.9 and float(data.targets.std()) > 0.2
    again = make_training_lists(
        world.ids[:120],
        world.query_emb[:120],
        world.doc_emb,
        world.qrels,
        k=K,
        n_lists_per_query=16,
        seed=1,
    )
    assert torch.equal(again.lists, data.lists)


def test_merge_best_keeps_each_docs_best_score() -> None:
    rows = torch.tensor([[5, 7, 9, 7, 3, 5]])
    scores = torch.tensor([[0.1, 0.2, 0.3, 0.9, -math.inf, 0.4]])  # row 3 is padding (−inf)
    assert _merge_best(rows, scores, 4).tolist() == [[7, 5, 9, -1]]


def test_agreement_metrics_on_known_cases() -> None:
    target = torch.tensor([[0.0, 0.5, 1.0], [0.2, 0.2, 0.1]], dtype=torch.float64)
    same = agreement(target * 2 + 1, target)
    assert_close(same["pearson"], torch.tensor(1.0, dtype=torch.float64))
    assert_close(same["spearman"], torch.tensor(1.0, dtype=torch.float64))
    assert float(same["pair_sign"]) == 1.0 and int(same["n_pairs"]) == 5  # 3 + 2 (one tie)
    flipped = agreement(-target, target)
    assert float(flipped["pair_sign"]) == 0.0


@pytest.fixture(scope="module")
def scorer(world: World, fitted: tuple[SurrogateNet, dict[str, float]]) -> SurrogateScorer:
    return SurrogateScorer(fitted[0], doc_emb=world.doc_emb, k=K)


def test_frozen_weights_never_change(world: World, scorer: SurrogateScorer) -> None:
    assert all(not p.requires_grad for p in scorer.model.parameters())
    assert not scorer.model.training
    before = {n: t.clone() for n, t in scorer.model.state_dict().items()}
    for _ in range(5):
        scorer.score(world.val.query_ids, world.val.query_emb, world.val.lists)
    # used inside autograd with another parameter that requires grad (a trainer's situation)
    weight = torch.nn.Parameter(torch.ones(len(world.val.query_ids), 1, dtype=torch.float64))
    values = scorer.score(world.val.query_ids, world.val.query_emb, world.val.lists)
    assert not values.requires_grad
    torch.autograd.backward((values * weight).sum())  # inference tensors would raise here
    opt = torch.optim.SGD([weight, *scorer.model.parameters()], lr=1.0)
    opt.step()
    assert weight.grad is not None and all(p.grad is None for p in scorer.model.parameters())
    after = scorer.model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_scorer_copy_is_independent_of_later_training(world: World) -> None:
    model = SurrogateNet(SurrogateConfig(dim=DIM, hidden=16, k_max=K))
    frozen = SurrogateScorer(model, doc_emb=world.doc_emb, k=K)
    version = frozen.version
    with torch.no_grad():
        model.item.bias.add_(1.0)
    assert (
        frozen.version
        == version
        == SurrogateScorer(frozen.model, doc_emb=world.doc_emb, k=K).version
    )
    assert SurrogateScorer(model, doc_emb=world.doc_emb, k=K).version != version


def test_empty_list_scores_exactly_zero(world: World, scorer: SurrogateScorer) -> None:
    lists = world.val.lists[:3, :2].clone()
    lists[:, 0] = -1
    values = scorer.score(world.val.query_ids[:3], world.val.query_emb[:3], lists)
    assert bool((values[:, 0] == 0).all()) and bool((values[:, 1] > 0).all())


def test_batched_equals_per_list_loop_and_chunking(world: World, scorer: SurrogateScorer) -> None:
    ids, q, lists = world.val.query_ids[:5], world.val.query_emb[:5], world.val.lists[:5, :6]
    batched = scorer.score(ids, q, lists)
    assert batched.shape == (5, 6) and batched.dtype == torch.float64
    loop = torch.stack(
        [
            torch.cat(
                [
                    scorer.score([ids[i]], q[i : i + 1], lists[i : i + 1, c : c + 1])[0]
                    for c in range(6)
                ]
            )
            for i in range(5)
        ]
    )
    assert_close(batched, loop, rtol=1e-6, atol=1e-7)
    chunked = SurrogateScorer(scorer.model, doc_emb=world.doc_emb, k=K, chunk=4)
    assert_close(chunked.score(ids, q, lists), batched, rtol=1e-6, atol=1e-7)


def test_save_load_round_trip(tmp_path: Path, world: World, scorer: SurrogateScorer) -> None:
    path = tmp_path / "surrogate.safetensors"
    version = save_surrogate(scorer.model, path)
    assert version == scorer.weights_version and path.with_suffix(".json").is_file()
    loaded = load_surrogate(path, doc_emb=world.doc_emb, k=K)
    assert loaded.version == scorer.version
    assert all(not p.requires_grad for p in loaded.model.parameters()) and not loaded.model.training
    args = (world.val.query_ids, world.val.query_emb, world.val.lists)
    assert torch.equal(loaded.score(*args), scorer.score(*args))
    via_factory = make_scorer("surrogate", doc_emb=world.doc_emb, k=K, surrogate_path=path)
    assert via_factory.version == scorer.version


def test_version_changes_with_weights_and_corruption_is_detected(
    tmp_path: Path, world: World, scorer: SurrogateScorer
) -> None:
    path = tmp_path / "s.safetensors"
    save_surrogate(scorer.model, path)
    changed = SurrogateNet(scorer.model.config)
    changed.load_state_dict(scorer.model.state_dict())
    with torch.no_grad():
        changed.item.bias.add_(1e-3)
    assert weights_hash(changed) != scorer.weights_version
    assert SurrogateScorer(changed, doc_emb=world.doc_emb, k=K).version != scorer.version
    assert SurrogateScorer(scorer.model, doc_emb=world.doc_emb, k=K - 1).version != scorer.version
    save_surrogate(changed, tmp_path / "other.safetensors")
    (tmp_path / "other.safetensors").replace(path)  # weights no longer match s.json's hash
    with pytest.raises(ValueError, match="weights hash"):
        load_surrogate(path, doc_emb=world.doc_emb, k=K)
    with pytest.raises(FileNotFoundError):
        load_surrogate(tmp_path / "absent.safetensors", doc_emb=world.doc_emb, k=K)


def test_k_above_k_max_is_rejected(world: World) -> None:
    model = SurrogateNet(SurrogateConfig(dim=DIM, hidden=8, k_max=4))
    with pytest.raises(ValueError, match="k_max=4"):
        SurrogateScorer(model, doc_emb=world.doc_emb, k=5)


def test_factored_forward_equals_plain_forward() -> None:
    """forward_rows (first layer per distinct (query, doc) pair) = forward, lists of mixed
    queries with repeated documents and padding."""
    torch.manual_seed(0)
    net = SurrogateNet(SurrogateConfig(dim=16, hidden=8, k_max=5)).eval()
    doc_emb = torch.nn.functional.normalize(torch.randn(30, 16), dim=-1)
    queries = torch.nn.functional.normalize(torch.randn(3, 16), dim=-1)
    qrow = torch.randint(0, 3, (40,))
    lists = torch.randint(-1, 30, (40, 5))
    with torch.no_grad():
        docs, mask = doc_emb[lists.clamp(min=0)], lists >= 0
        plain = net(queries[qrow], docs, mask)
        factored = net.forward_rows(queries, qrow, doc_emb, lists)
    torch.testing.assert_close(factored, plain, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("n_docs", "n_candidates"), [(5, 50), (400, 4)])
def test_training_lists_from_fewer_documents_than_k_are_padded(
    n_docs: int, n_candidates: int
) -> None:
    """A corpus (or candidate pool) smaller than K: shorter lists, −1 padded to K (was
    ``RuntimeError: selected index k out of range``), and the fit runs on them."""
    gen = torch.Generator().manual_seed(3)
    doc_emb = F.normalize(torch.randn(n_docs, 8, generator=gen), dim=-1)
    query_emb = F.normalize(torch.randn(2, 8, generator=gen), dim=-1)
    table = QrelsTable.from_dict({"q1": {0: 1}, "q2": {1: 2, 2: 1}})
    common = {"k": K, "n_lists_per_query": 6, "n_candidates": n_candidates}
    data = make_training_lists(["q1", "q2"], query_emb, doc_emb, table, seed=0, **common)
    assert data.lists.shape == (2, 6, K) and data.targets.shape == (2, 6)
    valid = data.lists >= 0
    assert bool((valid[..., :-1] | ~valid[..., 1:]).all())  # padding only at the end
    assert bool((data.lists < n_docs).all()) and bool(valid[..., 0].all())
    assert int(valid[:, :3].sum(-1).max()) <= min(n_candidates, n_docs)  # random subsets
    assert int(valid.sum(-1).max()) <= min(K, n_docs)
    rows = data.lists.sort(-1).values
    assert not bool(((rows[..., 1:] == rows[..., :-1]) & (rows[..., 1:] >= 0)).any())
    replay = ReplayScorer(table, k=K)
    assert_close(replay.score(data.query_ids, query_emb, data.lists), data.targets)
    model, metrics = fit_surrogate(data, data, doc_emb=doc_emb, config=FitConfig(epochs=1))
    assert math.isfinite(metrics["val_mse"])


def test_merge_best_pads_fewer_candidates_than_k() -> None:
    rows = torch.tensor([[4, 2, 4]])
    assert _merge_best(rows, torch.tensor([[0.5, 0.7, 0.9]]), 5).tolist() == [[4, 2, -1, -1, -1]]
