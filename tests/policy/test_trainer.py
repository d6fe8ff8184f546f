"""The Trainer on the tiny format policy, the SciFact slice and real Redis: every preset, the
frozen reference, non-finite batches, empty rollouts, MIPU rollback, micro-batch invariance, a
loss term registered here alone, the shuffled-credit placebo."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from evaluator.credit import CreditResult
from evaluator.scorers import make_scorer
from policy import mipu
from policy.advantages import valid_permutation
from policy.forward import policy_forward
from policy.losses import LossContext, StackConfig, TermOutput, register_term
from policy.losses.presets import available_presets
from policy.losses.registry import unregister_term
from policy.mipu import MipuConfig
from policy.model import build_tiny_policy
from policy.precision import is_packed
from policy.train_config import TrainConfig
from policy.trainer import Trainer, lr_factor, query_order, step_seed
from policy.update import UpdateConfig, UpdateInputs, UpdateSpec, policy_update

B, G, M = 2, 3, 2  # the format policy answers the slice's first 2 train queries with 2 rewrites


def _cfg(preset: str = "casi", **kw: Any) -> TrainConfig:
    base = dict(
        steps=2,
        queries=B,
        samples=G,
        n_actions=M,
        line_cap=10,
        lr=1e-3,
        anchor_query=False,
        micro_batch_size=4,
    )
    return TrainConfig.from_preset(preset, **{**base, **kw})


def _queries(ds: Any) -> list[tuple[str, str]]:
    return [(q, ds.queries[q]) for q in ds.split_query_ids("train")[:B]]


def _trainer(
    model: Any, tok: Any, retrieval: Any, cfg: TrainConfig, cls: type[Trainer] = Trainer
) -> Trainer:
    scorer = make_scorer("replay", qrels=retrieval.dataset.qrels_rows("train"), k=10)
    torch.manual_seed(0)
    return cls(copy.deepcopy(model), tok, cfg, retrieval.executor, scorer, version="v0")


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("preset", available_presets())
def test_every_preset_runs_two_steps(
    preset, format_policy, smol_tokenizer, slice_retrieval
) -> None:  # type: ignore[no-untyped-def]
    trainer = _trainer(format_policy, smol_tokenizer, slice_retrieval, _cfg(preset))
    start = _params(trainer.model)
    ref_start = _params(trainer.reference) if trainer.reference is not None else None
    signal = False
    for _ in range(2):
        res = trainer.train_step(_queries(slice_retrieval.dataset))
        assert all(torch.isfinite(torch.tensor(v)) for v in res.metrics.values()), res.metrics
        assert res.metrics["reward_mean"] >= 0 and res.metrics["efficiency_residual_max"] <= 1e-9
        signal |= bool(res.token_adv.abs().max() > 0) or trainer.value_head is not None
    assert trainer.step == 2
    # a step moves the policy exactly when some token has a non-zero advantage (or a critic
    # learns); broadcast credit with equal rewards in a group (grpo) has none
    assert _changed(start, _params(trainer.model)) == signal, (
        f"{preset}: moved without signal or vice versa"
    )
    if ref_start is not None:  # the KL reference is the starting policy, frozen
        assert trainer.reference is not None and not _changed(ref_start, _params(trainer.reference))
        assert all(not p.requires_grad for p in trainer.reference.parameters())
        assert not _changed(ref_start, start)
    if trainer.cfg.stack.critic.kind != "none":
        assert trainer.value_head is not None and trainer.value_head.proj.weight.abs().sum() > 0


class _NanReward(Trainer):
    """One rollout's reward is NaN: its group's advantages are NaN."""

    def credit(self, rollouts: Any) -> CreditResult:
        res = super().credit(rollouts)
        values = res.values.clone()
        values[0, -1] = float("nan")  # v(N) of rollout 0
        return dataclasses.replace(res, values=values)


def test_non_finite_batch_is_skipped_and_counted(
    format_policy, smol_tokenizer, slice_retrieval
) -> None:  # type: ignore[no-untyped-def]
    trainer = _trainer(format_policy, smol_tokenizer, slice_retrieval, _cfg(), _NanReward)
    before = _params(trainer.model)
    res = trainer.train_step(_queries(slice_retrieval.dataset))
    assert res.metrics["step_applied"] == 0.0 and trainer.counters["skipped_nonfinite"] == 1
    assert res.metrics["count/skipped_nonfinite"] == 1.0 and trainer.step == 1
    assert trainer.scheduler.last_epoch == 1  # a skipped step still advances the schedule
    assert not _changed(before, _params(trainer.model))
    assert all(torch.isfinite(v).all() for v in trainer.model.state_dict().values())
    metrics = policy_update(  # the update itself refuses non-finite inputs
        trainer.model, trainer.optimizer, trainer.stack,
        UpdateInputs(res.batch, res.token_adv, torch.zeros_like(res.token_adv),
                     torch.ones(len(res.batch)), B),
        trainer.spec,
    )  # fmt: skip
    assert metrics == {"step_applied": torch.tensor(0.0)}
    assert not _changed(before, _params(trainer.model))


def test_rollouts_with_no_valid_action(smol_tokenizer, slice_retrieval) -> None:  # type: ignore[no-untyped-def]
    """Free format: an untrained tiny model writes no numbered line, so every rollout has zero
    actions (the constrained format makes this impossible; tests/policy/test_constrain.py)."""
    model = build_tiny_policy(smol_tokenizer, seed=1)
    cfg = _cfg(anchor_query=True, format="free", max_new_tokens=24)
    trainer = _trainer(model, smol_tokenizer, slice_retrieval, cfg)
    res = trainer.train_step(_queries(slice_retrieval.dataset))
    assert int(res.credit.n_actions.sum()) == 0 and res.credit.phi.shape == (B * G, M)
    assert float(res.shaped.abs().max()) == 0.0
    assert all(torch.isfinite(torch.tensor(v)) for v in res.metrics.values())
    # with the anchor, v(N) = v(∅) = the query alone: no gain, reward = the query's nDCG
    torch.testing.assert_close(res.credit.value_full, res.credit.value_empty)


def test_shuffled_credit_permutes_shapley_on_the_same_rollouts(
    format_policy, smol_tokenizer, slice_retrieval
) -> None:  # type: ignore[no-untyped-def]
    """The placebo trains on the rollouts shapley sees (its draw never touches the global RNG)
    with each rollout's x permuted by the (seed, step) generator; broadcast has no shaping, so
    its token advantage is A_i on every loss token; every mode records the push's size."""
    res = {}
    for mode in ("shapley", "shuffled", "broadcast"):
        trainer = _trainer(format_policy, smol_tokenizer, slice_retrieval, _cfg(credit=mode))
        r = res[mode] = trainer.train_step(_queries(slice_retrieval.dataset))
        assert math.isfinite(r.metrics["loss"]) and r.metrics["step_applied"] == 1.0
        assert all(math.isfinite(v) for v in r.metrics.values()), r.metrics
        loss_mask, mask = r.batch.loss_mask, r.batch.action_mask
        adv_abs = float(r.token_adv.abs()[loss_mask].mean())
        assert r.metrics["adv_abs_mean"] == pytest.approx(adv_abs, rel=1e-6)
        x_abs = float(r.shaped.reshape(B * G, M).abs()[mask].mean())
        assert r.metrics["shaping_abs_mean"] == pytest.approx(x_abs, rel=1e-12)
        assert "adv_abs_mean_action" in r.metrics
    shapley, shuffled, broadcast = res["shapley"], res["shuffled"], res["broadcast"]
    assert [r.response_ids for r in shuffled.rollouts] == [r.response_ids for r in shapley.rollouts]
    assert torch.equal(shuffled.credit.phi, shapley.credit.phi)
    mask = shuffled.batch.action_mask.reshape(B, G, M)
    idx = valid_permutation(mask, torch.Generator().manual_seed(step_seed(0, 0, "shuffled")))
    assert not torch.equal(idx, torch.arange(M).expand_as(idx))  # some rollout's x moved
    assert float(shapley.shaped.abs().max()) > 0.1
    torch.testing.assert_close(shuffled.shaped, shapley.shaped.gather(-1, idx), rtol=0, atol=1e-14)
    assert shuffled.metrics["shaping_abs_mean"] == pytest.approx(
        shapley.metrics["shaping_abs_mean"], rel=1e-12
    )
    assert broadcast.metrics["shaping_abs_mean"] == 0.0
    base_tok = broadcast.base.reshape(-1, 1).float() * broadcast.batch.loss_mask
    assert torch.equal(broadcast.token_adv, base_tok)


class _Decide(Trainer):
    verdict = True

    def decide(self, cfg: Any, t_value: float) -> mipu.Decision:
        return mipu.Decision(accepted=self.verdict, t_post=t_value, threshold=0.0)


def _state_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_state_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_state_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return bool(a == b)


@pytest.mark.parametrize("params", ["full", "lora", "top"])
@pytest.mark.parametrize("accept", [False, True])
def test_mipu_forced_decision(
    accept, params, format_policy, smol_tokenizer, slice_retrieval
) -> None:  # type: ignore[no-untyped-def]
    cfg = _cfg("mipu", params=params, lora_rank=4, top_layers=1)
    trainer = _trainer(format_policy, smol_tokenizer, slice_retrieval, cfg, _Decide)
    trainer.train_step(_queries(slice_retrieval.dataset))  # accepted: the optimizer has state
    trainer.verdict = accept  # type: ignore[attr-defined]
    before = trainer.state_dict()
    torch.manual_seed(123)  # the RNG must come back too
    before["rng"] = torch.get_rng_state()
    res = trainer.train_step(_queries(slice_retrieval.dataset))
    after = trainer.state_dict()
    assert res.accepted is accept and res.metrics["mipu/accepted"] == float(accept)
    assert "mipu/t_post" in res.metrics and trainer.step == 2
    restored = {k: after[k] for k in ("model", "optimizer", "rng")}
    original = {k: before[k] for k in ("model", "optimizer", "rng")}
    # the LR schedule counts every step, rolled back or not: LR = f(step) (methods.md §6.2)
    assert trainer.scheduler.last_epoch == trainer.step == before["scheduler"]["last_epoch"] + 1
    if accept:
        assert _changed(before["model"], after["model"])
        assert trainer.counters["mipu_accepted"] == 2
    else:  # bitwise: weights, Adam moments and step counts, RNG
        assert _state_equal(restored, original)
        assert trainer.counters["mipu_rejected"] == 1
        sampler = trainer.sampler  # float32: rebuilt from the restored weights
        if is_packed(sampler):  # prepacked (full / top on CPU): the restored model's outputs
            ids = torch.tensor([[1, 2, 3, 4, 5]])
            with torch.no_grad():
                want = trainer.model.eval()(input_ids=ids).logits
                assert torch.allclose(sampler(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
        else:  # plain (LoRA): the restored model itself
            assert sampler is trainer.model


def test_micro_batch_size_does_not_change_the_update(
    format_policy, smol_tokenizer, slice_retrieval
) -> None:  # type: ignore[no-untyped-def]
    trainer = _trainer(format_policy, smol_tokenizer, slice_retrieval, _cfg())
    rollouts = trainer.sample(_queries(slice_retrieval.dataset), G, seed=0)
    from policy.rollout import collate

    batch = collate(rollouts, pad_token_id=trainer.pad_id, max_actions=M)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(len(batch), 1, generator=gen) * batch.response_mask
    shaping = torch.randn(batch.response_mask.shape, generator=gen) * batch.response_mask
    inputs = UpdateInputs(batch, base, shaping, torch.rand(len(batch), generator=gen), B)
    grads = []
    for micro in (1, 4, len(batch)):
        model = copy.deepcopy(format_policy)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: compare gradients, not steps
        captured: dict[str, torch.Tensor] = {}
        hooks = [p.register_post_accumulate_grad_hook(lambda p, n=n, c=captured: c.__setitem__(n, p.grad.clone()))
                 for n, p in model.named_parameters()]  # fmt: skip
        policy_update(
            model,
            opt,
            trainer.stack,
            inputs,
            UpdateSpec(UpdateConfig(micro_batch_size=micro), trainer.cfg.sampler.temperature),
        )
        for h in hooks:
            h.remove()
        grads.append(captured)
    for other in grads[1:]:
        for name, g in grads[0].items():
            torch.testing.assert_close(other[name], g, rtol=1e-4, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in grads[0].values())


def test_mini_batches_hold_whole_query_groups() -> None:
    """B = 3 queries × G = 4 in 2 mini-batches split rows 0..5 | 6..11, so query 1's group was
    cut across two optimizer steps; now the last mini-batch takes the group left over."""
    from policy.update import _mini_batch_rows

    assert _mini_batch_rows(12, 3, 2) == [slice(0, 4), slice(4, 12)]
    assert _mini_batch_rows(16, 4, 2) == [slice(0, 8), slice(8, 16)]  # B a multiple: as before
    assert _mini_batch_rows(12, 3, 1) == [slice(0, 12)]
    assert _mini_batch_rows(5, 1, 2) == [slice(0, 2), slice(2, 5)]  # fewer groups: row blocks


def test_update_metrics_are_token_weighted_and_a_skipped_step_feeds_no_controller(
    format_policy, smol_tokenizer, slice_retrieval
) -> None:  # type: ignore[no-untyped-def]
    """With mini_batches > 1 each mini-batch's metrics weighed 1 / mini_batches whatever its
    tokens, so the dual controller got a plain average of KL means; and it was fed even when
    the step was skipped as non-finite (a NaN KL made λ NaN for good)."""
    from policy.losses.config import DualKLConfig, KLConfig, StackConfig
    from policy.losses.stack import LossStack
    from policy.rollout import collate

    trainer = _trainer(format_policy, smol_tokenizer, slice_retrieval, _cfg())
    rollouts = trainer.sample(_queries(slice_retrieval.dataset), G, seed=0)
    batch = collate(rollouts, pad_token_id=trainer.pad_id, max_actions=M)
    first = len(batch) // 2  # the first mini-batch's rows keep 2 loss tokens each
    batch.loss_mask[:first] &= batch.loss_mask[:first].cumsum(-1) <= 2
    assert batch.loss_mask[:first].sum() < batch.loss_mask[first:].sum() / 2
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(len(batch), 1, generator=gen) * batch.response_mask
    inputs = UpdateInputs(batch, base, torch.zeros_like(base * 1.0), torch.rand(len(batch)), B)
    stack_cfg = StackConfig(kl=KLConfig(estimator="k1", dual=DualKLConfig(coef_init=0.2)))
    reference = copy.deepcopy(format_policy)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    values = {}
    for mini in (1, 2):
        model = copy.deepcopy(format_policy)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # π never moves: the same KL
        spec = UpdateSpec(UpdateConfig(mini_batches=mini), trainer.cfg.sampler.temperature)
        stack = LossStack(stack_cfg)
        m = policy_update(model, opt, stack, inputs, spec, reference=reference)
        values[mini] = (float(m["kl/value"]), stack.state_dict()["kl"]["ema"])
    assert values[2][0] == pytest.approx(values[1][0], rel=1e-4)  # one update's token mean
    assert values[2][1] == pytest.approx(values[1][1], rel=1e-4)
    stack = LossStack(stack_cfg)
    fed: list[object] = []
    stack.update_controllers = fed.append  # type: ignore[method-assign]
    model = copy.deepcopy(format_policy)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))  # every logp NaN: the step is skipped
    spec = UpdateSpec(UpdateConfig(), trainer.cfg.sampler.temperature)
    m = policy_update(model, torch.optim.SGD(model.parameters(), lr=0.0), stack, inputs, spec,
                      reference=reference)  # fmt: skip
    assert float(m["step_applied"]) == 0.0 and fed == []


def test_query_order_is_a_seeded_epoch_shuffle() -> None:
    ids = [str(i) for i in range(10)]
    epoch0 = query_order(ids, seed=3, step=0, per_step=10)
    assert sorted(epoch0) == ids and epoch0 != ids  # a permutation, shuffled
    steps = [q for s in range(5) for q in query_order(ids, seed=3, step=s, per_step=4)]
    assert steps[:10] == epoch0 and sorted(steps[10:20]) == ids  # epochs back to back
    assert query_order(ids, 3, 2, 4) == query_order(ids, 3, 2, 4)  # pure: resume sees the same
    assert query_order(ids, 4, 0, 10) != epoch0


def test_lr_schedule() -> None:
    cfg = _cfg(steps=10, warmup_steps=2, schedule="linear")
    assert [lr_factor(cfg, s) for s in (0, 1)] == [0.5, 1.0]
    assert lr_factor(cfg, 2) == 1.0 and lr_factor(cfg, 10) == 0.0
    cos = _cfg(steps=10, schedule="cosine")
    assert lr_factor(cos, 0) == 1.0 and lr_factor(cos, 5) == pytest.approx(0.5)


def test_mipu_threshold_schedule_and_rule() -> None:
    cfg = MipuConfig(c_max=0.1, c_min=0.02, n_steps=4)
    assert [mipu.threshold(cfg, s) for s in (0, 2, 4, 9)] == pytest.approx([0.1, 0.06, 0.02, 0.02])
    assert mipu.decide(cfg, 0, -0.1).accepted and not mipu.decide(cfg, 0, -0.11).accepted
    assert not mipu.decide(cfg, 0, float("nan")).accepted
    # ρ ≡ 1 and group-centred advantages: T̂_post = 0
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    assert float(mipu.t_post(torch.zeros(4), adv)) == 0.0
    # the sampler under-weights the good rollouts (π_new > μ_new there): T̂_post < 0
    assert float(mipu.t_post(torch.tensor([0.2, 0.0, 0.2, 0.0]), adv)) < 0


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("samples", 1, "group advantages need a group"),
        ("n_actions", 13, "exact Shapley"),
        ("credit", "banzhaf", "credit must be one of"),
        ("precision", "fp8", "precision must be one of"),
        ("prompt", "long", "prompt must be one of"),
        ("mini_batches", 5, "whole query groups"),
    ],
)
def test_train_config_rejects_bad_values_with_a_fix(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _cfg(**{field: value})


def test_train_config_round_trips_through_json() -> None:
    cfg = _cfg("grpo", credit="singleton", seed=7)
    again = TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and again.shaping.credit == "singleton"
    mipu_cfg = _cfg("mipu")
    assert TrainConfig.from_dict(json.loads(json.dumps(mipu_cfg.to_dict()))) == mipu_cfg


@pytest.mark.parametrize("preset", ["casi", "mipu", "grpo"])
def test_configs_stored_with_the_sections_inside_the_stack_still_load(preset: str) -> None:
    """Runs stored before [advantages] and [mipu] left the loss stack carried them in "stack"."""
    from policy.train_config import stored_section

    cfg = _cfg(preset, seed=3)
    old = json.loads(json.dumps(cfg.to_dict()))
    old["stack"]["advantages"] = old.pop("advantages")
    old["stack"]["mipu"] = old.pop("mipu")
    del old["stack"]["sections"]
    assert TrainConfig.from_dict(old) == cfg
    assert stored_section(old, "advantages") == stored_section(cfg.to_dict(), "advantages")
    assert stored_section(old, "advantages")["credit"] == cfg.advantages.credit
    assert stored_section({}, "mipu") == {}
    old["stack"]["advantages"] = None  # a preset without an [advantages] table
    assert TrainConfig.from_dict(old).advantages == TrainConfig().advantages


@pytest.mark.parametrize("params", ["lora", "top"])
def test_lora_and_top_layers_train_only_their_weights(
    params, format_policy, smol_tokenizer, slice_retrieval
) -> None:  # type: ignore[no-untyped-def]
    """LoRA: only adapters move, and the reference is the base with adapters off (no copy of
    the weights), frozen; top: only the last layer moves, the embedding and layer 0 do not."""
    cfg = _cfg("grpo", params=params, lora_rank=4, top_layers=1, lr=1e-2, credit="shapley")  # + KL
    trainer = _trainer(format_policy, smol_tokenizer, slice_retrieval, cfg)
    assert trainer.reference is not None
    start = _params(trainer.model)
    batch = None
    for _ in range(2):
        res = trainer.train_step(_queries(slice_retrieval.dataset))
        batch = res.batch
    end = _params(trainer.model)
    moved = {k for k in start if not torch.equal(start[k], end[k])}
    assert moved, "nothing trained"
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert moved <= trainable
    if params == "lora":
        assert all("lora_" in k for k in trainable)
        assert not list(trainer.reference.parameters())  # no second copy of the weights
        from policy.forward import logprobs

        base_model = copy.deepcopy(format_policy)  # the starting weights, adapters never added
        ref_logp = logprobs(trainer.reference, batch, cfg.sampler.temperature)
        torch.testing.assert_close(ref_logp, logprobs(base_model, batch, cfg.sampler.temperature))
        assert any(p.requires_grad for n, p in trainer.model.named_parameters() if "lora_" in n)
    else:
        assert all(k.startswith(("model.layers.1.", "model.norm.")) for k in trainable)
        assert all(not p.requires_grad for p in trainer.reference.parameters())
        assert not _changed(
            {k: v for k, v in start.items() if "layers.1." not in k},
            {k: v for k, v in _params(trainer.reference).items() if "layers.1." not in k},
        )


def test_lora_checkpoint_is_the_adapter_and_serves_merged(
    format_policy, smol_tokenizer, slice_retrieval, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """export_policy writes only the adapter (naming its base); load_policy serves it merged,
    with the version export_policy returned, and the same log-probs as the trained model."""
    from policy.forward import logprobs
    from policy.model import load_policy, policy_version, save_checkpoint
    from policy.params import adapter_base, is_adapter_folder

    base_dir = save_checkpoint(format_policy, smol_tokenizer, tmp_path / "base")
    cfg = _cfg("casi", params="lora", lora_rank=4, lr=1e-2)
    trainer = _trainer(format_policy, smol_tokenizer, slice_retrieval, cfg)
    res = trainer.train_step(_queries(slice_retrieval.dataset))
    version = trainer.export_policy(tmp_path / "ckpt", str(base_dir), "base-version")
    folder = tmp_path / "ckpt"
    assert is_adapter_folder(folder) and not (folder / "model.safetensors").exists()
    assert adapter_base(folder) == {"base_path": str(base_dir), "base_version": "base-version"}
    served, _ = load_policy(folder, tmp_path / "var")
    assert policy_version(served) == version
    keep = res.batch.loss_mask  # the sampled (free) tokens: what training and serving use
    served_logp = logprobs(served, res.batch, cfg.sampler.temperature)[keep]
    # the merged weights compute what the adapter computes: W·x + B(A·x) and (W + BA)·x
    # round differently in float32 (seen 1.8e-5 absolute, 2.9e-6 relative on log-probs ≈ -6),
    # so this is a relative float32 tolerance; a wrong merge is off by orders of magnitude more
    torch.testing.assert_close(
        served_logp,
        logprobs(trainer.model, res.batch, cfg.sampler.temperature)[keep],
        atol=1e-5,
        rtol=1e-5,
    )


# ---------------------------------------------------------------------- a new additive term


@dataclasses.dataclass(frozen=True)
class _L2Config:
    coef: float = 0.5


L2_TERM, L2_SECTION = "test_l2_logp", "test_l2"


def _l2_logp(ctx: LossContext, cfg: StackConfig) -> TermOutput:
    """Per-token (log π)²: pulls every loss token's log-prob towards 0 (probability 1). Zeroed
    off the mask first: log π is −inf at pads, and 0·∞ would make the gradient NaN."""
    loss = torch.where(ctx.valid, ctx.batch.logp, 0.0).square()
    return TermOutput(loss=loss, token_metrics={"value": loss})


@pytest.fixture
def l2_term() -> Iterator[None]:
    """Registered in this file alone, with its section, coefficient and config; removed after."""
    register_term(
        L2_TERM, kind="additive", section=L2_SECTION, config=_L2Config,
        coefficient=lambda c: c.coef,
    )(_l2_logp)  # fmt: skip
    try:
        yield
    finally:
        unregister_term(L2_TERM)


def _grad_capture(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """The accumulated gradient of every parameter before the clip (the last hook call wins)."""
    grads: dict[str, torch.Tensor] = {}
    hooks = [p.register_post_accumulate_grad_hook(lambda p, n=n: grads.__setitem__(n, p.grad.clone()))
             for n, p in model.named_parameters()]  # fmt: skip
    return grads, hooks


def test_a_registered_additive_term_trains_through_the_trainer(
    l2_term, format_policy, smol_tokenizer, slice_retrieval
) -> None:  # type: ignore[no-untyped-def]
    coef = 0.5
    base_cfg = _cfg("casi")
    stack = dataclasses.replace(base_cfg.stack, sections={L2_SECTION: {"coef": coef}})  # a table
    l2_cfg = dataclasses.replace(base_cfg, stack=stack)
    assert l2_cfg.stack.section(L2_SECTION) == _L2Config(coef)  # built into its config
    assert TrainConfig.from_dict(json.loads(json.dumps(l2_cfg.to_dict()))) == l2_cfg
    queries = _queries(slice_retrieval.dataset)
    results, grads = [], []
    for cfg in (base_cfg, l2_cfg):
        trainer = _trainer(format_policy, smol_tokenizer, slice_retrieval, cfg)
        start = copy.deepcopy(trainer.model)
        captured, hooks = _grad_capture(trainer.model)
        results.append(trainer.train_step(queries))
        for h in hooks:
            h.remove()
        grads.append(captured)
    base, l2 = results
    assert torch.equal(base.batch.response_ids, l2.batch.response_ids)  # the same rollouts
    value = l2.metrics[f"{L2_TERM}/value"]  # token-mean of (log π)² over the loss tokens
    assert f"{L2_TERM}/value" not in base.metrics and value > 0
    assert l2.metrics["loss"] == pytest.approx(base.metrics["loss"] + coef * value, rel=1e-5)
    # the gradient moved by exactly ∇ coef·mean_t (log π_t)², recomputed here on the start weights
    batch = l2.batch
    logp = policy_forward(start, batch, l2_cfg.sampler.temperature).logp.float()
    mask = batch.loss_mask
    (coef * (logp.square() * mask).sum() / mask.sum()).backward()  # type: ignore[no-untyped-call]
    expected = {n: p.grad for n, p in start.named_parameters() if p.grad is not None}
    assert expected and set(expected) <= set(grads[1])
    moved = 0.0
    for name, g in expected.items():
        torch.testing.assert_close(grads[1][name] - grads[0][name], g, rtol=1e-3, atol=1e-6)
        moved += float(g.abs().sum())
    assert moved > 0
