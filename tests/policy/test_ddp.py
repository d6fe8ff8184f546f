"""Data parallelism: 2 gloo processes (DDP) take the same update as one process on the whole
batch — the loss stack's global counts and dp_world_size make the averaged gradient exact —
for full fine-tuning, LoRA adapters and the top-N layers alike."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from policy.losses.config import DualKLConfig, KLConfig
from policy.losses.presets import load_preset
from policy.losses.stack import LossStack
from policy.model import build_tiny_policy
from policy.params import ParamsConfig, prepare_params
from policy.rollout import collate, sample_rollouts
from policy.sampler import SamplerConfig
from policy.update import UpdateConfig, UpdateInputs, UpdateSpec, policy_update

QUERIES = [
    "vitamin d and bone density",
    "statins and heart disease",
    "p53 mutations in cancer",
    "aspirin",
]
G, LR = 2, 1.0  # SGD with lr 1: the weight change IS the (clipped) gradient, compared directly


def _stack(dual_kl: bool) -> LossStack:
    """The casi preset, with a KL term under dual control when ``dual_kl`` (budget 10, so the
    controller's EMA after one update is that update's KL itself, unclipped)."""
    cfg = load_preset("casi")
    if dual_kl:
        cfg = dataclasses.replace(cfg, kl=KLConfig(estimator="k3", dual=DualKLConfig(budget=10.0)))
    return LossStack(cfg)


def _update(
    model: Any, inputs: UpdateInputs, spec: UpdateSpec, ddp: Any = None, reference: Any = None
) -> LossStack:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    stack = _stack(dual_kl=reference is not None)
    policy_update(model, opt, stack, inputs, spec, ddp=ddp, reference=reference)
    return stack


def _rank(rank: int, world: int, port: int, data: Path, out: Path, params: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        state, inputs, ref_state = torch.load(data, weights_only=False)
        model = build_tiny_policy_from(state, params)
        reference = None if ref_state is None else build_tiny_policy_from(ref_state).eval()
        half = len(inputs.batch) // world
        rows = slice(rank * half, (rank + 1) * half)
        mine = UpdateInputs(
            inputs.batch.select(rows),
            inputs.base_tok[rows],
            inputs.shaping_tok[rows],
            inputs.rewards[rows],
            inputs.groups // world,
        )
        from torch.nn.parallel import DistributedDataParallel as DDP

        stack = _update(
            model,
            mine,
            UpdateSpec(UpdateConfig(micro_batch_size=3), world_size=world),
            ddp=(DDP(model), None),
            reference=reference,
        )
        torch.save((model.state_dict(), stack.state_dict()), out.with_suffix(f".{rank}.pt"))
    finally:
        dist.destroy_process_group()


def build_tiny_policy_from(state: dict[str, Any], params: str = "full") -> Any:
    """The tiny model from ``state`` with ``params`` trainable (LoRA's A init seeded alike)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**state["config"]))
    model.load_state_dict(state["weights"])
    torch.manual_seed(0)
    cfg = ParamsConfig(kind=params, lora_rank=4, top_layers=1)
    return prepare_params(model.eval(), cfg, None, with_reference=False).model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _inputs(model: Any, tok: Any) -> UpdateInputs:
    """Sampled rollouts of QUERIES with random advantages and rewards (seeded)."""
    rollouts = sample_rollouts(
        model, tok, QUERIES, G, 2, SamplerConfig(max_new_tokens=10, seed=0), policy_version="v0"
    )
    batch = collate(rollouts, pad_token_id=tok.pad_token_id, max_actions=2)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(len(batch), 1, generator=gen) * batch.response_mask
    return UpdateInputs(
        batch, base, torch.zeros_like(base), torch.rand(len(batch), generator=gen), len(QUERIES)
    )


def _state(model: Any) -> dict[str, Any]:
    return {
        "config": model.config.to_dict(),
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
    }


def _two_ranks(
    tmp_path: Path, state: dict[str, Any], inputs: UpdateInputs, params: str, ref: Any = None
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each rank's (weights, loss-stack state) after one DDP update on its half of ``inputs``."""
    data, out = tmp_path / "data.pt", tmp_path / "ddp.pt"
    torch.save((state, inputs, ref), data)
    mp.start_processes(
        _rank, args=(2, _free_port(), data, out, params), nprocs=2, join=True, start_method="spawn"
    )
    return [torch.load(out.with_suffix(f".{r}.pt"), weights_only=False) for r in range(2)]


@pytest.mark.integration
@pytest.mark.parametrize("params", ["full", "lora", "top"])
def test_two_gloo_processes_equal_one_process(
    params: str, smol_tokenizer: Any, tmp_path: Path
) -> None:
    model = build_tiny_policy(smol_tokenizer, seed=0, init_std=0.2)
    inputs, state = _inputs(model, smol_tokenizer), _state(model)

    single = build_tiny_policy_from(state, params)
    _update(single, inputs, UpdateSpec(UpdateConfig(micro_batch_size=3)))

    ddp_weights = _two_ranks(tmp_path, state, inputs, params)[0][0]
    moved = False
    assert ddp_weights.keys() == single.state_dict().keys()
    start = build_tiny_policy_from(state, params).state_dict()  # adapters included
    for name, w in single.state_dict().items():
        torch.testing.assert_close(
            ddp_weights[name] - start[name],
            w - start[name],
            rtol=1e-4,
            atol=1e-7,
        )
        moved |= not torch.equal(w, start[name])
    assert moved  # the update did something


@pytest.mark.integration
def test_two_gloo_processes_feed_the_dual_kl_controller_the_whole_batchs_kl(
    smol_tokenizer: Any, tmp_path: Path
) -> None:
    """Under DDP every rank's dual λ_KL controller sees the KL one process sees on the whole
    batch (its ranks' token means weighted by their tokens), not its own half's: the ranks'
    controllers stay equal to each other and to the one process's."""
    model = build_tiny_policy(smol_tokenizer, seed=0, init_std=0.2)
    inputs, state = _inputs(model, smol_tokenizer), _state(model)
    ref_state = _state(build_tiny_policy(smol_tokenizer, seed=1, init_std=0.2))  # KL > 0

    single = _update(
        build_tiny_policy_from(state),
        inputs,
        UpdateSpec(UpdateConfig(micro_batch_size=3)),
        reference=build_tiny_policy_from(ref_state).eval(),
    ).state_dict()["kl"]
    ranks = [st["kl"] for _, st in _two_ranks(tmp_path, state, inputs, "full", ref_state)]
    assert single["ema"] is not None and 0.01 < single["ema"] < 20  # a real KL, not clipped at 2ε
    for kl in ranks:
        assert kl["ema"] == pytest.approx(single["ema"], rel=1e-5)
        assert kl["coef"] == pytest.approx(single["coef"], rel=1e-5, abs=1e-12)


def _flag_rank(rank: int, world: int, port: int, out: Path) -> None:
    from policy.update import _on_every_rank

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:  # finite on rank 0 only, then on both
        got = [_on_every_rank(rank == 0, world), _on_every_rank(True, world)]
        out.with_suffix(f".{rank}.json").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_a_step_is_applied_only_where_every_rank_found_it_finite(tmp_path: Path) -> None:
    """A loss that is non-finite on one rank only skips the step on every rank (that rank alone
    had skipped the step the others took, and their weights parted for good)."""
    out = tmp_path / "flags"
    mp.start_processes(
        _flag_rank, args=(2, _free_port(), out), nprocs=2, join=True, start_method="spawn"
    )
    got = [json.loads(out.with_suffix(f".{r}.json").read_text()) for r in range(2)]
    assert got == [[False, True], [False, True]]
