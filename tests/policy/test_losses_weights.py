# mypy: disable-error-code="no-untyped-call"
# (torch.Tensor.backward is unannotated)
"""Importance weights (TIS, IcePop), sequence masks (GeoMean, CARM), DPPO masks, the
predictive top-K mask, DRPO and SPO: closed forms on hand-made tokens."""

from __future__ import annotations

import math

import torch
from torch.testing import assert_close

from policy.losses import (
    ClipConfig,
    ISConfig,
    LossBatch,
    LossContext,
    LossStack,
    SeqMaskConfig,
    StackConfig,
    get_term,
)
from policy.losses.dppo import dppo_kl_keep, dppo_tv_keep, predictive_divergence
from policy.losses.masks import carm_out_of_band_bound

F64 = torch.float64


def _batch(
    logp: torch.Tensor,
    old: torch.Tensor,
    sampler: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> LossBatch:
    return LossBatch(
        logp=logp.clone().requires_grad_(True),
        old_logp=old,
        sampler_logp=sampler,
        advantages=adv,
        response_mask=torch.ones_like(logp, dtype=torch.bool) if mask is None else mask,
    )


def test_tis_token_weights_are_truncated_at_c_and_carry_no_gradient() -> None:
    rho = torch.tensor([[0.5, 1.5, 3.0, 10.0]], dtype=F64)
    old = torch.full_like(rho, -1.0).requires_grad_(True)
    sampler = (old.detach() - rho.log()).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 2.0, 1.0]], dtype=F64)
    b = LossBatch(
        logp=old.detach().clone().requires_grad_(True),  # r = π/π_old = 1
        old_logp=old,
        sampler_logp=sampler,
        advantages=adv,
        response_mask=torch.ones_like(rho, dtype=torch.bool),
    )
    loss, m = LossStack(StackConfig(terms=("tis_token",)))(b)
    loss.backward()
    w = rho.clamp(max=2.0)
    assert_close(loss, (-adv * w).mean())
    assert b.logp.grad is not None
    assert_close(b.logp.grad, -adv * w / 4)
    assert old.grad is None and sampler.grad is None  # weights are stop-gradient
    assert_close(m["tis_token/truncated_frac"], torch.tensor(0.5, dtype=F64))
    assert_close(m["tis_token/ess"], (w.sum() ** 2 / (4 * (w * w).sum())))


def test_tis_seq_and_icepop_weights() -> None:
    ell = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 0.5]], dtype=F64)  # log π_old − log μ
    old = torch.full_like(ell, -1.0)
    ctx = LossContext(_batch(old, old, old - ell, torch.ones_like(ell)))
    cfg = StackConfig(importance=ISConfig(tis_seq_cap=2.0, icepop_low=0.5, icepop_high=1.5))
    w_seq = get_term("tis_seq")(ctx, cfg).token_weight
    assert w_seq is not None
    assert_close(w_seq[:, 0], torch.tensor([math.exp(0.6), 2.0], dtype=F64))
    w_ice = get_term("icepop")(ctx, cfg).token_weight
    rho = ell.exp()
    assert_close(w_ice, torch.where(rho <= 1.5, rho, torch.zeros_like(rho)))


def _mask_cfg(tau: float, mode: str = "all", **kw: bool) -> StackConfig:
    return StackConfig(seq_mask=SeqMaskConfig(tau=tau, mode=mode, **kw))


def test_geomean_keeps_opposite_drifts_that_carm_masks() -> None:
    ell = torch.tensor([[0.1, -0.1, 0.1, -0.1], [0.01, -0.01, 0.01, 0.0]], dtype=F64)
    old = torch.full_like(ell, -1.0)
    ctx = LossContext(_batch(old, old, old - ell, torch.ones_like(ell)))
    cfg = _mask_cfg(1.04)
    geo = get_term("geomean")(ctx, cfg).seq_mask
    carm = get_term("carm")(ctx, cfg).seq_mask
    assert geo is not None and carm is not None
    assert geo.tolist() == [1.0, 1.0]  # signed mean 0 and 0.0025 ≤ log 1.04
    assert carm.tolist() == [0.0, 1.0]  # mean |ℓ| = 0.1 > log 1.04 ≈ 0.0392


def test_carm_negative_only_masks_only_negative_advantage_sequences() -> None:
    ell = torch.tensor([[0.1, -0.1], [0.1, -0.1]], dtype=F64)
    old = torch.full_like(ell, -1.0)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=F64)
    ctx = LossContext(_batch(old, old, old - ell, adv))
    keep = get_term("carm")(ctx, _mask_cfg(1.04, "negative_only")).seq_mask
    assert keep is not None and keep.tolist() == [1.0, 0.0]


def _carm_keep(b: LossBatch, current: bool) -> list[float]:
    keep = get_term("carm")(LossContext(b), _mask_cfg(1.04, use_current_policy=current)).seq_mask
    assert keep is not None
    return keep.tolist()


def test_carm_flag_uses_current_policy_log_ratio() -> None:
    ell = torch.tensor([[0.1, -0.1]], dtype=F64)
    old = torch.full_like(ell, -1.0)
    adv = torch.ones_like(ell)
    drifted_old = _batch(old, old + ell, old, adv)  # π = μ, π_old drifted
    drifted_pi = _batch(old + ell, old, old, adv)  # π_old = μ, π drifted
    assert _carm_keep(drifted_old, current=False) == [0.0]
    assert _carm_keep(drifted_old, current=True) == [1.0]
    assert _carm_keep(drifted_pi, current=False) == [1.0]
    assert _carm_keep(drifted_pi, current=True) == [0.0]


def test_carm_out_of_band_bound_matches_methods_numbers() -> None:
    assert abs(carm_out_of_band_bound(1.02, ClipConfig()) - 0.0887) < 5e-4  # 8.87 %
    assert abs(carm_out_of_band_bound(1.04, ClipConfig()) - 0.1758) < 5e-4  # 17.58 %


def test_carm_reports_bound_beside_measured_fraction_and_the_bound_holds() -> None:
    # worst case for Markov: n_out tokens just outside the band, the rest exactly at ℓ = 0
    d = math.log(1.25) + 1e-6
    tau = 1.04
    n_out = int(math.floor(math.log(tau) / d * 100))  # 17 of 100 tokens
    ell = torch.zeros(1, 100, dtype=F64)
    ell[0, :n_out] = -d
    old = torch.full_like(ell, -1.0)
    b = _batch(old, old, old - ell, torch.ones_like(ell))
    _, m = LossStack(StackConfig(terms=("carm",), seq_mask=SeqMaskConfig(tau=tau)))(b)
    assert m["carm/masked_seq_frac"].item() == 0.0  # kept: mean |ℓ| ≤ log τ
    assert_close(m["carm/out_of_band_frac"], torch.tensor(n_out / 100, dtype=F64))
    assert m["carm/out_of_band_frac"] <= m["carm/out_of_band_bound"]
    assert abs(m["carm/out_of_band_bound"].item() - 0.1758) < 5e-4


def _pq_batch(p: list[float], q: list[float], a: list[float]) -> LossBatch:
    lp = torch.tensor([p], dtype=F64).log()
    lq = torch.tensor([q], dtype=F64).log()
    return _batch(lp, lq, lq, torch.tensor([a], dtype=F64))


def test_dppo_binary_tv_mask_on_hand_made_tokens() -> None:
    p = [0.6, 0.4, 0.4, 0.6, 0.5]
    q = [0.4, 0.6, 0.6, 0.4, 0.4]
    a = [1.0, 1.0, -1.0, -1.0, 1.0]
    keep = dppo_tv_keep(torch.tensor(p), torch.tensor(q), torch.tensor(a), 0.15)
    assert keep.tolist() == [False, True, False, True, True]
    out = get_term("dppo_tv")(LossContext(_pq_batch(p, q, a)), StackConfig(pg="dppo_tv"))
    assert out.token_mask is not None and out.token_mask[0].tolist() == keep.tolist()


def test_dppo_binary_kl_mask_on_hand_made_tokens() -> None:
    # D(0.5 ‖ 0.8) = 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2) ≈ 0.223 > 0.05; D(0.5 ‖ 0.55) ≈ 0.005
    p = [0.8, 0.8, 0.2, 0.55]
    q = [0.5, 0.5, 0.5, 0.5]
    a = [1.0, -1.0, -1.0, 1.0]
    keep = dppo_kl_keep(
        torch.tensor(p, dtype=F64), torch.tensor(q, dtype=F64), torch.tensor(a), 0.05
    )
    assert keep.tolist() == [False, True, False, True]


def test_dppo_loss_is_minus_a_times_capped_ratio_times_log_pi() -> None:
    p, q, a = [0.3, 0.1], [0.3, 0.02], [1.0, -1.0]  # r = 1 and r = 5 → capped at C = 2
    b = _pq_batch(p, q, a)
    loss, _ = LossStack(StackConfig(pg="dppo_tv"))(b)
    loss.backward()
    w = torch.tensor([[1.0, 2.0]], dtype=F64)
    lp = torch.tensor([p], dtype=F64).log()
    adv = torch.tensor([a], dtype=F64)
    assert_close(loss, (-adv * w * lp).mean())
    assert b.logp.grad is not None
    assert_close(b.logp.grad, -adv * w / 2)


def test_predictive_mask_with_two_buckets_is_the_dppo_direction_test() -> None:
    g = torch.Generator().manual_seed(3)
    n = 4000
    p = torch.rand(n, generator=g, dtype=F64) * 0.98 + 0.01
    q = torch.rand(n, generator=g, dtype=F64) * 0.98 + 0.01
    adv = torch.randn(n, generator=g, dtype=F64)
    div, d_div = predictive_divergence(q[:, None], p[:, None], q, p, torch.sign(adv))
    # two buckets: D is the binary KL, and dD = 2 s (p − q)(1 − p) has the DPPO direction's sign
    assert_close(d_div, 2 * torch.sign(adv) * (p - q) * (1 - p))
    keep_pred = ~((div > 0.05) & (d_div > 0))
    assert torch.equal(keep_pred, dppo_kl_keep(p, q, adv, 0.05))
    # and the same through the registered term and a LossBatch with K = 1
    b = LossBatch(
        logp=p.log()[None].requires_grad_(True),
        old_logp=p.log()[None],
        sampler_logp=q.log()[None],
        advantages=adv[None],
        response_mask=torch.ones(1, n, dtype=torch.bool),
        topk_logp=q.log()[None, :, None],
        policy_topk_logp=p.log()[None, :, None],
    )
    out = get_term("predictive_mask")(LossContext(b), StackConfig(terms=("predictive_mask",)))
    assert out.token_mask is not None and torch.equal(out.token_mask[0], keep_pred)
    assert 0.05 < (~keep_pred).double().mean() < 0.95  # the test is not vacuous


def test_drpo_gradient_weight_matches_closed_form() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.rand(2, 6, generator=g, dtype=F64) * 0.8 + 0.1
    p = (q + (torch.rand(2, 6, generator=g, dtype=F64) - 0.5) * 0.2).clamp(0.05, 0.95)
    adv = torch.randn(2, 6, generator=g, dtype=F64)
    b = _batch(p.log(), p.log(), q.log(), adv)
    eps = 12.5
    loss, _ = LossStack(StackConfig(pg="drpo"))(b)
    r = p / q
    expected = -adv * r + adv.abs() * q * (r - 1) ** 2 / (2 * eps)
    assert_close(loss, expected.mean())
    loss.backward()
    weight = 1 - torch.sign(adv * (r - 1)) * (p - q).abs() / eps
    assert b.logp.grad is not None
    assert_close(b.logp.grad, -adv * r * weight / adv.numel())


def test_spo_loss_closed_form() -> None:
    log_r = torch.tensor([[0.1, -0.3]], dtype=F64)
    old = torch.full_like(log_r, -1.0)
    adv = torch.tensor([[1.0, -2.0]], dtype=F64)
    loss, _ = LossStack(StackConfig(pg="spo"))(_batch(old + log_r, old, old, adv))
    r = log_r.exp()
    assert_close(loss, (-adv * r + adv.abs() * (r - 1) ** 2 / 0.4).mean())
