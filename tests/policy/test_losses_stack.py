# mypy: disable-error-code="no-untyped-call"
# (torch.Tensor.backward is unannotated)
"""The stack: micro-batch / data-parallel invariance for every aggregation mode, fully masked
batches, registry behaviour, config validation, metric hygiene."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from policy.losses import (
    AGGREGATION_MODES,
    LOG_RATIO_CLAMP,
    ClipConfig,
    CriticConfig,
    DPPOConfig,
    KLConfig,
    LossBatch,
    LossContext,
    LossStack,
    Needs,
    SeqMaskConfig,
    StackConfig,
    TermOutput,
    get_term,
    load_preset,
    register_term,
    registered_terms,
)
from policy.losses.registry import unregister_term
from policy.losses.synthetic import synthetic_batch

F64 = torch.float64
B, T, K, D = 8, 12, 3, 4


class _Data:
    """Fixed token data; logp, values and entropy are linear in shared parameters, so the
    gradient w.r.t. the parameters is what DDP would average across ranks."""

    def __init__(self) -> None:
        self.base = synthetic_batch(B, T, K, seed=7, drift=0.02, dtype=F64)
        g = torch.Generator().manual_seed(11)
        self.x = torch.randn(B, T, D, generator=g, dtype=F64)
        mask = self.base.response_mask.clone()
        mask[2] = False  # one empty response
        self.mask = mask

    def batch(self, params: dict[str, torch.Tensor], idx: slice, **kw: object) -> LossBatch:
        b, x = self.base, self.x[idx]
        fields = {f.name: getattr(b, f.name) for f in dataclasses.fields(b)}
        sliced = {
            k: (v.detach()[idx] if isinstance(v, torch.Tensor) else v) for k, v in fields.items()
        }
        sliced["response_mask"] = self.mask[idx]
        sliced["logp"] = b.logp.detach()[idx] + 0.2 * x @ params["theta"]
        sliced["values"] = x @ params["phi"]
        sliced["entropy"] = torch.nn.functional.softplus(x @ params["psi"])
        sliced.update(kw)
        return LossBatch(**sliced)  # type: ignore[arg-type]


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        k: torch.randn(D, generator=g, dtype=F64).requires_grad_(True)
        for k in ("theta", "phi", "psi")
    }


CONFIGS = {
    "casi+kl+entropy+sp3o": dict(
        terms=("tis_token", "carm", "staleness_clip"),
        kl=KLConfig(estimator="k3", coef=0.1),
        entropy_coef=0.01,
        critic=CriticConfig(kind="sp3o"),
        seq_mask=SeqMaskConfig(tau=1.0172),
    ),
    "gspo+tis_seq": dict(pg="gspo", terms=("tis_seq",)),
    "dppo_kl+predictive": dict(
        pg="dppo_kl", terms=("predictive_mask",), dppo=DPPOConfig(predictive_delta=0.002)
    ),
    "drpo+geomean+dense": dict(
        pg="drpo",
        terms=("geomean",),
        critic=CriticConfig(kind="dense"),
        seq_mask=SeqMaskConfig(tau=1.0085),
    ),
}


def _grads(stack: LossStack, data: _Data, parts: list[slice], dp: int) -> dict[str, torch.Tensor]:
    params = _params()
    n_tok, n_seq = data.mask.sum(), data.mask.any(-1).sum()
    total = torch.zeros((), dtype=F64)
    for idx in parts:
        loss, _ = stack(
            data.batch(params, idx, global_tokens=n_tok, global_seqs=n_seq, dp_world_size=dp)
        )
        total = total + loss / dp  # DDP: each rank backprops its own loss; gradients are averaged
    total.backward()
    return {k: p.grad for k, p in params.items() if p.grad is not None}


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_micro_batches_and_data_parallel_ranks_give_the_full_batch_gradient(
    mode: str, name: str
) -> None:
    cfg = StackConfig(aggregation=mode, horizon=T, **CONFIGS[name])  # type: ignore[arg-type]
    stack, data = LossStack(cfg), _Data()
    full = _grads(stack, data, [slice(0, B)], dp=1)
    micro = _grads(stack, data, [slice(0, 3), slice(3, 5), slice(5, B)], dp=1)  # accumulation
    ranks = _grads(stack, data, [slice(0, 4), slice(4, B)], dp=2)  # two simulated DDP ranks
    _, metrics = stack(data.batch(_params(), slice(0, B)))
    kept = metrics["stack/kept_frac"]
    assert 0.3 < kept <= 1 and (kept < 1 or name == "gspo+tis_seq")  # masks are exercised
    assert "theta" in full and set(full) == set(micro) == set(ranks)
    for key, g_full in full.items():
        assert g_full.abs().sum() > 0
        assert_close(micro[key], g_full, rtol=1e-10, atol=1e-12)
        assert_close(ranks[key], g_full, rtol=1e-10, atol=1e-12)


def test_local_counts_would_break_invariance() -> None:
    """The bug the global counts prevent: x1/n1 + x2/n2 ≠ (x1 + x2)/(n1 + n2)."""
    stack, data, params = LossStack(StackConfig()), _Data(), _params()
    full, _ = stack(data.batch(params, slice(0, B)))
    local = sum(stack(data.batch(params, s))[0] for s in (slice(0, 2), slice(2, B)))
    assert (full - local).abs() > 1e-3


def _all_masked_batch(response_mask: torch.Tensor) -> LossBatch:
    b = synthetic_batch(4, 6, seed=2, drift=0.5, dtype=F64)
    return dataclasses.replace(b, response_mask=response_mask)


@pytest.mark.parametrize("empty_mask", [True, False])
def test_fully_masked_batch_gives_exact_zero_finite_grads_and_a_metric(empty_mask: bool) -> None:
    mask = torch.zeros(4, 6, dtype=torch.bool) if empty_mask else torch.ones(4, 6, dtype=torch.bool)
    b = _all_masked_batch(mask)
    cfg = StackConfig(terms=("tis_token", "carm"), seq_mask=SeqMaskConfig(tau=1.0001))
    for mode in AGGREGATION_MODES:
        stack = LossStack(dataclasses.replace(cfg, aggregation=mode, horizon=6))
        loss, metrics = stack(b)
        assert loss.item() == 0.0 and loss.requires_grad
        loss.backward()
        assert b.logp.grad is not None and torch.isfinite(b.logp.grad).all()
        assert metrics["stack/fully_masked"].item() == 1.0
        assert all(torch.isfinite(v) for v in metrics.values())
        b.logp.grad = None


def test_metrics_are_detached_zero_dim_tensors() -> None:
    b = synthetic_batch(4, 8, 3, seed=1)
    cfg = StackConfig(
        terms=("tis_token", "carm", "predictive_mask"), kl=KLConfig(coef=0.1), entropy_coef=0.01
    )
    _, metrics = LossStack(cfg)(b)
    for name, v in metrics.items():
        assert v.dim() == 0 and not v.requires_grad, name
    for key in ("tis_token/ess", "carm/out_of_band_bound", "mismatch/kl_k3", "ppo_clip/clip_frac"):
        assert key in metrics


def test_log_ratios_are_clamped_to_twenty() -> None:
    logp = torch.tensor([[0.0, -200.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-200.0, 0.0]], dtype=F64)
    ctx = LossContext(
        LossBatch(logp, old, old, torch.ones_like(old), torch.ones_like(old, dtype=torch.bool))
    )
    assert ctx.log_ratio.tolist() == [[LOG_RATIO_CLAMP, -LOG_RATIO_CLAMP]]
    loss, _ = LossStack(StackConfig(pg="spo"))(
        LossBatch(logp, old, old, torch.ones_like(old), torch.ones_like(old))
    )
    assert torch.isfinite(loss)


def test_registry_rejects_duplicates_and_lists_valid_names_for_unknown() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_term("ppo_clip", kind="pg")(get_term("ppo_clip"))
    with pytest.raises(KeyError, match="valid: .*ppo_clip"):
        get_term("ppo_clipp")
    with pytest.raises(KeyError, match="unknown pg term 'carm'"):
        get_term("carm", kind="pg")
    with pytest.raises(KeyError, match="valid"):
        LossStack(StackConfig(terms=("no_such_mask",)))


def test_a_registered_term_composes_without_editing_the_stack() -> None:
    @register_term("test_halve", kind="modifier")
    def _halve(ctx: LossContext, cfg: StackConfig) -> TermOutput:
        return TermOutput(token_weight=torch.full_like(ctx.mask, 0.5))

    try:
        assert "test_halve" in registered_terms("modifier")
        b = synthetic_batch(3, 5, seed=4)
        base, _ = LossStack(StackConfig())(b)
        halved, _ = LossStack(StackConfig(terms=("test_halve",)))(b)
        assert_close(halved, base / 2)
    finally:
        unregister_term("test_halve")


@dataclasses.dataclass(frozen=True)
class _ScaleConfig:
    coef: float = 1.0
    on: bool = True


def _test_logp_term(ctx: LossContext, cfg: StackConfig) -> TermOutput:
    return TermOutput(loss=-ctx.batch.logp, token_metrics={"value": -ctx.batch.logp})


def test_a_registered_additive_term_declares_its_section_coefficient_and_needs(
    tmp_path: Path,
) -> None:
    """The stack reads everything about an additive term from its registration."""
    register_term(
        "test_neg_logp", kind="additive", section="test_neg", config=_ScaleConfig,
        coefficient=lambda c: c.coef, enabled=lambda c: c is not None and c.on,
        needs=Needs(reference=True),
    )(_test_logp_term)  # fmt: skip
    try:
        b = synthetic_batch(3, 5, seed=4)
        base = LossStack(StackConfig())
        assert base.needs == Needs() and "test_neg_logp" not in base._weights
        cfg = StackConfig(sections={"test_neg": {"coef": 0.25}})  # a table: built into its config
        assert cfg.section("test_neg") == _ScaleConfig(coef=0.25) and hash(cfg) == hash(cfg)
        stack = LossStack(cfg)
        assert stack.needs == Needs(reference=True) and stack.coefficient("test_neg_logp") == 0.25
        loss, metrics = stack(b)
        expected = base(b)[0] + 0.25 * metrics["test_neg_logp/value"]  # token-mean of −log π
        assert_close(loss, expected)
        off = LossStack(StackConfig(sections={"test_neg": _ScaleConfig(on=False)}))
        assert_close(off(b)[0], base(b)[0])
        with pytest.raises(ValueError, match="test_neg_logp' needs batch.ref_logp"):
            stack(dataclasses.replace(b, ref_logp=None))
        path = tmp_path / "neg.toml"
        path.write_text('pg = "ppo_clip"\n[sections.test_neg]\ncoef = 0.5\n')
        assert load_preset(path).section("test_neg") == _ScaleConfig(coef=0.5)
    finally:
        unregister_term("test_neg_logp")


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: StackConfig(sections={"nobody": {}}), "no registered additive term reads"),
        (lambda: StackConfig(sections={"kl": KLConfig()}), "is a StackConfig field"),
        (lambda: register_term("x", kind="additive")(_test_logp_term), "needs a config section"),
        (lambda: register_term("x", kind="pg", section="y")(_test_logp_term), "only additive"),
    ],
)
def test_sections_and_registrations_are_checked(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]
    assert "x" not in registered_terms()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(terms=("geomean", "carm")), "keep one sequence mask"),
        (dict(pg="drpo", terms=("tis_token",)), "already corrects for the sampler"),
        (dict(pg="dppo_tv", terms=("icepop",)), "remove \\['icepop'\\]"),
        (dict(terms=("tis_token", "tis_seq")), "keep exactly one"),
        (dict(pg="drpo", terms=("staleness_clip",)), "has no clip: use pg in"),
        (dict(aggregation="mean"), "valid: \\['token-mean'"),
        (dict(aggregation="seq-mean-token-sum-norm"), "set horizon"),
        (dict(terms=("carm", "carm")), "duplicate"),
        (dict(seq_mask=None), None),
    ],
)
def test_invalid_combinations_are_rejected_with_a_fix(
    kwargs: dict[str, object], message: str | None
) -> None:
    if message is None:
        with pytest.raises(ValueError, match="tau must be > 1"):
            SeqMaskConfig(tau=1.0)
        return
    with pytest.raises(ValueError, match=message):
        StackConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ClipConfig(eps_low=1.2), "eps_low must be in \\(0, 1\\)"),
        (lambda: ClipConfig(dual_clip_c=0.5), "dual_clip_c must be > 1"),
        (lambda: CriticConfig(kind="sp3o", anchors=()), "at least one anchor"),
        (lambda: CriticConfig(kind="dense", coef=0.0), "or set kind='none'"),
        (lambda: KLConfig(estimator="k4"), "valid: \\['k1', 'k2', 'k3', 'k3_k2grad'\\]"),
    ],
)
def test_section_validation_messages(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]


def test_missing_batch_fields_are_reported_with_a_fix() -> None:
    b = dataclasses.replace(synthetic_batch(2, 4), ref_logp=None, values=None, topk_logp=None)
    with pytest.raises(ValueError, match="ref_logp"):
        LossStack(StackConfig(kl=KLConfig(coef=0.1)))(b)
    with pytest.raises(ValueError, match="topk_logp"):
        LossStack(StackConfig(terms=("predictive_mask",)))(b)
    with pytest.raises(ValueError, match="critic.kind = 'none'"):
        LossStack(StackConfig(critic=CriticConfig(kind="sp3o")))(b)
