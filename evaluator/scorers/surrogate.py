"""The frozen neural set scorer ("surrogate"): its model, frozen scorer, save and load.

Read :class:`SurrogateNet` first; the fit lives in :mod:`evaluator.scorers.surrogate_fit`.

Model (≈ 100K parameters at d = 384, hidden = 128). For each rank r of a list of K slots:

    x_r = [q ⊙ d_r, cos(q, d_r), 1/log2(r+1)]                     (d + 2)
    h_r = MLP(W x_r + pos_emb[r])                                  (H)
    c_r = head([h_r, masked_mean_r h_r])                           (per-item contribution)
    z   = Σ_r valid_r · softplus(c_r) / log2(r + 1)                (DCG-weighted sum, ≥ 0)
    v   = 1 − exp(−z) ∈ [0, 1)

The masked mean is the set context (it lets one item's contribution depend on the rest of the
list). An all-padding list has z = 0, so **v(∅) = 0 exactly**, as for replay. Inserting a doc
shifts later docs to smaller weights, so the model can express nDCG's "pushed down" losses.

Training targets are replay nDCG@K of coalition-like lists (see :func:`make_training_lists`);
the fit minimises the MSE and reports held-out agreement with replay before and after fitting.
Save/load write ``<path>.safetensors`` + ``<path>.json`` (config + weights hash); the loaded
:class:`SurrogateScorer` is frozen: ``eval()``, ``requires_grad_(False)``, ``inference_mode``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from evaluator.artifacts import ArtifactError, atomic_file, atomic_write_text, check_safetensors
from evaluator.scorers.base import (
    DEFAULT_CHUNK,
    SetScorer,
    check_lists,
    chunked,
    discounts,
    gather_docs,
    stable_hash,
    tensor_fingerprint,
)
from evaluator.scorers.registry import ScorerSpec, need, register_scorer

__all__ = [
    "SurrogateConfig",
    "SurrogateNet",
    "SurrogateScorer",
    "load_surrogate",
    "load_surrogate_model",
    "save_surrogate",
    "score_lists",
    "weights_hash",
]

FORMAT_VERSION = 1
KIND = "surrogate evaluator"  # a damaged one is refused (never used) and must be re-fitted
REFIT = "it cannot be repaired: fit it again with `casi evaluator fit`"
PAIR_TOL = 1e-9
"""|Δ target| at or below this is a tie: such list pairs are left out of the sign agreement."""


@dataclass(frozen=True)
class SurrogateConfig:
    """Architecture of :class:`SurrogateNet`."""

    dim: int = 384
    """Embedding dimension d (MiniLM: 384)."""
    hidden: int = 128
    """Width H of the per-item MLP."""
    k_max: int = 10
    """Number of learned rank positions; a scorer's K must be ≤ k_max."""

    def __post_init__(self) -> None:
        if min(self.dim, self.hidden, self.k_max) < 1:
            raise ValueError(f"dim, hidden and k_max must be ≥ 1, got {self}")


class SurrogateNet(nn.Module):
    """(query, list of doc embeddings with ranks) → value in [0, 1); see the module docstring."""

    def __init__(self, config: SurrogateConfig) -> None:
        super().__init__()
        self.config = config
        hid = config.hidden
        self.item = nn.Linear(config.dim + 2, hid)
        self.pos = nn.Embedding(config.k_max, hid)
        self.mix = nn.Sequential(nn.GELU(), nn.Linear(hid, hid), nn.GELU())
        self.head = nn.Sequential(nn.Linear(2 * hid, hid), nn.GELU(), nn.Linear(hid, 1))

    def forward(self, query: Tensor, docs: Tensor, mask: Tensor) -> Tensor:
        """query (N, d), docs (N, K, d), mask (N, K) bool → (N,) values."""
        k = docs.shape[1]
        if k > self.config.k_max:
            raise ValueError(f"list length {k} > k_max = {self.config.k_max} of this surrogate")
        prod = docs * query[:, None, :]  # (N, K, d)
        cos = prod.sum(-1, keepdim=True)  # (N, K, 1)
        disc = discounts(k, docs.device).to(docs.dtype)  # (K,)
        feats = torch.cat([prod, cos, disc[None, :, None].expand_as(cos)], dim=-1)
        h = self.mix(self.item(feats) + self.pos.weight[:k])  # (N, K, H)
        m = mask[..., None].to(h.dtype)  # (N, K, 1)
        ctx = (h * m).sum(1) / m.sum(1).clamp(min=1.0)  # (N, H); 0 for an empty list
        c = self.head(torch.cat([h, ctx[:, None, :].expand_as(h)], dim=-1)).squeeze(-1)
        z = (F.softplus(c) * disc * mask).sum(-1)  # (N,) ≥ 0
        return 1.0 - torch.exp(-z)

    def forward_rows(self, query: Tensor, qrow: Tensor, doc_emb: Tensor, lists: Tensor) -> Tensor:
        """:meth:`forward` of lists (N, K) of doc rows whose query is ``query[qrow]`` (N,), factored
        for many lists of few queries (a credit batch): the first layer is linear in
        (q ⊙ d, cos), so it runs once per distinct (query, document) pair; the head's first layer
        runs its set-context half once per list. Same values as ``forward`` up to rounding."""
        n_docs, (_, k) = doc_emb.shape[0], lists.shape
        if k > self.config.k_max:
            raise ValueError(f"list length {k} > k_max = {self.config.k_max} of this surrogate")
        mask = lists >= 0  # (N, K)
        pair, inv = torch.unique(qrow[:, None] * n_docs + lists.clamp(min=0), return_inverse=True)
        prod = query[pair // n_docs] * doc_emb[pair % n_docs]  # (P, d) distinct pairs only
        w, d = self.item.weight, prod.shape[1]  # (H, d + 2)
        pre = prod @ w[:, :d].T + prod.sum(-1, keepdim=True) * w[:, d] + self.item.bias  # (P, H)
        disc = discounts(k, lists.device).to(prod.dtype)  # (K,)
        h = self.mix(pre[inv] + disc[:, None] * w[:, d + 1] + self.pos.weight[:k])  # (N, K, H)
        m = mask[..., None].to(h.dtype)
        ctx = (h * m).sum(1) / m.sum(1).clamp(min=1.0)  # (N, H)
        lin, act, out = self.head.children()
        assert isinstance(lin, nn.Linear)
        hid = h.shape[-1]
        first = h @ lin.weight[:, :hid].T + (ctx @ lin.weight[:, hid:].T + lin.bias)[:, None, :]
        c = out(act(first)).squeeze(-1)  # (N, K)
        z = (F.softplus(c) * disc * mask).sum(-1)
        return 1.0 - torch.exp(-z)


def score_lists(
    model: SurrogateNet, query_emb: Tensor, doc_emb: Tensor, lists: Tensor, chunk: int
) -> Tensor:
    """query_emb (N, d), lists (N, K) rows → (N,) model values, ``chunk`` lists per forward."""

    def forward(q: Tensor, rows: Tensor) -> Tensor:
        return model(q, *gather_docs(doc_emb, rows))  # type: ignore[no-any-return]

    return chunked(forward, chunk, query_emb, lists)


def weights_hash(model: nn.Module) -> str:
    """Content hash of the state dict (names, shapes, dtypes, bytes)."""
    state = model.state_dict()
    return stable_hash("weights", *(f"{n}:{tensor_fingerprint(state[n])}" for n in sorted(state)))


class SurrogateScorer:
    """Frozen :class:`SurrogateNet` behind the SetScorer protocol (holds a private copy)."""

    name = "surrogate"
    uses_query_emb = True

    def __init__(
        self,
        model: SurrogateNet,
        *,
        doc_emb: Tensor,
        k: int,
        device: torch.device | str = "cpu",
        chunk: int = DEFAULT_CHUNK,
        doc_fingerprint: str | None = None,
    ) -> None:
        if not 1 <= k <= model.config.k_max or chunk < 1:
            raise ValueError(f"need 1 ≤ k ≤ k_max={model.config.k_max} and chunk ≥ 1, got {k}")
        self.k, self.chunk, self.device = k, chunk, torch.device(device)
        self.model = copy.deepcopy(model).to(self.device).eval().requires_grad_(False)
        self.doc_emb = doc_emb.to(self.device, torch.float32)
        self.weights_version = weights_hash(self.model)
        fingerprint = doc_fingerprint or tensor_fingerprint(doc_emb)
        self.version = stable_hash("surrogate", self.weights_version, str(k), fingerprint)

    def score(self, query_ids: Sequence[str], query_emb: Tensor, lists: Tensor) -> Tensor:
        lists_k = check_lists(query_ids, query_emb, lists, self.k).to(self.device)
        q, c, kk = lists_k.shape
        first: dict[str, int] = {}  # query id → its first row (same id ⇒ same query)
        for i, qid in enumerate(query_ids):
            first.setdefault(qid, i)
        order = {qid: j for j, qid in enumerate(first)}
        row_of = [order[qid] for qid in query_ids]
        with torch.inference_mode():
            pick = torch.tensor(list(first.values()), device=self.device)
            queries = query_emb.to(self.device, torch.float32)[pick]  # (Qd, d)
            qrow = torch.tensor(row_of, device=self.device).repeat_interleave(c)  # (Q·C,)
            values = chunked(
                lambda qr, ls: self.model.forward_rows(queries, qr, self.doc_emb, ls),
                self.chunk,
                qrow,
                lists_k.reshape(q * c, kk),
            )
        # clone outside inference mode: callers may use the values in autograd graphs
        return values.clone().to(torch.float64).reshape(q, c).to(lists.device)


def _meta_path(path: Path) -> Path:
    return path.with_suffix(".json")


def save_surrogate(model: SurrogateNet, path: str | Path) -> str:
    """Write ``path`` (.safetensors) and its .json meta (config + weights hash); return the hash."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    with atomic_file(path) as tmp:  # never a half-written file under the real name
        save_file(state, str(tmp))
    version = weights_hash(model)
    meta = {"format": FORMAT_VERSION, "config": asdict(model.config), "version": version}
    atomic_write_text(_meta_path(path), json.dumps(meta, indent=2, sort_keys=True))
    return version


def load_surrogate_model(path: str | Path, device: torch.device | str = "cpu") -> SurrogateNet:
    """Read a saved model, check its weights hash, return it frozen (eval, no grad)."""
    path = Path(path)
    if not path.is_file() or not _meta_path(path).is_file():
        raise FileNotFoundError(f"surrogate weights {path} or meta {_meta_path(path)} missing")
    try:
        meta = json.loads(_meta_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise ArtifactError(_meta_path(path), "unreadable JSON", kind=KIND, fix=REFIT) from None
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: format {meta.get('format')} ≠ supported {FORMAT_VERSION}")
    model = SurrogateNet(SurrogateConfig(**meta["config"]))
    check_safetensors(path, kind=KIND, fix=REFIT)  # truncated or padded: refused before reading
    try:
        model.load_state_dict(load_file(str(path)), strict=True)
    except (SafetensorError, RuntimeError) as exc:
        raise ArtifactError(
            path, f"unreadable ({type(exc).__name__})", kind=KIND, fix=REFIT
        ) from None
    if weights_hash(model) != meta["version"]:
        raise ArtifactError(
            path, f"weights hash ≠ {meta['version']} in the meta", kind=KIND, fix=REFIT
        )
    return model.to(device).eval().requires_grad_(False)


def load_surrogate(
    path: str | Path,
    *,
    doc_emb: Tensor,
    k: int,
    device: torch.device | str = "cpu",
    chunk: int = DEFAULT_CHUNK,
    doc_fingerprint: str | None = None,
) -> SurrogateScorer:
    """Load a saved surrogate as a frozen :class:`SurrogateScorer`."""
    model = load_surrogate_model(path, device)
    return SurrogateScorer(
        model, doc_emb=doc_emb, k=k, device=device, chunk=chunk, doc_fingerprint=doc_fingerprint
    )


@register_scorer("surrogate")
def _build_surrogate(spec: ScorerSpec) -> SetScorer:
    return load_surrogate(
        need(spec.surrogate_path, "surrogate_path (a fitted *.safetensors)", "surrogate"),
        doc_emb=need(spec.doc_emb, "doc_emb", "surrogate"),
        k=spec.k,
        device=spec.device,
        chunk=spec.chunk,
        doc_fingerprint=spec.doc_fingerprint,
    )
