"""The typed loss batch and the per-batch context of shared quantities.

`LossBatch` is what a trainer hands to `LossStack`; `LossContext` wraps it and computes each
shared quantity (masks, clamped log-ratios, ratios, probabilities) at most once per call, so
stacking several terms does not repeat exp/log work. Read `LossBatch` first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from policy.losses.ops import clamp_log_ratio


@dataclass(frozen=True)
class LossBatch:
    """One (micro-)batch of response tokens. B sequences, T response positions, K top-K ids.

    Required tensors are (B, T). Log-probs are of the sampled token y_t.
    """

    logp: Tensor
    """(B, T) log π_θ(y_t), the model being optimised; carries the gradient."""
    old_logp: Tensor
    """(B, T) log π_old(y_t): the trainer's recomputation at the sampling parameters (detached)."""
    sampler_logp: Tensor
    """(B, T) log μ(y_t): the sampler's (inference engine's) log-prob, recorded at sampling."""
    advantages: Tensor
    """(B, T) token advantages A_t."""
    response_mask: Tensor
    """(B, T) bool or 0/1 float: 1 on response tokens that count."""
    ref_logp: Tensor | None = None
    """(B, T) log π_ref(y_t) for the KL penalty."""
    topk_logp: Tensor | None = None
    """(B, T, K) sampler top-K log-probs log μ(j) (predictive divergence mask)."""
    topk_ids: Tensor | None = None
    """(B, T, K) int64 vocabulary ids of the sampler's top-K (kept for bookkeeping)."""
    policy_topk_logp: Tensor | None = None
    """(B, T, K) log π_θ(j) at `topk_ids` (detached or not; the mask never differentiates)."""
    values: Tensor | None = None
    """(B, T) value-head predictions V_θ(s_t); carries the critic gradient."""
    old_values: Tensor | None = None
    """(B, T) values at sampling time (for value clipping)."""
    returns: Tensor | None = None
    """(B, T) value targets (e.g. GAE returns from `critic.gae`)."""
    entropy: Tensor | None = None
    """(B, T) per-token policy entropy H(π_θ(·|s_t)) with gradient (entropy bonus)."""
    versions: Tensor | None = None
    """(B,) int: how many policy versions old each rollout is (staleness metrics)."""
    global_tokens: int | Tensor | None = None
    """Valid tokens in the WHOLE optimizer step (all micro-batches, all ranks); default: this
    batch's count. Needed so micro-batching / data parallelism leave the gradient unchanged."""
    global_seqs: int | Tensor | None = None
    """Sequences with ≥ 1 valid token in the whole step; default: this batch's count."""
    dp_world_size: int = 1
    """Data-parallel ranks whose gradients DDP averages; the loss is scaled by it so the
    averaged gradient equals the full-batch gradient."""


class LossContext:
    """Lazily computed, cached quantities of one `LossBatch` (one stack call).

    Every log-ratio goes through `clamp_log_ratio`. Quantities named `*_sg` are detached.
    """

    def __init__(self, batch: LossBatch) -> None:
        self.batch = batch
        self._memo: dict[str, Tensor] = {}

    def memo(self, key: str, compute: Callable[[], Tensor]) -> Tensor:
        """Compute a term-specific shared tensor once per call (e.g. staleness endpoints)."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    @cached_property
    def valid(self) -> Tensor:
        """(B, T) bool response mask."""
        m = self.batch.response_mask
        return m if m.dtype == torch.bool else m > 0

    @cached_property
    def mask(self) -> Tensor:
        """(B, T) float response mask in the dtype of logp."""
        return self.valid.to(self.batch.logp.dtype)

    @cached_property
    def seq_len(self) -> Tensor:
        """(B,) valid tokens per sequence (float)."""
        return self.mask.sum(-1)

    @cached_property
    def n_tokens(self) -> Tensor:
        """0-d count of valid tokens in this batch (float, for local metrics)."""
        return self.seq_len.sum()

    @cached_property
    def seq_valid(self) -> Tensor:
        """(B,) float: 1 for sequences with at least one valid token."""
        return (self.seq_len > 0).to(self.mask.dtype)

    @cached_property
    def n_seqs(self) -> Tensor:
        """0-d count of sequences with at least one valid token (float)."""
        return self.seq_valid.sum()

    @cached_property
    def log_ratio(self) -> Tensor:
        """(B, T) clamp(log π − log π_old), with gradient."""
        return clamp_log_ratio(self.batch.logp - self.batch.old_logp.detach())

    @cached_property
    def ratio(self) -> Tensor:
        """(B, T) r = π/π_old, with gradient."""
        return torch.exp(self.log_ratio)

    @cached_property
    def log_ratio_mu(self) -> Tensor:
        """(B, T) clamp(log π − log μ), with gradient."""
        return clamp_log_ratio(self.batch.logp - self.batch.sampler_logp.detach())

    @cached_property
    def ratio_mu(self) -> Tensor:
        """(B, T) π/μ, with gradient."""
        return torch.exp(self.log_ratio_mu)

    @cached_property
    def mismatch_sg(self) -> Tensor:
        """(B, T) ℓ = clamp(log π_old − log μ), detached: the training/inference mismatch."""
        return clamp_log_ratio(self.batch.old_logp - self.batch.sampler_logp).detach()

    @cached_property
    def abs_mismatch_sg(self) -> Tensor:
        """(B, T) |ℓ|, detached (CARM's statistic and a shared mismatch metric)."""
        return self.mismatch_sg.abs()

    @cached_property
    def is_ratio_sg(self) -> Tensor:
        """(B, T) ρ = π_old/μ, detached (the decoupled importance weight before truncation)."""
        return torch.exp(self.mismatch_sg)

    @cached_property
    def current_mismatch_sg(self) -> Tensor:
        """(B, T) clamp(log π − log μ), detached (mask flag `use_current_policy`)."""
        return self.log_ratio_mu.detach()

    @cached_property
    def prob_sg(self) -> Tensor:
        """(B, T) π(y_t), detached."""
        return torch.exp(self.batch.logp.detach())

    @cached_property
    def sampler_prob(self) -> Tensor:
        """(B, T) μ(y_t), detached."""
        return torch.exp(self.batch.sampler_logp.detach())

    @cached_property
    def adv(self) -> Tensor:
        """(B, T) advantages, detached."""
        return self.batch.advantages.detach()

    @cached_property
    def seq_adv(self) -> Tensor:
        """(B,) mean token advantage of each sequence (its sign drives `negative_only`)."""
        return (self.adv * self.mask).sum(-1) / self.seq_len.clamp_min(1)
