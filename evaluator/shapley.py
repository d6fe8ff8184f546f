"""Exact Shapley credit for small cooperative games, batched (docs/methods.md §1).

A game on ``n`` players is a value table ``v`` of shape ``(..., 2**n)`` indexed by coalition
bitmask: bit ``j`` of the index is set iff player (action) ``j`` is in the coalition, so
``v[..., 0] = v(∅)`` and ``v[..., 2**n - 1] = v(N)``.

Read :func:`exact_shapley` first: the Shapley value is a linear map of the value table,

    φ_j = Σ_{S ⊆ N∖{j}} w(|S|) · (v(S ∪ {j}) − v(S)),   w(s) = s!(n−s−1)!/n!,

so it is one precomputed ``(2**n, n)`` matrix ``W`` (cached per ``n`` and device) applied with a
single matmul to a whole batch of games: ``φ = v @ W`` with ``W[S, j] = +w(|S|−1)`` if
``j ∈ S`` and ``−w(|S|)`` if ``j ∉ S``. :func:`shapley_interaction` does the same for the
pairwise Shapley interaction index. The baselines (:func:`broadcast`, :func:`singleton`,
:func:`leave_one_out`) and the slow reference :func:`shapley_by_permutations` (tests and the
benchmark compare against it) sit beside them. Everything returns float64.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache

import torch

from evaluator.limits import MAX_PLAYERS  # re-exported: the one limit of the game

__all__ = [
    "MAX_PERMUTATION_PLAYERS",
    "MAX_PLAYERS",
    "broadcast",
    "coalition_masks",
    "coalition_sizes",
    "efficiency_residual",
    "exact_shapley",
    "leave_one_out",
    "popcount",
    "shapley_by_permutations",
    "shapley_interaction",
    "shapley_weight_matrix",
    "singleton",
]

MAX_PERMUTATION_PLAYERS = 8
"""Largest game for the slow permutation reference: 8! = 40320 orderings is already slow."""


def _check_n_players(n_players: int, limit: int = MAX_PLAYERS) -> None:
    if not 1 <= n_players <= limit:
        msg = (
            f"n_players must be in [1, {limit}], got {n_players}: exact Shapley enumerates all "
            f"2**n coalitions (see MAX_PLAYERS); use a sampling estimator for larger games."
        )
        raise ValueError(msg)


def _as_value_table(values: torch.Tensor, n_players: int) -> torch.Tensor:
    """Validate a ``(..., 2**n)`` value table and return it as float64."""
    _check_n_players(n_players)
    if values.ndim < 1 or values.shape[-1] != 2**n_players:
        msg = (
            f"values must have last dimension 2**n_players = {2**n_players} (one entry per "
            f"coalition bitmask), got shape {tuple(values.shape)}"
        )
        raise ValueError(msg)
    return values.to(torch.float64)


def popcount(x: torch.Tensor) -> torch.Tensor:
    """Number of set bits of each entry of a non-negative int64 tensor (< 2**32)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return (x * 0x01010101 & 0xFFFFFFFF) >> 24


def coalition_masks(n_players: int, device: torch.device | None = None) -> torch.Tensor:
    """Membership matrix ``(2**n, n)`` bool: ``[S, j]`` is True iff bit ``j`` of ``S`` is set."""
    bits = torch.arange(2**n_players, device=device, dtype=torch.int64)  # (2^n,)
    players = torch.arange(n_players, device=device, dtype=torch.int64)  # (n,)
    return ((bits[:, None] >> players[None, :]) & 1).bool()


def coalition_sizes(n_players: int, device: torch.device | None = None) -> torch.Tensor:
    """Coalition sizes ``|S|`` for every bitmask ``S`` in ``0..2**n - 1``, shape ``(2**n,)``."""
    return popcount(torch.arange(2**n_players, device=device, dtype=torch.int64))


def _weight_table(n_free: int) -> torch.Tensor:
    """``w(s) = s!(n_free−s)!/(n_free+1)!`` for ``s = 0..n_free``, float64 (exact integers).

    ``n_free = n−1`` gives the Shapley weights; ``n_free = n−2`` the pairwise interaction ones.
    """
    denom = math.factorial(n_free + 1)
    return torch.tensor(
        [math.factorial(s) * math.factorial(n_free - s) / denom for s in range(n_free + 1)],
        dtype=torch.float64,
    )


@lru_cache(maxsize=64)
def shapley_weight_matrix(n_players: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``(2**n, n)`` float64 matrix ``W`` with ``φ = v @ W`` (cached; do not modify).

    ``W[S, j] = w(|S|−1)`` if ``j ∈ S`` else ``−w(|S|)``, with ``w(s) = s!(n−s−1)!/n!``.
    Column ``j`` is φ_j written as a linear functional of the value table.
    """
    _check_n_players(n_players)
    member = coalition_masks(n_players)  # (2^n, n)
    sizes = coalition_sizes(n_players)[:, None]  # (2^n, 1)
    w = _weight_table(n_players - 1)  # (n,) indexed by s = 0..n-1
    w_in = w[(sizes - 1).clamp(min=0)]  # (2^n, 1): weight when j ∈ S (|S| ≥ 1 there)
    w_out = w[sizes.clamp(max=n_players - 1)]  # (2^n, 1): weight when j ∉ S (|S| ≤ n-1 there)
    return torch.where(member, w_in, -w_out).to(device)


@lru_cache(maxsize=64)
def _interaction_matrix(n_players: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``(2**n, n*n)`` float64 matrix with ``I = (v @ M).reshape(n, n)`` (cached).

    ``I_jk = Σ_{T ⊆ N∖{j,k}} c(|T|) Δ_jk v(T)`` with ``c(t) = t!(n−t−2)!/(n−1)!`` and
    ``Δ_jk v(T) = v(T∪{j,k}) − v(T∪{j}) − v(T∪{k}) + v(T)``. Coalition ``S`` enters with sign
    ``(−1)^(|{j,k} ∖ S|)`` and weight ``c(|S ∖ {j,k}|)``; the diagonal is 0.
    """
    n = n_players
    member = coalition_masks(n).long()  # (2^n, n)
    if n < 2:
        return torch.zeros(2**n, n * n, dtype=torch.float64, device=device)
    c = _weight_table(n - 2)  # (n-1,) indexed by t = 0..n-2
    n_in = member[:, :, None] + member[:, None, :]  # (2^n, n, n): |{j,k} ∩ S| for j != k
    rest = coalition_sizes(n)[:, None, None] - n_in  # (2^n, n, n): |S ∖ {j,k}|
    sign = 1.0 - 2.0 * ((2 - n_in) % 2).double()  # (−1)^(number of {j,k} missing from S)
    matrix = sign * c[rest.clamp(0, n - 2)]  # (2^n, n, n)
    off_diagonal = ~torch.eye(n, dtype=torch.bool)
    return (matrix * off_diagonal).reshape(2**n, n * n).to(device)


def exact_shapley(values: torch.Tensor, n_players: int) -> torch.Tensor:
    """Exact Shapley values of a batch of games.

    Args:
        values: ``(..., 2**n)`` value tables indexed by coalition bitmask (bit j = player j).
        n_players: ``n``, in ``[1, MAX_PLAYERS]``.

    Returns:
        ``(..., n)`` float64 Shapley values; ``Σ_j φ_j = v(N) − v(∅)`` (efficiency).
    """
    table = _as_value_table(values, n_players)  # (..., 2^n)
    return table @ shapley_weight_matrix(n_players, table.device)  # (..., n)


def efficiency_residual(values: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """``Σ_j φ_j − (v(N) − v(∅))``, shape ``(...)``; zero up to rounding for exact Shapley."""
    table = values.to(torch.float64)  # (..., 2^n)
    return phi.to(torch.float64).sum(-1) - (table[..., -1] - table[..., 0])


def broadcast(values: torch.Tensor, n_players: int) -> torch.Tensor:
    """Broadcast credit: every action gets the set's reward ``v(N)``, shape ``(..., n)``.

    This is the ablation "the whole rollout's reward for every action" (what GRPO does
    implicitly). We give ``v(N)``, not ``v(N) − v(∅)``: for metric evaluators ``v(∅) = 0`` and
    the two agree; subtract ``values[..., :1]`` yourself to get the centred variant.
    Unlike the other baselines it does not satisfy efficiency for ``n > 1``.
    """
    table = _as_value_table(values, n_players)
    return table[..., -1:].expand(*table.shape[:-1], n_players).clone()


def singleton(values: torch.Tensor, n_players: int) -> torch.Tensor:
    """Singleton credit ``v({j}) − v(∅)``, shape ``(..., n)``."""
    table = _as_value_table(values, n_players)
    solo = 1 << torch.arange(n_players, device=table.device)  # (n,) bitmasks of {j}
    return table[..., solo] - table[..., :1]


def leave_one_out(values: torch.Tensor, n_players: int) -> torch.Tensor:
    """Leave-one-out credit ``v(N) − v(N ∖ {j})``, shape ``(..., n)``."""
    table = _as_value_table(values, n_players)
    full = 2**n_players - 1
    without = full ^ (1 << torch.arange(n_players, device=table.device))  # (n,) N ∖ {j}
    return table[..., -1:] - table[..., without]


def shapley_interaction(values: torch.Tensor, n_players: int) -> torch.Tensor:
    """Pairwise Shapley interaction index, shape ``(..., n, n)``, symmetric, zero diagonal.

    ``I_jk = Σ_{S ⊆ N∖{j,k}} |S|!(n−|S|−2)!/(n−1)! · (v(S∪{j,k}) − v(S∪{j}) − v(S∪{k}) + v(S))``.
    Negative for redundant actions (either one alone does the job), positive for
    complementary ones (only the pair does).
    """
    table = _as_value_table(values, n_players)  # (..., 2^n)
    flat = table @ _interaction_matrix(n_players, table.device)  # (..., n*n)
    return flat.reshape(*table.shape[:-1], n_players, n_players)


def shapley_by_permutations(values: torch.Tensor, n_players: int) -> torch.Tensor:
    """Slow, obvious reference: average marginal contribution over all n! orderings.

    Only for tests and the benchmark (``n ≤ MAX_PERMUTATION_PLAYERS``). Shape ``(..., n)``.
    """
    _check_n_players(n_players, MAX_PERMUTATION_PLAYERS)
    table = _as_value_table(values, n_players)
    phi = torch.zeros(*table.shape[:-1], n_players, dtype=torch.float64, device=table.device)
    orderings = list(itertools.permutations(range(n_players)))
    for order in orderings:
        coalition = 0
        for player in order:
            joined = coalition | (1 << player)
            phi[..., player] += table[..., joined] - table[..., coalition]
            coalition = joined
    return phi / len(orderings)
