"""Fitting the surrogate: coalition-like training lists with replay targets, agreement
metrics, and the MSE fit. Read :func:`make_training_lists`, then :func:`fit_surrogate`.

The model itself, its frozen scorer and save/load live in :mod:`evaluator.scorers.surrogate`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from evaluator.scorers.base import DEFAULT_CHUNK, gather_docs
from evaluator.scorers.cosine import CosineScorer
from evaluator.scorers.qrels import QrelsTable
from evaluator.scorers.replay import ReplayScorer
from evaluator.scorers.surrogate import PAIR_TOL, SurrogateConfig, SurrogateNet, score_lists

__all__ = ["FitConfig", "SurrogateData", "agreement", "fit_surrogate", "make_training_lists"]


@dataclass(frozen=True)
class SurrogateData:
    """Coalition-like lists with replay targets; n lists per query, grouped by query."""

    query_ids: tuple[str, ...]
    query_emb: Tensor  # (Q, d)
    lists: Tensor  # (Q, n, K) int64 rows, −1 padding
    targets: Tensor  # (Q, n) float64 replay nDCG@K


def _pad_rows(rows: Tensor, k: int) -> Tensor:
    """(..., j) rows → (..., k), −1 padded on the right (j ≤ k: fewer candidates than K)."""
    return F.pad(rows, (0, k - rows.shape[-1]), value=-1)


def _merge_best(rows: Tensor, scores: Tensor, k: int) -> Tensor:
    """Union of candidates keeping each row's best score, sorted, top k: (..., L) → (..., k)
    (−1 padded where fewer than k candidates exist)."""
    s1, o1 = scores.sort(dim=-1, descending=True, stable=True)
    r2, o2 = rows.gather(-1, o1).sort(dim=-1, stable=True)  # first of a row-run has its best score
    s2 = s1.gather(-1, o2)
    dup = torch.zeros_like(r2, dtype=torch.bool)
    dup[..., 1:] = r2[..., 1:] == r2[..., :-1]
    top, pos = s2.masked_fill(dup, -math.inf).topk(min(k, s2.shape[-1]), dim=-1)
    return _pad_rows(r2.gather(-1, pos).masked_fill(top == -math.inf, -1), k)


def _random_subset_lists(
    cand: Tensor, cand_s: Tensor, n: int, k: int, gen: torch.Generator
) -> Tensor:
    """cand (Q, M) top-M rows by cosine → (Q, n, k): random subsets of size 1..k, sorted
    (at most M documents each: −1 padded when M < k)."""
    q, m = cand.shape
    dev = cand.device
    sizes = torch.randint(1, k + 1, (q, n, 1), generator=gen, device=dev)
    bias = 6.0 * torch.rand((q, n, 1), generator=gen, device=dev)  # 0: uniform, 6: top-heavy
    u = torch.rand((q, n, m), generator=gen, device=dev).clamp(min=1e-12)
    keys = -bias * torch.arange(m, device=dev) / m - torch.log(-torch.log(u))  # Gumbel top-s
    chosen = keys.argsort(-1, descending=True).argsort(-1) < sizes  # (Q, n, M)
    scores = torch.where(chosen, cand_s[:, None, :], -math.inf)
    top, pos = scores.topk(min(k, m), dim=-1)
    lists = cand[:, None, :].expand(q, n, m).gather(-1, pos).masked_fill(top == -math.inf, -1)
    return _pad_rows(lists, k)


def _perturbed_lists(
    query_emb: Tensor, doc_emb: Tensor, n: int, k: int, gen: torch.Generator, max_actions: int
) -> Tensor:
    """(Q, n, k) merges of 1..max_actions retrievals by noisy copies of each query."""
    q, d = query_emb.shape
    dev = query_emb.device
    n_act = torch.randint(1, max_actions + 1, (q, n, 1), generator=gen, device=dev)  # (Q, n, 1)
    sigma = 0.2 + 0.8 * torch.rand((q, n, max_actions, 1), generator=gen, device=dev)
    noise = torch.randn((q, n, max_actions, d), generator=gen, device=dev) / math.sqrt(d)
    actions = F.normalize(query_emb[:, None, None, :] + sigma * noise, dim=-1)
    out = []
    for qi in range(q):  # one query at a time bounds the (n·A, n_docs) score matrix
        # (n, A, k'): k' = min(k, n_docs), a corpus smaller than K retrieves all of it
        s, rows = (actions[qi] @ doc_emb.T).topk(min(k, doc_emb.shape[0]), dim=-1)
        s = s.masked_fill(
            torch.arange(max_actions, device=dev)[None, :, None] >= n_act[qi, :, :, None], -math.inf
        )
        out.append(_merge_best(rows.reshape(n, -1), s.reshape(n, -1), k))
    return torch.stack(out)


def make_training_lists(
    query_ids: Sequence[str],
    query_emb: Tensor,
    doc_emb: Tensor,
    qrels: QrelsTable,
    *,
    k: int,
    n_lists_per_query: int,
    seed: int,
    n_candidates: int = 50,
    perturbed_share: float = 0.5,
    max_actions: int = 5,
) -> SurrogateData:
    """Coalition-like lists for judged queries, with replay nDCG@K targets.

    Two kinds, per query (deterministic given ``seed``):

    - random subsets: from the top-``n_candidates`` docs by exact cosine, a random subset of
      size 1..K drawn by Gumbel-top-s with a random bias toward the top ranks, sorted by cosine
      (coalition merges sort by retrieval score);
    - perturbed merges (share ``perturbed_share``): 1..``max_actions`` "rewrites" = the query
      plus Gaussian noise of norm ≈ σ ~ U(0.2, 1.0), renormalised; each retrieves its top K by
      exact cosine over ``doc_emb``; the union keeps each doc's best score, sorted, top K —
      exactly how a coalition's list is built from its actions.

    A corpus (or ``n_candidates``) smaller than K gives shorter lists, −1 padded to K (as a
    retriever pads them); with at least K of both, the lists do not depend on the padding.
    """
    if not 0.0 <= perturbed_share <= 1.0 or n_lists_per_query < 1:
        raise ValueError("need 0 ≤ perturbed_share ≤ 1 and n_lists_per_query ≥ 1")
    gen = torch.Generator(device=doc_emb.device).manual_seed(seed)
    qe = query_emb.to(doc_emb.device, doc_emb.dtype)
    n_pert = round(perturbed_share * n_lists_per_query)
    cand_s, cand = (qe @ doc_emb.T).topk(min(n_candidates, doc_emb.shape[0]), dim=-1)
    parts = [_random_subset_lists(cand, cand_s, n_lists_per_query - n_pert, k, gen)]
    if n_pert:
        parts.append(_perturbed_lists(qe, doc_emb, n_pert, k, gen, max_actions))
    lists = torch.cat(parts, dim=1)  # (Q, n, K)
    targets = ReplayScorer(qrels, k=k, device=doc_emb.device).score(query_ids, qe, lists)
    return SurrogateData(tuple(query_ids), qe, lists, targets)


def _average_ranks(x: Tensor) -> Tensor:
    """Ranks of a 1-D tensor with ties sharing their average rank (float64)."""
    sorted_x, order = x.sort()
    _, inverse, counts = torch.unique_consecutive(sorted_x, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).to(torch.float64)
    avg = ends - (counts.to(torch.float64) + 1.0) / 2.0  # 0-based average rank of each run
    ranks = torch.empty_like(avg[inverse])
    ranks[order] = avg[inverse]
    return ranks


def _pearson(a: Tensor, b: Tensor) -> Tensor:
    a, b = a - a.mean(), b - b.mean()
    denom: Tensor = torch.linalg.vector_norm(a) * torch.linalg.vector_norm(b)
    return (a * b).sum() / denom.clamp(min=1e-12)


def agreement(pred: Tensor, target: Tensor) -> dict[str, Tensor]:
    """Agreement of predictions with replay on grouped lists: pred, target (Q, n).

    ``pearson`` / ``spearman`` (tie-averaged ranks) over all lists; ``pair_sign``: over list
    pairs of the SAME query with |Δ target| > PAIR_TOL, the share where sign(Δ pred) =
    sign(Δ target) — what Shapley marginals need; ``n_pairs`` counts those pairs.
    """
    p, t = pred.to(torch.float64), target.to(torch.float64)
    dp = p[:, :, None] - p[:, None, :]  # (Q, n, n)
    dt = t[:, :, None] - t[:, None, :]
    upper = torch.ones_like(dt, dtype=torch.bool).triu(1)
    valid = upper & (dt.abs() > PAIR_TOL)
    same = (torch.sign(dp) == torch.sign(dt)) & valid
    return {
        "pearson": _pearson(p.flatten(), t.flatten()),
        "spearman": _pearson(_average_ranks(p.flatten()), _average_ranks(t.flatten())),
        "pair_sign": same.sum() / valid.sum().clamp(min=1),
        "n_pairs": valid.sum(),
    }


@dataclass(frozen=True)
class FitConfig:
    """Optimisation settings of :func:`fit_surrogate`."""

    epochs: int = 20
    lr: float = 2e-3
    batch: int = 256
    weight_decay: float = 1e-4
    hidden: int = 128
    seed: int = 0
    chunk: int = DEFAULT_CHUNK
    """Lists per forward when evaluating."""
    select_best: bool = True
    """Keep the epoch with the lowest validation MSE (the fit overfits small training sets)."""

    def __post_init__(self) -> None:
        if min(self.epochs, self.batch, self.hidden, self.chunk) < 1 or self.lr <= 0:
            raise ValueError(f"epochs, batch, hidden, chunk must be ≥ 1 and lr > 0: {self}")


def _evaluate(model: SurrogateNet, data: SurrogateData, doc_emb: Tensor, chunk: int) -> Tensor:
    q, n, k = data.lists.shape
    with torch.no_grad():
        flat_q = data.query_emb.repeat_interleave(n, dim=0)
        return score_lists(model, flat_q, doc_emb, data.lists.reshape(q * n, k), chunk).view(q, n)


def _prefixed(prefix: str, pred: Tensor, target: Tensor) -> dict[str, Tensor]:
    return {f"{prefix}_{name}": v for name, v in agreement(pred, target).items()}


def _train(
    model: SurrogateNet,
    data: tuple[SurrogateData, SurrogateData],
    doc_emb: Tensor,
    config: FitConfig,
    progress: Callable[[int, dict[str, float]], None] | None,
) -> int:
    """Minibatch AdamW on the MSE to the replay targets, in place; returns the kept epoch.

    With ``config.select_best`` the weights of the epoch with the lowest validation MSE are
    restored at the end (early stopping by model selection), else the last epoch's are kept.
    """
    train, val = data
    dev = doc_emb.device
    q, n, k = train.lists.shape
    gen = torch.Generator(device=dev).manual_seed(config.seed)
    flat_q = train.query_emb.to(dev).repeat_interleave(n, dim=0)  # (L, d)
    flat_lists = train.lists.to(dev).reshape(q * n, k)  # (L, K)
    flat_t = train.targets.to(dev, torch.float32).reshape(-1)  # (L,)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    best = (math.inf, config.epochs - 1, copy.deepcopy(model.state_dict()))
    for epoch in range(config.epochs):
        model.train()
        perm = torch.randperm(flat_t.numel(), generator=gen, device=dev)
        total = torch.zeros((), device=dev)
        for i in range(0, perm.numel(), config.batch):
            idx = perm[i : i + config.batch]
            docs, mask = gather_docs(doc_emb, flat_lists[idx])
            loss = F.mse_loss(model(flat_q[idx], docs, mask), flat_t[idx])
            opt.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)
            opt.step()
            total += loss.detach() * idx.numel()
        model.eval()
        val_mse = float(((_evaluate(model, val, doc_emb, config.chunk) - val.targets) ** 2).mean())
        if config.select_best and val_mse < best[0]:
            best = (val_mse, epoch, copy.deepcopy(model.state_dict()))
        if progress is not None:
            progress(epoch, {"loss": float(total) / perm.numel(), "val_mse": val_mse})
    if config.select_best:
        model.load_state_dict(best[2])
    return best[1]


def fit_surrogate(
    train: SurrogateData,
    val: SurrogateData,
    *,
    doc_emb: Tensor,
    config: FitConfig = FitConfig(),
    progress: Callable[[int, dict[str, float]], None] | None = None,
) -> tuple[SurrogateNet, dict[str, float]]:
    """Fit a :class:`SurrogateNet` to replay targets (MSE, AdamW) on ``doc_emb.device``.

    Returns the model (eval mode, not yet frozen: wrap it in :class:`SurrogateScorer`) and
    metrics: ``{before,after,cosine}_{pearson,spearman,pair_sign,n_pairs}`` on ``val``
    (untrained net, fitted net, zero-shot cosine scorer), ``train_after_pearson``, ``val_mse``,
    ``n_params``, ``best_epoch``. ``progress(epoch, {"loss": mean train MSE, "val_mse": ...})``
    is called after each epoch. With ``select_best`` (default) ``val`` also selects the epoch,
    so its "after" numbers are slightly optimistic: report on a third split.
    """
    dev, k = doc_emb.device, train.lists.shape[-1]
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(config.seed)
        net_config = SurrogateConfig(dim=doc_emb.shape[1], hidden=config.hidden, k_max=k)
        model = SurrogateNet(net_config).to(dev)
    metrics = _prefixed("before", _evaluate(model, val, doc_emb, config.chunk), val.targets)
    cosine = CosineScorer(doc_emb, k=k, device=dev, doc_fingerprint="fit")
    cos_val = cosine.score(val.query_ids, val.query_emb, val.lists)
    metrics |= _prefixed("cosine", cos_val, val.targets)
    best_epoch = _train(model, (train, val), doc_emb, config, progress)
    pred_val = _evaluate(model, val, doc_emb, config.chunk)
    metrics |= _prefixed("after", pred_val, val.targets)
    train_pred = _evaluate(model, train, doc_emb, config.chunk)
    metrics["train_after_pearson"] = agreement(train_pred, train.targets)["pearson"]
    metrics["val_mse"] = ((pred_val.to(torch.float64) - val.targets) ** 2).mean()
    out = {name: float(value) for name, value in metrics.items()}
    out["n_params"] = float(sum(p.numel() for p in model.parameters()))
    out["best_epoch"] = float(best_epoch)
    return model, out
