"""The training step and the state it runs on: rollout → credit → advantages → loss stack →
update → MIPU accept / rollback.

Read :meth:`Trainer.train_step` first (the whole step, top to bottom), then
:func:`policy.update.policy_update` (the update: step-level passes, one `MiniBatch` per
optimizer step) and the `policy.update._mini_batch_step` it calls, where ``backward`` is. The
credit comes from the ONE credit path (`evaluator.credit.compute_credits`) and becomes token
advantages through the ONE entry point TRL and verl use too (`policy.credit_api`), the loss from
the ONE stack built from the preset. A `Trainer` is built once per run from a frozen `TrainConfig`
and holds the model, the optimizer, the LR schedule, the value head, the loss stack (with its
terms' controllers, e.g. the dual λ_KL), the frozen reference policy, the sampler and the step
counter. `state_dict` / `load_state_dict` capture all of it exactly: MIPU rolls back with them,
`policy.checkpoint` saves them for `--resume`.
"""

from __future__ import annotations

import copy
import hashlib
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from evaluator.actions import ActionExecutor
from evaluator.credit import CreditResult, RolloutActions
from evaluator.scorers import SetScorer
from evaluator.text import degenerate
from policy import mipu
from policy.advantages import advantage_metrics, base_advantages
from policy.atomic_folder import atomic_save
from policy.credit_api import EnvironmentCredit, TokenAdvantages, advantages_from_credit
from policy.evaluate import degenerate_rate, duplicate_rate
from policy.forward import ValueHead, logprobs
from policy.losses.stack import LossStack
from policy.model import policy_version, save_checkpoint
from policy.params import decoder_layers, merged_copy, prepare_params, save_adapter
from policy.precision import build_sampler_model, is_packed
from policy.prompts import ContextSource
from policy.rollout import Rollout, RolloutBatch, collate, contexts_for, sample_rollouts
from policy.train_config import TrainConfig
from policy.update import UpdateInputs, UpdateSpec, policy_update

Query = tuple[str, str]  # (query id, text)

TRAIN_ATTENTION_CPU = "eager"
"""Attention of the training forward on CPU. Measured on SmolLM2-135M, 2 cores, bf16 autocast,
8 × 210 tokens: SDPA's flash-attention backward is 25 % of forward + backward and eager
(plain matmuls) makes the pair 30 % faster (3.2 s → 2.2 s); decoding keeps SDPA."""


@dataclass
class StepResult:
    """Everything one step produced (the service records it, the CLI prints it)."""

    step: int
    rollouts: list[Rollout]
    credit: CreditResult
    base: Tensor  # (B, G) base advantages over each query's group
    shaped: Tensor  # (B, G, m) bounded zero-sum shaped credits x
    token_adv: Tensor  # (B·G, T) A_i + λ·x_ij on action tokens
    batch: RolloutBatch
    metrics: dict[str, float]
    accepted: bool | None  # MIPU decision (None when the preset has no MIPU)


def step_seed(seed: int, step: int, purpose: str) -> int:
    """A 63-bit seed per (run seed, step, purpose): draws are reproducible and independent."""
    digest = hashlib.blake2b(f"{seed}/{step}/{purpose}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def query_order(query_ids: Sequence[str], seed: int, step: int, per_step: int) -> list[str]:
    """The ``per_step`` queries of ``step``: a seeded shuffle per epoch, epochs back to back.

    A pure function of (ids, seed, step): a resumed run sees exactly the same data order.
    """
    n = len(query_ids)
    if n == 0:
        raise ValueError("no training queries")
    out = []
    for pos in range(step * per_step, (step + 1) * per_step):
        epoch, i = divmod(pos, n)
        gen = torch.Generator().manual_seed(step_seed(seed, epoch, "epoch"))
        out.append(query_ids[int(torch.randperm(n, generator=gen)[i])])
    return out


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """LR multiplier at optimizer step ``step``: linear warm-up, then the schedule."""
    up = cfg.update
    if up.warmup_steps and step < up.warmup_steps:
        return (step + 1) / up.warmup_steps
    span = max(1, cfg.steps - up.warmup_steps)
    frac = min(1.0, (step - up.warmup_steps) / span)
    if up.schedule == "linear":
        return 1.0 - frac
    if up.schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * frac))
    return 1.0


class Trainer:
    """The state of one training run; `train_step` advances it by one step."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        cfg: TrainConfig,
        executor: ActionExecutor,
        scorer: SetScorer,
        *,
        reference: nn.Module | None = None,
        version: str = "policy",
        world_size: int = 1,
        feedback: ContextSource | None = None,
    ) -> None:
        _set_attention(model, TRAIN_ATTENTION_CPU if _device(model).type == "cpu" else None)
        self.stack = LossStack(cfg.stack)
        needs = self.stack.needs
        prepared = prepare_params(
            model.eval(), cfg.params, reference, with_reference=needs.reference
        )
        model, self.peft, self.reference = prepared.model, prepared.peft, prepared.reference
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.executor, self.scorer = executor, scorer
        if cfg.rollout.needs_context and feedback is None:
            raise ValueError(
                "prompt style 'feedback' needs the game's feedback context source "
                "(Trainer(..., feedback=FeedbackContext(...).contexts))"
            )
        self.feedback = feedback
        hidden: int = getattr(model.config, "hidden_size")  # noqa: B009  (HF config attr)
        self.value_head = ValueHead(hidden).to(_device(model)) if needs.values else None
        params = [p for p in model.parameters() if p.requires_grad]
        if self.value_head is not None:
            params += list(self.value_head.parameters())
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.update.lr, weight_decay=cfg.update.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(cfg, s)
        )
        self.spec = UpdateSpec(
            cfg.update, cfg.sampler.temperature, cfg.stack.critic, world_size=world_size
        )  # the run's sections, not copies of their fields
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.ddp = _wrap_ddp(model, self.value_head) if world_size > 1 else None
        self.start_version, self.step = version, 0
        self.counters = {"skipped_nonfinite": 0, "mipu_accepted": 0, "mipu_rejected": 0}
        self.sampler = self._build_sampler()
        self.capture_layer = _trunk_layer(model, cfg, world_size)

    # ------------------------------------------------------------------ the step

    def train_step(self, queries: Sequence[Query]) -> StepResult:
        """One step on ``queries`` = [(query_id, text)]: sample, credit, shape, update, check."""
        cfg, b, g, m = self.cfg, len(queries), self.cfg.samples, self.cfg.n_actions
        clock = _Clock()
        rollouts = self.sample(queries, g, step_seed(cfg.seed, self.step, "train"))
        clock.lap("generate")
        credit, batch, adv = self.advantages(rollouts)
        # (B·G, T): A_i on loss tokens (0 on forced), λ·x on action tokens, and their sum
        base_tok, shaping_tok, token_adv = adv.base_tok, adv.shaping_tok, adv.token_adv
        clock.lap("credit")
        clock.laps.update({f"credit_{k.removesuffix('_s')}": v for k, v in credit.timings.items()})
        snapshot = self.state_dict() if cfg.mipu_check is not None else None
        inputs = UpdateInputs(batch, base_tok, shaping_tok, credit.value_full.float(), b)
        metrics = policy_update(
            self.model, self.optimizer, self.stack, inputs, self.spec,
            value_head=self.value_head, reference=self.reference, ddp=self.ddp,
        )  # fmt: skip
        self._after_update(applied=bool(metrics["step_applied"] > 0))
        clock.lap("update")
        accepted = self._mipu_check(queries, snapshot, metrics) if snapshot is not None else None
        clock.lap("mipu")
        self.step += 1
        metrics.update(_step_metrics(credit, rollouts, adv.metrics, self.counters))
        metrics.update(advantage_metrics(
            token_adv, adv.x.reshape(b * g, m), batch.action_mask, batch.action_token_mask,
            batch.loss_mask,
        ))  # fmt: skip
        metrics["forced_token_fraction"] = batch.forced_mask.sum() / batch.response_mask.sum()
        metrics.update({"lr": torch.tensor(self.scheduler.get_last_lr()[0]), **clock.metrics()})
        floats = {k: float(v) for k, v in metrics.items()}  # the one conversion per step
        return StepResult(
            self.step,
            rollouts,
            credit,
            adv.base,
            adv.x,
            token_adv,
            batch,
            floats,
            accepted,
        )

    # ------------------------------------------------------------------ the parts

    def sample(
        self, queries: Sequence[Query], n_samples: int, seed: int, *, greedy: bool = False
    ) -> list[Rollout]:
        """G rollouts per query from the current sampler (query-major)."""
        contexts = contexts_for(self.cfg.rollout, self.feedback, [t for _, t in queries])
        return sample_rollouts(
            self.model, self.tokenizer, [t for _, t in queries], n_samples, self.cfg.n_actions,
            self.cfg.draw(seed, greedy=greedy), policy_version=self.version_label,
            sampler_model=self.sampler, query_ids=[q for q, _ in queries],
            prompt_style=self.cfg.rollout.prompt, format=self.cfg.rollout.format,
            line_cap=self.cfg.rollout.line_cap, capture_layer=self.capture_layer,
            contexts=contexts,
        )  # fmt: skip

    def advantages(
        self, rollouts: Sequence[Rollout]
    ) -> tuple[CreditResult, RolloutBatch, TokenAdvantages]:
        """Credit the step's rollouts (ONE call: every action cached, every coalition scored),
        collate them, and turn the credit into token advantages through the entry point the TRL
        and verl adapters use (`policy.credit_api`; the shuffled draw seeded per step)."""
        credit = self.credit(rollouts)
        batch = collate(list(rollouts), pad_token_id=self.pad_id, max_actions=self.cfg.n_actions)
        adv = advantages_from_credit(
            credit, batch.action_mask, batch.action_token_mask, batch.loss_mask, self.cfg.shaping,
            group_size=self.cfg.samples,
            shuffle_seed=step_seed(self.cfg.seed, self.step, "shuffled"),
        )  # fmt: skip
        return credit, batch, adv

    def credit(self, rollouts: Sequence[Rollout]) -> CreditResult:
        """The one credit path on the rollouts' actions, padded to m players."""
        players = [
            RolloutActions(r.query_id, r.query, self._played(r.action_texts)) for r in rollouts
        ]
        source = EnvironmentCredit(
            self.executor, self.scorer, self.cfg.list_k, anchor_query=self.cfg.anchor_query
        )
        credit = source(players, self.cfg.n_actions)
        assert isinstance(credit, CreditResult)
        return credit

    def _played(self, texts: list[str]) -> list[str]:
        """The actions as the game plays them: with ``refuse_degenerate`` a string of repeats
        is an empty action (it retrieves nothing)."""
        if not self.cfg.refuse_degenerate:
            return texts
        return ["" if degenerate(t) else t for t in texts]

    def _after_update(self, *, applied: bool) -> None:
        """Count a skipped (non-finite) update, advance the LR schedule, sync the sampler."""
        self.counters["skipped_nonfinite"] += int(not applied)
        self._advance_schedule()
        if applied:
            self.sampler = self._build_sampler()  # sampler sync

    def _advance_schedule(self) -> None:
        """One training step of the LR schedule: a skipped or rolled-back step counts too, so
        the LR is always a function of the step (docs/methods.md §6.2)."""
        with warnings.catch_warnings():  # a step without optimizer.step() warns
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()

    def _mipu_check(
        self, queries: Sequence[Query], snapshot: dict[str, Any], metrics: dict[str, Tensor]
    ) -> bool:
        """docs/methods.md §3 MIPU: validate the update with the new sampler; roll back if it fails."""
        cfg = self.cfg.mipu_check
        assert cfg is not None
        val = self.sample(
            queries, self.cfg.mipu_samples, step_seed(self.cfg.seed, self.step, "mipu")
        )
        rewards = self.credit(val).value_full.float().reshape(len(queries), self.cfg.mipu_samples)
        adv = base_advantages(rewards, "grpo").reshape(-1)  # Â_i within each validation group
        batch = collate(val, pad_token_id=self.pad_id, max_actions=self.cfg.n_actions)
        logp_new = logprobs(
            self.model, batch, self.cfg.sampler.temperature, self.cfg.update.micro_batch_size
        )
        ell = mipu.sequence_log_ratio(logp_new, batch.sampler_logp, batch.loss_mask)
        t_value = mipu.t_post(ell, adv)
        if self.ddp is not None:  # every rank takes the same decision: the mean over ranks
            torch.distributed.all_reduce(t_value)  # SUM (gloo has no AVG)
            t_value = t_value / torch.distributed.get_world_size()
        decision = self.decide(cfg, float(t_value))
        if not decision.accepted:  # undo the update; the schedule still counts the step
            self.load_state_dict(snapshot)
            self._advance_schedule()
        self.counters["mipu_accepted" if decision.accepted else "mipu_rejected"] += 1
        metrics.update({
            "mipu/t_post": torch.tensor(decision.t_post), "mipu/threshold": torch.tensor(decision.threshold),
            "mipu/accepted": torch.tensor(float(decision.accepted)),
        })  # fmt: skip
        return decision.accepted

    def decide(self, cfg: Any, t_value: float) -> mipu.Decision:
        """The accept / reject rule (a seam for tests that force a decision)."""
        return mipu.decide(cfg, self.step, t_value)

    # ------------------------------------------------------------------ state

    def export_policy(
        self,
        folder: Path,
        base_path: str | None,
        base_version: str,
        extra_files: dict[str, str] | None = None,
    ) -> str:
        """Save the current policy into ``folder`` (full weights, or the LoRA adapter naming
        its base; ``extra_files``: small text files beside them, in the manifest) and return
        its version: the hash of the weights it serves (merged for LoRA)."""
        if self.peft is None:
            save_checkpoint(self.model, self.tokenizer, folder, extra_files=extra_files)
            return policy_version(self.model)

        def write(tmp: Path) -> None:
            save_adapter(self.peft, tmp, base_path, base_version)
            self.tokenizer.save_pretrained(tmp)
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text, encoding="utf-8")

        atomic_save(folder, write)
        return policy_version(merged_copy(self.peft))

    @property
    def version_label(self) -> str:
        """The weights' version as recorded in rollouts: the start version, then `start@step`."""
        return self.start_version if self.step == 0 else f"{self.start_version}@{self.step}"

    def state_dict(self) -> dict[str, Any]:
        """Everything that determines the next steps, deep-copied (MIPU snapshot, resume)."""
        return copy.deepcopy({
            "step": self.step,
            "model": self.model.state_dict(),
            "value_head": self.value_head.state_dict() if self.value_head is not None else None,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "loss": self.stack.state_dict(),  # the loss terms' controllers (e.g. dual λ_KL)
            "counters": dict(self.counters),
            "rng": torch.get_rng_state(),
        })  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict` output exactly (the sampler is rebuilt from the weights)."""
        self.step = int(state["step"])
        self.model.load_state_dict(state["model"])
        if self.value_head is not None and state["value_head"] is not None:
            self.value_head.load_state_dict(state["value_head"])
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.scheduler.load_state_dict(state["scheduler"])
        self.stack.load_state_dict(_loss_state(state))
        self.counters = dict(state["counters"])
        torch.set_rng_state(state["rng"])
        self.sampler = self._build_sampler()

    def _build_sampler(self) -> nn.Module:
        sampler = build_sampler_model(self.model, self.cfg.sampler.precision, copy_weights=False)
        # KV-cached decoding: SDPA is as fast or faster; a packed view keeps the model's attention
        if sampler is not self.model and not is_packed(sampler):
            _set_attention(sampler, "sdpa")
        return sampler


# ---------------------------------------------------------------------- helpers


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _set_attention(model: nn.Module, impl: str | None) -> None:
    """Switch a Hugging Face model's attention implementation (others are left alone)."""
    setter = getattr(model, "set_attn_implementation", None)
    if impl is not None and callable(setter):
        setter(impl)


def _trunk_layer(model: nn.Module, cfg: TrainConfig, world_size: int) -> int | None:
    """L for `params = top` with ``reuse_trunk``: the lowest trained layer, whose input the
    sampler records so the frozen layers below run once per rollout. None when they must be
    recomputed: another kind of params, an explicit KL reference (its lower layers are not the
    policy's), several processes (DDP's forward must see the whole model)."""
    p = cfg.params
    if p.kind != "top" or not p.reuse_trunk or cfg.reference is not None or world_size > 1:
        return None
    start = len(decoder_layers(model)) - p.top_layers
    return start if start >= 1 else None  # every layer trains: no frozen trunk below


def _wrap_ddp(model: nn.Module, head: nn.Module | None) -> tuple[nn.Module, nn.Module | None]:
    """DistributedDataParallel wrappers (the process group is up: torchrun + init_process_group)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model), (DDP(head) if head is not None else None)


def _loss_state(state: dict[str, Any]) -> dict[str, Any]:
    """The loss stack's state; states saved before it had one stored the dual λ_KL as "kl"."""
    if "loss" in state:
        return dict(state["loss"])
    return {"kl": state["kl"]} if state.get("kl") is not None else {}


def _step_metrics(
    credit: CreditResult, rollouts: list[Rollout], adv: dict[str, Tensor], counters: dict[str, int]
) -> dict[str, Tensor]:
    statuses = [r.parsed.status for r in rollouts]
    gain = credit.value_full - credit.value_empty  # v(N) − v(∅): with the anchor, over the query
    return {
        "reward_mean": credit.value_full.mean(),
        "gain_mean": gain.mean(),
        "query_alone_mean": credit.value_empty.mean(),
        "efficiency_residual_max": credit.residual.abs().max(),
        "format_ok_fraction": torch.tensor(statuses.count("ok") / len(statuses)),
        "duplicate_rate": torch.tensor(duplicate_rate(rollouts)),
        "degenerate_rate": torch.tensor(degenerate_rate(rollouts)),
        "actions_mean": credit.n_actions.double().mean(),
        "response_tokens_mean": torch.tensor(
            sum(len(r.response_ids) for r in rollouts) / len(rollouts)
        ),
        "cache/hits": torch.tensor(float(credit.cache["hits"])),
        "cache/misses": torch.tensor(float(credit.cache["misses"])),
        **{f"shaping/{k}": v for k, v in adv.items()},
        **{f"count/{k}": torch.tensor(float(v)) for k, v in counters.items()},
    }


class _Clock:
    """Wall time of each phase of a step (metrics `time/<phase>_s`)."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self.t
        self.t = now

    def metrics(self) -> dict[str, Tensor]:
        total = sum(
            v for k, v in self.laps.items() if not k.startswith("credit_")
        )  # parts of credit
        return {
            **{f"time/{k}_s": torch.tensor(v) for k, v in self.laps.items()},
            "time/step_s": torch.tensor(total),
        }
