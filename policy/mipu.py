"""MIPU post-update acceptance test (docs/methods.md §3.14), as pure functions.

After an update (and the sampler sync), the trainer samples a validation batch with the NEW
sampler μ_new and teacher-forces the NEW training model π_new on it:

    ρ_i    = exp(mean_t log(π_new(y_t) / μ_new(y_t)))        sequence-level mismatch ratio
    Â_i    = GRPO advantage of validation rollout i within its query's validation group
    T̂_post = −mean_i ρ_i Â_i
    accept  ⇔  T̂_post ≥ −c_k,   c_k = c_max + (c_min − c_max) · min(1, k / n_steps)   (ours)

Because Σ_i Â_i = 0 within each group, T̂_post is (minus) the covariance between the sampler
mismatch and the advantage: it is negative when the training model puts more mass than the
sampler on the rollouts that scored well, i.e. when the update's apparent gain lives in the
train-inference mismatch. With a float32 sampler ρ ≡ 1 up to rounding and every update is
accepted; the test bites with bfloat16 / int8 samplers. Read `decide` first; `MipuConfig` is
the preset's [mipu] section.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from policy.losses.ops import clamp_log_ratio


@dataclass(frozen=True)
class MipuConfig:
    """The preset's [mipu] section: acceptance threshold c_k from c_max to c_min over n_steps
    (ours). A trainer setting (`TrainConfig.mipu`), not a loss setting."""

    enabled: bool = True
    """Run the accept/rollback check after each update."""
    c_max: float = 0.05
    """Loose threshold at step 0: accept iff T̂_post ≥ −c_k."""
    c_min: float = 0.0
    """Tight threshold reached after n_steps."""
    n_steps: int = 100
    """Steps of the linear schedule (≥ 1)."""

    def __post_init__(self) -> None:
        if not self.c_max >= self.c_min >= 0:
            raise ValueError(
                f"mipu needs c_max >= c_min >= 0, got c_max={self.c_max}, c_min={self.c_min}"
            )
        if self.n_steps < 1:
            raise ValueError(f"mipu.n_steps must be >= 1, got {self.n_steps}")


def threshold(cfg: MipuConfig, step: int) -> float:
    """c_k: linear from the loose c_max at step 0 to the tight c_min at step n_steps, then flat."""
    frac = min(1.0, max(0, step) / cfg.n_steps)
    return cfg.c_max + (cfg.c_min - cfg.c_max) * frac


def sequence_log_ratio(logp_new: Tensor, sampler_logp: Tensor, mask: Tensor) -> Tensor:
    """(N,) mean_t clamp(log π_new − log μ_new) over each sequence's valid tokens (0 if empty)."""
    m = mask.to(logp_new.dtype)
    ell = clamp_log_ratio(logp_new - sampler_logp) * m
    return ell.sum(-1) / m.sum(-1).clamp_min(1)


def t_post(seq_log_ratio: Tensor, advantages: Tensor) -> Tensor:
    """T̂_post = −mean_i exp(ℓ̄_i) Â_i, with ℓ̄ from `sequence_log_ratio` (0-d)."""
    return -(torch.exp(seq_log_ratio) * advantages).mean()


@dataclass(frozen=True)
class Decision:
    accepted: bool
    t_post: float
    threshold: float


def decide(cfg: MipuConfig, step: int, t_value: float) -> Decision:
    """Accept iff T̂_post ≥ −c_k (a non-finite T̂_post is rejected)."""
    c = threshold(cfg, step)
    ok = bool(torch.isfinite(torch.tensor(t_value))) and t_value >= -c
    return Decision(accepted=ok, t_post=t_value, threshold=c)
