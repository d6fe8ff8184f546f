"""One policy update on a rollout batch: forwards, loss stack, backward, clip, optimizer step.

Read :func:`policy_update` (the step-level passes, then one `MiniBatch` per optimizer step),
then :func:`_mini_batch_step` (micro-batched forward → loss → ``backward`` → clip → step): from
`Trainer.train_step` to ``backward`` is these two calls. Inputs are flat (B·G rows, T tokens);
the stack gets GLOBAL token and sequence counts, so the gradient does not depend on
``micro_batch_size`` (a test checks it). Passes over the batch:

- the *old pass* (no grad) gives log π_old (and V_old for a critic) — only when it is needed:
  several mini-batches (later ones are off-policy) or a critic (GAE needs every value first).
  With one mini-batch and no critic the step is on-policy and π_old is the loss forward itself,
  detached: one forward per micro-batch, none repeated;
- the *reference pass* (no grad, frozen reference model) when the stack has a KL term;
- the *loss pass* (with grad), micro-batched, accumulating gradients.

A step whose inputs, loss or gradient norm are not finite is skipped (never applied; the
trainer counts it).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from policy.forward import ForwardOut, MiniBatch, ValueHead, build_loss_batch, policy_forward
from policy.losses.config import CriticConfig
from policy.losses.critic import gae
from policy.losses.stack import LossStack
from policy.rollout import RolloutBatch
from policy.sampler import model_device

ADV_WHITEN_EPS = 1e-8
"""Added to the std when whitening GAE advantages (a batch of equal advantages → 0, not 0/0)."""


SCHEDULES = ("constant", "linear", "cosine")
TRAIN_PRECISIONS = ("float32", "bfloat16")


@dataclass(frozen=True)
class UpdateConfig:
    """How the policy is updated on a rollout batch: the optimizer, its schedule, the micro- and
    mini-batching and the training forward's precision (`TrainConfig.update`)."""

    lr: float = 1e-5
    """AdamW peak learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay (0: only the gradient moves the weights)."""
    schedule: str = "constant"
    """LR schedule after warm-up: constant | linear (to 0 at the last step) | cosine."""
    warmup_steps: int = 0
    """Linear LR warm-up steps (from 0 to lr)."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip."""
    micro_batch_size: int = 8
    """Sequences per forward/backward; the gradient does not depend on it (global counts)."""
    mini_batches: int = 1
    """Optimizer steps per rollout batch (PPO epochs over query-aligned splits). With 1 the
    step is on-policy: π_old is the loss forward itself (no extra forward)."""
    train_precision: str = "float32"
    """Training forward: float32, or bfloat16 autocast (fp32 master weights and optimizer)."""
    recompute_old: bool = field(default=False, metadata={"option": False})
    """A separate no-grad π_old pass even when the step is on-policy (what the first trainer
    did; kept so `benchmarks/bench_train.py` can measure what the single forward saves)."""

    def __post_init__(self) -> None:
        if not (self.lr >= 0 and self.weight_decay >= 0):
            raise ValueError("lr and weight_decay must be >= 0")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {self.max_grad_norm}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.mini_batches < 1:
            raise ValueError(f"mini_batches must be >= 1, got {self.mini_batches}")
        if self.train_precision not in TRAIN_PRECISIONS:
            raise ValueError(
                f"train_precision must be one of {list(TRAIN_PRECISIONS)}, got {self.train_precision!r}"
            )


@dataclass(frozen=True)
class UpdateSpec:
    """One update's settings: the run's update section, and the context it runs in."""

    config: UpdateConfig = field(default_factory=UpdateConfig)
    temperature: float = 1.0
    """The sampler's temperature (π is the tempered policy, like μ)."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """γ and λ of GAE when the stack has a critic (the stack's [critic] section)."""
    world_size: int = 1


@dataclass
class UpdateInputs:
    """The rollout batch and its per-token advantages, split into the base and the shaping."""

    batch: RolloutBatch
    base_tok: Tensor  # (N, T) A_i on every response token (replaced by GAE with a critic)
    shaping_tok: Tensor  # (N, T) λ·x_ij on the tokens of action j, 0 elsewhere
    rewards: Tensor  # (N,) v(N): the reward at the end of the response (critic target)
    groups: int  # B: rows are query-major groups of N / B rows

    @property
    def finite(self) -> bool:
        """No NaN or inf in the advantages or rewards (otherwise the step is skipped)."""
        return all(
            bool(torch.isfinite(t).all()) for t in (self.base_tok, self.shaping_tok, self.rewards)
        )


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[None]:
    """bfloat16 autocast for the training forward (fp32 master weights), or nothing."""
    if precision == "bfloat16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _chunks(rows: range, size: int) -> Iterator[slice]:
    for start in range(rows.start, rows.stop, size):
        yield slice(start, min(start + size, rows.stop))


def _device(model: nn.Module) -> torch.device:
    return model_device(model)


@torch.no_grad()
def _no_grad_pass(
    model: nn.Module, batch: RolloutBatch, spec: UpdateSpec, value_head: ValueHead | None
) -> tuple[Tensor, Tensor | None]:
    """(N, T) log-probs (and values) of the whole batch, micro-batched, without gradient."""
    logps, values = [], []
    with autocast(_device(model), spec.config.train_precision):
        for c in _chunks(range(len(batch)), spec.config.micro_batch_size):
            out = policy_forward(model, batch.select(c), spec.temperature, value_head=value_head)
            logps.append(out.logp.float())
            if out.values is not None:
                values.append(out.values.float())
    return torch.cat(logps), (torch.cat(values) if values else None)


def critic_targets(
    values: Tensor, rewards: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """GAE advantages whitened over the batch's valid tokens, and the critic's returns.

    The reward is v(N) at the last valid token (γ = 1 by default: a sparse terminal reward).
    """
    m = mask.to(values.dtype)
    last = (mask.long().cumsum(-1) == mask.long().sum(-1, keepdim=True)) & mask  # (N, T)
    token_rewards = torch.where(last, rewards[:, None].to(values.dtype), 0.0)
    adv, returns = gae(token_rewards, values, mask, gamma, lam)
    n = m.sum().clamp_min(1)
    mean = (adv * m).sum() / n
    std = (((adv - mean) * m).square().sum() / n).sqrt()
    return (adv - mean) / (std + ADV_WHITEN_EPS) * m, returns


def policy_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    stack: LossStack,
    inputs: UpdateInputs,
    spec: UpdateSpec,
    *,
    value_head: ValueHead | None = None,
    reference: nn.Module | None = None,
    ddp: tuple[nn.Module, nn.Module | None] | None = None,
) -> dict[str, Tensor]:
    """Update on ``inputs`` in ``spec.config.mini_batches`` optimizer steps; returns detached metrics.

    Non-finite inputs are not applied (``step_applied`` 0). The step-level no-grad passes run
    first, then each mini-batch is one `MiniBatch` for `_mini_batch_step` (where `backward`
    is). ``ddp``: (DistributedDataParallel of the model, of the value head or None) under
    torchrun; the loss pass goes through them (gradients averaged across ranks on the last
    micro-batch of each mini-batch, `no_sync` before), the no-grad passes use the plain modules.
    """
    if not inputs.finite:
        return {"step_applied": torch.tensor(0.0)}
    batch, needs = inputs.batch, stack.needs
    head = value_head if needs.values else None
    old_logp, old_values = (None, None)
    clock = time.perf_counter()
    if spec.config.mini_batches > 1 or head is not None or spec.config.recompute_old:
        old_logp, old_values = _no_grad_pass(model, batch, spec, head)
    t_old, clock = time.perf_counter() - clock, time.perf_counter()
    ref_logp = (
        _no_grad_pass(reference, batch, spec, None)[0]
        if needs.reference and reference is not None
        else None
    )
    t_ref = time.perf_counter() - clock
    adv, returns = inputs.base_tok + inputs.shaping_tok, None
    if head is not None and old_values is not None:
        gae_adv, returns = critic_targets(
            old_values, inputs.rewards, batch.loss_mask, spec.critic.gamma, spec.critic.lam
        )
        adv = gae_adv + inputs.shaping_tok
    totals: dict[str, Tensor] = {
        "time/old_pass_s": torch.tensor(t_old),
        "time/ref_pass_s": torch.tensor(t_ref),
    }
    all_tokens = int(batch.loss_mask.sum())
    applied = True
    for rows in _mini_batch_rows(len(batch), inputs.groups, spec.config.mini_batches):
        mask = batch.loss_mask[rows]  # forced format tokens count nowhere
        mb = MiniBatch(
            batch.select(rows), adv[rows], _rows(old_logp, rows), _rows(ref_logp, rows),
            _rows(old_values, rows), _rows(returns, rows),
            global_tokens=_global(int(mask.sum()), spec.world_size),
            global_seqs=_global(int(mask.any(-1).sum()), spec.world_size),
        )  # fmt: skip
        m = _mini_batch_step(model, optimizer, stack, mb, spec, head=head, ddp=ddp)
        applied = applied and bool(m["step_applied"] == 1)
        # times add up; the rest is the update's token-weighted mean (a mini-batch's metrics are
        # token means already), as one mini-batch would give
        weight = int(mask.sum()) / all_tokens if all_tokens else 1.0 / spec.config.mini_batches
        for name, v in m.items():
            share = 1.0 if name.startswith("time/") else weight
            totals[name] = totals.get(name, torch.zeros(())) + v * share
    if applied:  # a skipped (non-finite) step feeds no controller: its KL may be NaN
        keys = [f"{name}/value" for name in stack.controllers]
        totals.update(_ranks_token_mean(totals, keys, all_tokens, spec.world_size))
        stack.update_controllers(totals)  # e.g. the dual λ_KL, once per rollout batch
    return totals


def _ranks_token_mean(
    totals: dict[str, Tensor], keys: list[str], tokens: int, world_size: int
) -> dict[str, Tensor]:
    """The controllers' inputs as one process on the whole batch sees them: each rank's token
    mean weighted by its tokens, so every rank feeds its controller the same number (under DDP
    each rank had fed its own rows' KL, and the ranks' λ drifted apart). One process: as is."""
    names = [k for k in keys if k in totals]
    if world_size == 1 or not names:
        return {k: totals[k] for k in names}
    import torch.distributed as dist

    buf = torch.tensor([tokens, *(float(totals[k]) * tokens for k in names)], dtype=torch.float64)
    dist.all_reduce(buf)  # SUM (gloo has no AVG)
    n = float(buf[0])
    return {k: torch.tensor(float(buf[i + 1]) / n if n > 0 else float(totals[k]))
            for i, k in enumerate(names)}  # fmt: skip


def _mini_batch_rows(n_rows: int, groups: int, mini_batches: int) -> list[slice]:
    """The rows of each mini-batch: whole query groups (rows are query-major, ``groups`` groups
    of n_rows / groups rows), the last mini-batch taking the groups left over; when the rows do
    not split into ``mini_batches`` whole groups (fewer groups than mini-batches, ragged rows),
    equal row blocks."""
    if groups >= mini_batches and groups > 0 and n_rows % groups == 0:
        per_group, per_mini = n_rows // groups, groups // mini_batches
        bounds = [k * per_mini * per_group for k in range(mini_batches)] + [n_rows]
    else:
        per_mini = n_rows // mini_batches
        bounds = [k * per_mini for k in range(mini_batches)] + [n_rows]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def _rows(t: Tensor | None, rows: slice) -> Tensor | None:
    return None if t is None else t[rows]


def _mini_batch_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    stack: LossStack,
    mb: MiniBatch,
    spec: UpdateSpec,
    *,
    head: ValueHead | None,
    ddp: tuple[nn.Module, nn.Module | None] | None,
) -> dict[str, Tensor]:
    """One optimizer step on ``mb``: micro-batched forward → loss stack → backward, then
    gradient clip and step (skipped when the loss or the gradient norm is not finite)."""
    n_loss_tokens = max(int(mb.batch.loss_mask.sum()), 1)
    optimizer.zero_grad(set_to_none=True)
    clock = time.perf_counter()
    sums: dict[str, Tensor] = {}
    loss_sum = torch.zeros(())
    device = _device(model)
    chunks = list(_chunks(range(len(mb)), spec.config.micro_batch_size))
    fwd_model, fwd_head = (model, head) if ddp is None else (ddp[0], ddp[1] or head)
    for i, c in enumerate(chunks):
        micro = mb.select(c)
        with _sync(ddp, last=i == len(chunks) - 1), autocast(device, spec.config.train_precision):
            out = policy_forward(
                fwd_model,
                micro.batch,
                spec.temperature,
                with_topk=stack.needs.topk,
                with_entropy=stack.needs.entropy,
                value_head=fwd_head,  # type: ignore[arg-type]
            )
        out = ForwardOut(out.logp.float(), out.topk_logp, out.entropy, out.values)
        loss, metrics = stack(build_loss_batch(out, micro, stack.needs, spec.world_size))
        with _sync(ddp, last=i == len(chunks) - 1):
            loss.backward()  # type: ignore[no-untyped-call]
        loss_sum = loss_sum + loss.detach().cpu()  # global counts: micro-batch losses add up
        share = micro.batch.loss_mask.sum() / n_loss_tokens  # token-weighted metric mean
        for name, v in metrics.items():
            sums[name] = sums.get(name, torch.zeros(())) + v.detach().float().cpu() * share
    t_loss, clock = time.perf_counter() - clock, time.perf_counter()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, spec.config.max_grad_norm)
    finite = _on_every_rank(
        math.isfinite(float(grad_norm)) and math.isfinite(float(loss_sum)), spec.world_size
    )
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {
        **sums,
        "time/loss_backward_s": torch.tensor(t_loss),
        "time/optimizer_s": torch.tensor(time.perf_counter() - clock),
        "loss": loss_sum,
        "grad_norm": grad_norm.detach().cpu(),
        "step_applied": torch.tensor(float(finite)),
    }


def _sync(ddp: tuple[nn.Module, nn.Module | None] | None, last: bool) -> contextlib.ExitStack:
    """DDP's `no_sync` on every wrapped module except for the last micro-batch (which averages
    the accumulated gradients across ranks once)."""
    stack = contextlib.ExitStack()
    if ddp is not None and not last:
        for wrapped in ddp:
            if wrapped is not None:
                stack.enter_context(wrapped.no_sync())  # type: ignore[operator]
    return stack


def _on_every_rank(flag: bool, world_size: int) -> bool:
    """True only if ``flag`` holds on every data-parallel rank (itself in one process): the
    ranks step together or not at all, so their weights never part (a loss that is non-finite
    on one rank only had that rank skip the step the others took)."""
    if world_size == 1:
        return flag
    import torch.distributed as dist

    t = torch.tensor([int(not flag)], dtype=torch.long)
    dist.all_reduce(t)
    return int(t.item()) == 0


def _global(count: int, world_size: int) -> int:
    """Sum of ``count`` over the data-parallel ranks (itself in one process)."""
    if world_size == 1:
        return count
    import torch.distributed as dist

    t = torch.tensor([count], dtype=torch.long)
    dist.all_reduce(t)
    return int(t.item())
