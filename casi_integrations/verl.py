"""CASI's per-action credit in verl (tested on verl 0.9.1, CPU): the ``casi`` advantage
estimator and the reward side that feeds it.

Read :class:`CasiVerlReward` (the reward side), then :func:`compute_casi_advantage` (the
estimator, registered as ``casi`` with ``verl.trainer.ppo.core_algos.register_adv_est`` when this
module is imported).

Why the data travels as it does. verl 0.9.1's ``compute_advantage`` hands a registered estimator
``token_level_rewards``, ``response_mask``, ``index`` (the uid of each row's prompt), ``config``
(the ``algorithm`` section) and, when the batch has it, ``reward_baselines`` — nothing from
``non_tensor_batch`` (verl PR #7473, open, would forward it). So the reward side writes:

* ``token_level_scores``: v(N) at each row's last response token, verl's outcome-reward layout
  (verl's reward metrics, KL-in-reward and the ``grpo`` estimator read the same numbers);
* ``reward_baselines``: CASI's per-action data of each row, (bs, T + M) float64 —
  columns [0, T): the action index of each response token (−1: shared or padding); [T, T + M):
  the credit of the configured mode per action slot (NaN: no such action). ``pack_rows`` /
  ``unpack_rows`` are the layout.

The estimator groups rows by uid, computes A_i from each row's summed ``token_level_rewards``
and the shaped x_ij of the group (`policy.credit_api`, the shaping ``casi train`` runs), and
returns A_i + λ·x_ij on action tokens, A_i on the others. Its settings are ``algorithm.casi``
(the fields of `policy.advantages.ShapingConfig`: estimator, mode, scale, kappa, lam,
std_eps). verl's ``grpo`` with ``norm_adv_by_std_in_grpo`` true is ``estimator: grpo`` (ε = 1e-6,
the default); false is ``drgrpo``. A group of one row differs: verl's ``grpo`` gives it its raw
score, CASI gives 0 (docs/methods.md §2.1).

In verl's own ``RayPPOTrainer.fit`` the reward loop returns one score per sample, so the reward
side must run in the driver between the reward and ``compute_advantage`` (e.g. a trainer whose
``_compute_reward_colocate`` returns the batch this reward side writes); see docs/integrations.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

import numpy as np
import torch
from torch import Tensor
from verl import DataProto
from verl.trainer.ppo.core_algos import register_adv_est

from casi_integrations.credit import CasiCredit
from policy.advantages import ShapingConfig, group_advantages, select_credit
from policy.credit_api import (
    Completion,
    CreditTables,
    check_completions,
    credit_table,
    span_masks,
    token_stage,
)

CASI_ESTIMATOR = "casi"


# ---------------------------------------------------------------------------- the layout


def pack_rows(completions: Sequence[Completion], credit: Tensor, width: int) -> Tensor:
    """(bs, T + M) float64: each token's action index (−1 none), then each slot's credit (NaN
    where the completion has no such action). credit (bs, M) of the configured mode."""
    masks = span_masks(completions, credit.shape[1], width)
    slot = torch.arange(credit.shape[1], dtype=torch.float64)[None, :, None]
    action_of = torch.where(masks.action_token_mask, slot, -1.0).amax(dim=1)  # (bs, T)
    cells = torch.where(masks.action_mask, credit.double(), torch.nan)
    return torch.cat([action_of, cells], dim=1)


def unpack_rows(packed: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """(action_token_mask (bs, M, T) bool, credit (bs, M) float64 with 0 at no action, action
    mask (bs, M) bool) of ``pack_rows`` output."""
    if packed.dim() != 2 or packed.shape[1] <= width:
        raise ValueError(
            f"reward_baselines must be CASI's (bs, T + M) rows with T = {width}, got shape "
            f"{tuple(packed.shape)}: run CasiVerlReward on the batch before compute_advantage"
        )
    action_of, cells = packed[:, :width].double(), packed[:, width:].double()
    m = cells.shape[1]
    slots = torch.arange(m, dtype=torch.float64)[None, :, None]
    valid = ~torch.isnan(cells)
    return action_of[:, None, :] == slots, torch.nan_to_num(cells, nan=0.0), valid


# ---------------------------------------------------------------------------- reward side


class CasiVerlReward:
    """The reward side: per-action credit of a verl batch, in-process or through a CASI server.

    ``casi``: the credit source (``CasiCredit.from_beir`` / ``from_components``, or a
    `casi_integrations.service.CreditClient` as its source for a CASI kept as a service), the
    parser, m and the credit mode. The batch needs ``responses`` (bs, T) and ``response_mask``
    (else the last T columns of ``attention_mask``), and ``non_tensor_batch["query_id"]``
    (``["query"]`` too unless ``casi.queries`` has the ids). ``seed`` and the ``step`` of each call
    seed the ``shuffled`` placebo's draw.
    """

    def __init__(self, casi: CasiCredit, *, seed: int = 0) -> None:
        self.casi, self.seed = casi, seed

    def __call__(self, data: DataProto, step: int = 0) -> DataProto:
        """Write ``token_level_scores`` and ``reward_baselines`` (module docstring) into ``data``."""
        responses = data.batch["responses"]
        mask = _response_mask(data)
        ids = [row[m.bool()].tolist() for row, m in zip(responses.cpu(), mask.cpu(), strict=True)]
        texts = data.non_tensor_batch.get("query")
        completions = self.casi.completions(
            ids,
            [str(q) for q in data.non_tensor_batch["query_id"]],
            None if texts is None else list(texts),
        )
        check_completions(completions, self.casi.n_actions, 1)
        credit = self.casi.credit(completions)
        chosen = self.mode_credit(credit, step)
        scores = torch.zeros(responses.shape, dtype=torch.float32)
        last = mask.long().sum(-1).clamp(min=1) - 1  # verl's place of an outcome reward
        scores[torch.arange(len(ids)), last] = credit.value_full.float()
        data.batch["token_level_scores"] = scores.to(responses.device)
        data.batch["reward_baselines"] = pack_rows(completions, chosen, responses.shape[1]).to(
            responses.device
        )
        data.meta_info["casi_cache"] = dict(getattr(credit, "cache", {}) or {})
        return data

    def mode_credit(self, credit: CreditTables, step: int) -> Tensor:
        """(bs, M) credit of the configured mode; ``shuffled`` permutes φ within each row with a
        generator seeded by (seed, step), as `casi train` seeds it by (run seed, step)."""
        from policy.trainer import step_seed

        action_mask = torch.arange(credit.phi.shape[1])[None, :] < credit.n_actions[:, None]
        gen = torch.Generator().manual_seed(step_seed(self.seed, step, "shuffled"))
        return select_credit(credit_table(credit, action_mask, gen), self.casi.shaping.credit)


def _response_mask(data: DataProto) -> Tensor:
    if "response_mask" in data.batch.keys():
        return torch.as_tensor(data.batch["response_mask"])
    width = data.batch["responses"].shape[1]
    return torch.as_tensor(data.batch["attention_mask"][:, -width:])


# ---------------------------------------------------------------------------- estimator


def shaping_config(config: Any) -> ShapingConfig:
    """``algorithm.casi`` (a mapping of `ShapingConfig` fields) → ShapingConfig; absent: defaults."""
    section = None if config is None else config.get("casi", None)
    if section is None:
        return ShapingConfig()
    names = {f.name for f in fields(ShapingConfig)}
    unknown = set(section) - names
    if unknown:
        raise ValueError(f"unknown algorithm.casi keys {sorted(unknown)}; valid: {sorted(names)}")
    return ShapingConfig(**{k: section[k] for k in section})


def _groups(index: np.ndarray) -> tuple[Tensor, int]:
    """Row order that puts each uid's rows together (first appearance order) and the group size."""
    members: dict[Any, list[int]] = {}
    for row, uid in enumerate(index.tolist()):
        members.setdefault(uid, []).append(row)
    sizes = {len(rows) for rows in members.values()}
    if len(sizes) != 1:
        raise ValueError(f"CASI shapes equal groups; the uids have group sizes {sorted(sizes)}")
    return torch.tensor([r for rows in members.values() for r in rows]), sizes.pop()


@register_adv_est(CASI_ESTIMATOR)  # type: ignore[untyped-decorator]
def compute_casi_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray,
    config: Mapping[str, Any] | None = None,
    reward_baselines: Tensor | None = None,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """CASI's token advantages of a verl batch: (advantages, returns), both (bs, T).

    token_level_rewards (bs, T) (a row's sum is its reward v(N)); response_mask (bs, T);
    index (bs,) uids; reward_baselines: CASI's rows (``pack_rows``).
    """
    if reward_baselines is None:
        raise ValueError(
            "adv_estimator=casi needs CASI's per-action rows in batch['reward_baselines']: run "
            "casi_integrations.verl.CasiVerlReward on the batch before compute_advantage"
        )
    width = token_level_rewards.shape[1]
    spans, credit, valid = unpack_rows(reward_baselines.cpu(), width)
    order, g = _groups(np.asarray(index))
    cfg = shaping_config(config)
    m = credit.shape[1]
    rewards = token_level_rewards.detach().cpu().double().sum(-1)[order].reshape(-1, g)
    mask = valid[order].reshape(-1, g, m)
    adv = group_advantages(rewards, {cfg.credit: credit[order].reshape(-1, g, m)}, mask, cfg)
    base, x = (
        torch.empty(len(order), dtype=torch.float64),
        torch.empty(len(order), m, dtype=torch.float64),
    )
    base[order], x[order] = adv.base.reshape(-1), adv.x.reshape(-1, m)  # back to the batch's rows
    base_tok, shaping_tok = token_stage(base, x, spans, response_mask.cpu().bool(), cfg.lam)
    out = (base_tok + shaping_tok).to(token_level_rewards.device, token_level_rewards.dtype)
    return out, out
