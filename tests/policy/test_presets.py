# mypy: disable-error-code="no-untyped-call"
# (torch.Tensor.backward is unannotated)
"""Every preset in configs/ loads, builds a LossStack and trains a tiny LM one step; invalid
preset files are rejected with messages that say how to fix them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from policy.advantages import ShapingConfig
from policy.losses import (
    LossBatch,
    LossStack,
    StackConfig,
    available_presets,
    load_preset,
)
from policy.mipu import MipuConfig
from policy.train_config import TrainConfig

EXPECTED = {"grpo", "casi", "dppo-tv", "drpo", "mipu", "async-stale", "ppo-sp3o", "casi-kl"}
VOCAB, DIM, B, T, K = 50, 16, 4, 10, 5


class TinyLM(nn.Module):
    """Embedding → linear next-token logits, plus a scalar value head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.value = nn.Linear(DIM, 1)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.emb(tokens[:, :-1])
        return torch.log_softmax(self.head(h), -1), self.value(h).squeeze(-1)  # (B, T, V), (B, T)


def _lm_batch(model: TinyLM, g: torch.Generator) -> LossBatch:
    tokens = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    logprobs, values = model(tokens)
    targets = tokens[:, 1:, None]
    logp = logprobs.gather(-1, targets).squeeze(-1)
    with torch.no_grad():
        sampler_all = torch.log_softmax(
            logprobs + 0.05 * torch.randn(logprobs.shape, generator=g), -1
        )
        old = logp + 0.02 * torch.randn(B, T, generator=g)
    topk_logp, topk_ids = sampler_all.topk(K, -1)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 7:] = False
    return LossBatch(
        logp=logp,
        old_logp=old,
        sampler_logp=sampler_all.gather(-1, targets).squeeze(-1),
        advantages=torch.randn(B, 1, generator=g).expand(B, T).clone(),
        response_mask=mask,
        ref_logp=old + 0.01,
        topk_logp=topk_logp,
        topk_ids=topk_ids,
        policy_topk_logp=logprobs.gather(-1, topk_ids),
        values=values,
        old_values=values.detach() + 0.05,
        returns=torch.randn(B, T, generator=g),
        entropy=-(logprobs.exp() * logprobs).sum(-1),
        versions=torch.randint(0, 3, (B,), generator=g),
    )


def test_all_expected_presets_exist() -> None:
    assert EXPECTED <= set(available_presets())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_trains_a_tiny_model_one_step(name: str) -> None:
    torch.manual_seed(0)
    cfg = load_preset(name)
    assert isinstance(cfg, StackConfig)
    model = TinyLM()
    batch = _lm_batch(model, torch.Generator().manual_seed(1))
    loss, metrics = LossStack(cfg)(batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert model.head.weight.grad is not None and model.head.weight.grad.abs().sum() > 0
    if cfg.critic.kind != "none":
        assert model.value.weight.grad is not None and model.value.weight.grad.abs().sum() > 0
    assert all(torch.isfinite(v) for v in metrics.values())


def test_preset_sections_are_parsed() -> None:
    casi = load_preset("casi")
    assert casi.terms == ("tis_token", "carm") and casi.pg == "ppo_clip"
    assert not hasattr(casi, "advantages") and not hasattr(casi, "mipu")  # loss settings only
    train = TrainConfig.from_preset("casi")  # the trainer's tables: fields of TrainConfig
    assert train.stack == casi and train.mipu is None and train.mipu_check is None
    assert train.advantages == ShapingConfig(estimator="grpo", mode="projection", credit="shapley")
    assert TrainConfig.from_preset("drpo").advantages.estimator == "drgrpo"
    mipu = MipuConfig(enabled=True, c_max=0.05, c_min=0.0, n_steps=100)
    assert TrainConfig.from_preset("mipu").mipu == mipu
    assert TrainConfig.from_preset("ppo-sp3o").advantages == ShapingConfig()  # no table: defaults
    sp3o = load_preset("ppo-sp3o").critic
    assert sp3o.kind == "sp3o" and sp3o.anchors == (0.3, 0.6, 0.9)
    assert load_preset("grpo").kl is not None


def test_unknown_preset_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid: .*'casi'"):
        load_preset("casii")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('terms = ["geomean", "carm"]', "keep one sequence mask"),
        ('pg = "drpo"\nterms = ["tis_token"]', "already corrects for the sampler"),
        ('pg = "dppo_kl"\nterms = ["staleness_clip"]', "has no clip"),
        ('aggregation = "sum"', "valid: \\['token-mean'"),
        ("[seq_mask]\ntau = 0.99", "tau must be > 1"),
        ("[clip]\neps_hi = 0.3", "unknown key\\(s\\) \\['eps_hi'\\] in \\[clip\\]; valid"),
        ('[critic]\nkind = "sp3o"\nanchors = []', "at least one anchor"),
        ("[kl.dual]\nbudget = -1.0", "kl.dual.budget must be > 0"),
        ('terms = ["carm_v2"]', "unknown modifier term 'carm_v2'; valid"),
        # [advantages] and [mipu] are not loss settings: `TrainConfig.from_preset` checks them
        ('[advantages]\nestimator = "ppo"', "unknown estimator 'ppo'"),
        ("[advantages]\nkapa = 2.0", "unknown key\\(s\\) \\['kapa'\\] in \\[advantages\\]"),
        ("[mipu]\nc_max = 0.0\nc_min = 0.1", "c_max >= c_min"),
    ],
)
def test_invalid_preset_files_are_rejected_with_a_fix(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text + "\n")
    trainer_table = text.startswith(("[advantages]", "[mipu]"))
    if not trainer_table:
        with pytest.raises(ValueError, match=message) as info:
            load_preset(path)
        assert str(path) in str(info.value)
    with pytest.raises(ValueError, match=message) as info:  # the whole preset, loss stack first
        TrainConfig.from_preset(str(path))
    assert str(path) in str(info.value)


def test_preset_by_path(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text('description = "x"\npg = "gspo"\n[gspo]\neps_low = 1e-3\n')
    cfg = load_preset(path)
    assert cfg.pg == "gspo" and cfg.gspo.eps_low == 1e-3 and cfg.kl is None
