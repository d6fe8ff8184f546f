"""A float32 CPU sampler multiplies with prepacked weights (`policy.precision.PACK_LINEAR`):

- a `PackedLinear` gives `F.linear`'s values to float32 rounding, and a row's result does not
  depend on the rows beside it (bit for bit);
- a `packed_view` shares every tensor but the Linear weights with the model and leaves the
  model as it was;
- the trainer's sampler is rebuilt after every applied update, so it decodes with the new
  weights;
- adapter (LoRA) models and `PACK_LINEAR` off keep the plain path (the model itself).

That decoding on it draws the same tokens, μ, top-K and trunk as the previous path, and that a
Trainer step is unchanged, is tests/policy/test_lean_step.py (its previous path turns this
lever off with the others)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import policy.precision as precision
from policy.model import build_tiny_policy
from policy.precision import PackedLinear, build_sampler_model, is_packed, packable
from policy.train_config import TrainConfig
from policy.trainer import Trainer

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(),  # type: ignore[no-untyped-call]
    reason="this torch has no oneDNN",
)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_and_is_row_invariant(bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    lin = nn.Linear(576, 1536, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(1536, 576, generator=gen) * 0.04)
        if bias:
            lin.bias.copy_(torch.randn(1536, generator=gen))
    packed = PackedLinear(lin)
    x = torch.randn(4, 16, 576, generator=gen)  # (batch, positions, features) as in a decoder
    with torch.no_grad():
        out, ref = packed(x), lin(x)
        assert out.shape == ref.shape == (4, 16, 1536)
        assert_close(out, ref, atol=1e-5, rtol=1e-5)  # float32 products, summed in another order
        flat = x.reshape(-1, 576)
        whole = packed(flat)
        for rows in (1, 5, 31, 32, 33):  # the decode batch shrinks as rows finish
            assert torch.equal(packed(flat[:rows]), whole[:rows])
    with torch.no_grad():
        lin.weight.add_(1.0)  # a snapshot: later changes do not reach it
        assert_close(packed(flat), whole, atol=0, rtol=0)
    assert "packed" in repr(packed)


def test_packed_view_shares_all_but_the_linear_weights(smol_tokenizer: Any) -> None:
    model = build_tiny_policy(smol_tokenizer, seed=1, layers=2).train()
    before = {n: p.clone() for n, p in model.named_parameters()}
    assert packable(model)
    view = build_sampler_model(model, "float32", copy_weights=False)
    assert is_packed(view) and view is not model and not view.training
    assert model.training and not is_packed(model)  # the model keeps its structure and mode
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    model_tensors = {t.data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}
    for name, t in itertools.chain(view.named_parameters(), view.named_buffers()):
        assert t.data_ptr() in model_tensors, name  # shared, never copied
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert sum(isinstance(m, PackedLinear) for m in view.modules()) == linears > 0
    ids = torch.tensor([smol_tokenizer("statins and heart disease")["input_ids"]])
    with torch.no_grad():
        assert_close(view(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_the_plain_path_where_packing_does_not_apply(
    smol_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_tiny_policy(smol_tokenizer, seed=1, layers=2)
    monkeypatch.setattr(precision, "PACK_LINEAR", False)
    assert precision.sampler_kernels("cpu") == "plain" and not packable(model)
    assert build_sampler_model(model, "float32", copy_weights=False) is model
    monkeypatch.setattr(precision, "PACK_LINEAR", True)
    assert precision.sampler_kernels("cpu") == "packed"
    assert precision.sampler_kernels("cuda") == "plain"
    assert not packable(model.to(torch.bfloat16))  # float32 weights only


def test_an_adapter_model_is_not_packed(smol_tokenizer: Any) -> None:
    from peft import LoraConfig, get_peft_model

    model = build_tiny_policy(smol_tokenizer, seed=1, layers=2)
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert not packable(peft)
    assert build_sampler_model(peft, "float32", copy_weights=False) is peft


def test_the_trainers_sampler_follows_each_update(
    smol_tokenizer: Any, slice_retrieval: Any, train_scorer: Any
) -> None:
    queries = [
        (q, slice_retrieval.dataset.queries[q]) for q in list(slice_retrieval.dataset.queries)[:2]
    ]
    model = build_tiny_policy(smol_tokenizer, seed=3, layers=2)
    cfg = TrainConfig.from_preset(
        "casi", steps=2, queries=2, samples=2, n_actions=2, line_cap=6, lr=1e-2, list_k=10
    )
    trainer = Trainer(model, smol_tokenizer, cfg, slice_retrieval.executor, train_scorer)
    ids = torch.tensor([smol_tokenizer("vitamin d and bone density")["input_ids"]])

    def logits(m: nn.Module) -> torch.Tensor:
        with torch.no_grad():
            out: torch.Tensor = m(input_ids=ids).logits
        return out

    first = trainer.sampler
    assert is_packed(first)
    assert_close(logits(first), logits(trainer.model.eval()), atol=1e-5, rtol=1e-5)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a change of the weights the sampler has not seen yet
        for module in trainer.model.modules():
            if type(module) is nn.Linear:
                module.weight.add_(torch.randn(module.weight.shape, generator=gen) * 0.05)
    moved = logits(trainer.model.eval())
    assert not torch.allclose(logits(first), moved, atol=1e-3)  # a snapshot: stale now
    result = trainer.train_step(queries)
    assert result.metrics["step_applied"] == 1.0 and trainer.sampler is not first
    assert is_packed(trainer.sampler)
    assert_close(logits(trainer.sampler), logits(trainer.model.eval()), atol=1e-5, rtol=1e-5)
