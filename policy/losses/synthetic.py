"""Synthetic `LossBatch` for tests and benchmarks: every field filled, seeded.

Log-probs are ≤ 0 with a controllable train/inference mismatch; `logp`, `values` and
`entropy` are leaf tensors with requires_grad so callers can read their `.grad`.
"""

from __future__ import annotations

import torch

from policy.losses.batch import LossBatch


def synthetic_batch(
    batch: int,
    horizon: int,
    topk: int = 4,
    *,
    seed: int = 0,
    drift: float = 0.05,
    step: float = 0.05,
    dtype: torch.dtype = torch.float32,
) -> LossBatch:
    """Random batch: B = batch, T = horizon, K = topk; responses left-aligned, lengths ≥ T/2.

    drift: std of log π_old − log μ; step: std of log π − log π_old.
    """
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype)

    b, t = batch, horizon
    sampler = -torch.empty(b, t, dtype=dtype).exponential_(1.0, generator=g)  # log μ ≤ 0
    old = (sampler + drift * randn(b, t)).clamp(max=0)
    logp = (old + step * randn(b, t)).clamp(max=0).requires_grad_(True)
    lengths = torch.randint(max(1, t // 2), t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    adv = randn(b, 1) + 0.3 * randn(b, t)
    mu_top = torch.softmax(randn(b, t, topk + 1), -1)[..., :topk]
    pi_top = torch.softmax(torch.log(mu_top) + step * randn(b, t, topk), -1) * mu_top.sum(-1, True)
    values = randn(b, t).requires_grad_(True)
    return LossBatch(
        logp=logp,
        old_logp=old,
        sampler_logp=sampler,
        advantages=adv,
        response_mask=mask,
        ref_logp=(old + 0.1 * randn(b, t)).clamp(max=0),
        topk_logp=mu_top.log(),
        topk_ids=torch.randint(0, 1000, (b, t, topk), generator=g),
        policy_topk_logp=pi_top.log(),
        values=values,
        old_values=values.detach() + 0.1 * randn(b, t),
        returns=randn(b, t),
        entropy=torch.rand(b, t, generator=g, dtype=dtype).requires_grad_(True),
        versions=torch.randint(0, 4, (b,), generator=g),
    )
