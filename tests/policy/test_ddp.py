"""Data parallelism: 2 gloo processes (DDP) take the same update as one process on the whole
batch — the loss stack's global counts and dp_world_size make the averaged gradient exact —
for full fine-tuning, LoRA adapters and the top-N layers alike."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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


def _update(model: Any, inputs: UpdateInputs, spec: UpdateSpec, ddp: Any = None) -> None:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    policy_update(model, opt, LossStack(load_preset("casi")), inputs, spec, ddp=ddp)


def _rank(rank: int, world: int, port: int, data: Path, out: Path, params: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        state, inputs = torch.load(data, weights_only=False)
        model = build_tiny_policy_from(state, params)
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

        _update(
            model,
            mine,
            UpdateSpec(UpdateConfig(micro_batch_size=3), world_size=world),
            ddp=(DDP(model), None),
        )
        if rank == 0:
            torch.save(model.state_dict(), out)
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


@pytest.mark.integration
@pytest.mark.parametrize("params", ["full", "lora", "top"])
def test_two_gloo_processes_equal_one_process(
    params: str, smol_tokenizer: Any, tmp_path: Path
) -> None:
    model = build_tiny_policy(smol_tokenizer, seed=0, init_std=0.2)
    rollouts = sample_rollouts(
        model,
        smol_tokenizer,
        QUERIES,
        G,
        2,
        SamplerConfig(max_new_tokens=10, seed=0),
        policy_version="v0",
    )
    batch = collate(rollouts, pad_token_id=smol_tokenizer.pad_token_id, max_actions=2)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(len(batch), 1, generator=gen) * batch.response_mask
    inputs = UpdateInputs(
        batch, base, torch.zeros_like(base), torch.rand(len(batch), generator=gen), len(QUERIES)
    )
    state = {
        "config": model.config.to_dict(),
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
    }
    data = tmp_path / "data.pt"
    torch.save((state, inputs), data)

    single = build_tiny_policy_from(state, params)
    _update(single, inputs, UpdateSpec(UpdateConfig(micro_batch_size=3)))

    out = tmp_path / "ddp.pt"
    mp.start_processes(
        _rank, args=(2, _free_port(), data, out, params), nprocs=2, join=True, start_method="spawn"
    )
    ddp_weights = torch.load(out, weights_only=True)
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
