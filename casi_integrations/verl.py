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
* ``reward_baselines``: CASI's per-action data of each row, (bs, T + 1 + 2M) float64 —
  columns [0, T): the action index of each response token (−1: shared, masked out or padding);
  T: v(N) in float64; [T + 1, T + 1 + M): the credit of the configured mode per action slot (0:
  no such action); [T + 1 + M, T + 1 + 2M): 1 where the slot holds an action, else 0.
  ``pack_rows`` / ``unpack_rows`` are the layout.

The estimator groups rows by uid, computes A_i from each row's reward and the shaped x_ij of the
group (`policy.credit_api`, the shaping ``casi train`` runs), and returns A_i + λ·x_ij on action
tokens, A_i on the others. A row's reward is the float64 v(N) of its packed row when its summed
``token_level_rewards`` equal v(N) in their own dtype (no KL in the reward: the numbers of
``casi train``), else that sum (in float64). Each setting has one home: the credit mode is the
reward side's (``CasiCredit``'s ``credit``); the rest are ``algorithm.casi`` (estimator, mode,
scale, kappa, lam, std_eps of `policy.advantages.ShapingConfig`); either one set in the other's
place is refused. verl's ``grpo`` with ``norm_adv_by_std_in_grpo`` true is ``estimator: grpo``
(ε = 1e-6, the default); false is ``drgrpo``. A group of one row differs: verl's ``grpo`` gives
it its raw score, CASI gives 0 (docs/methods.md §2.1).

verl 0.9.1's default (v1) trainer hands its advantage step a fixed list of fields, without
``reward_baselines``: `casi_integrations.verl_trainer.CasiTrainerMixin` runs this reward side in
that step and holds the packed rows for the estimator (:func:`trainer_rows`); see
docs/integrations.md.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from torch import Tensor
from verl import DataProto
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, register_adv_est

from casi_integrations.credit import CasiCredit
from policy.advantages import (
    ShapingConfig,
    group_advantages,
    select_credit,
    shuffle_credits,
)
from policy.credit_api import (
    Completion,
    CreditTables,
    check_completions,
    credit_table,
    token_stage,
)

CASI_ESTIMATOR = "casi"


# ---------------------------------------------------------------------------- the layout


def pack_rows(
    completions: Sequence[Completion],
    credit: Tensor,
    value_full: Tensor,
    width: int,
    positions: Sequence[Tensor] | None = None,
) -> Tensor:
    """(bs, T + 1 + 2M) float64 (module docstring): each token's action index (−1 none), v(N),
    each slot's credit (0 where the completion has no such action), each slot's validity (1/0).

    credit (bs, M) of the configured mode, value_full (bs,). ``positions[i]``: the column of
    each of completion i's tokens in its row (``response_mask.nonzero()``: a mask with holes,
    e.g. tool tokens of a multi-turn response, spreads a completion over its row); None: the
    tokens are columns 0 … n_i − 1.
    """
    bs, m = credit.shape
    action_of = torch.full((bs, width), -1.0, dtype=torch.float64)
    valid = torch.zeros((bs, m), dtype=torch.bool)
    for i, c in enumerate(completions):
        pos = torch.arange(c.n_tokens) if positions is None else positions[i]
        if len(pos) != c.n_tokens or (len(pos) and int(pos.max()) >= width):
            raise ValueError(
                f"completion {i}: {len(pos)} token positions for {c.n_tokens} tokens in a row of "
                f"{width}"
            )
        for j, (s, e) in enumerate(c.spans):
            action_of[i, pos[s:e]] = float(j)
            valid[i, j] = True
    cells = torch.where(valid, credit.double(), 0.0)
    return torch.cat([action_of, value_full.double()[:, None], cells, valid.double()], dim=1)


@dataclass(frozen=True)
class Rows:
    """``unpack_rows`` output: action_token_mask (bs, M, T) bool, credit (bs, M) float64 (0 at
    no action), action_mask (bs, M) bool, value_full (bs,) float64."""

    action_token_mask: Tensor
    credit: Tensor
    action_mask: Tensor
    value_full: Tensor


def unpack_rows(packed: Tensor, width: int) -> Rows:
    """The rows of ``pack_rows``, checked: a bad shape, validity flags other than 0 / 1, or a
    non-finite v(N) or credit on a real slot is a `ValueError`."""
    extra = packed.shape[1] - width - 1 if packed.dim() == 2 else -1
    if extra < 2 or extra % 2:
        raise ValueError(
            f"reward_baselines must be CASI's (bs, T + 1 + 2M) rows with T = {width}, got shape "
            f"{tuple(packed.shape)}: run CasiVerlReward on the batch before compute_advantage"
        )
    m = extra // 2
    packed = packed.double()
    action_of, value_full = packed[:, :width], packed[:, width]
    cells, flags = packed[:, width + 1 : width + 1 + m], packed[:, width + 1 + m :]
    if not bool(((flags == 0) | (flags == 1)).all()):
        raise ValueError("reward_baselines' validity columns hold values other than 0 and 1")
    valid = flags == 1
    bad = (valid & ~torch.isfinite(cells)).nonzero()
    if len(bad):
        i, j = (int(v) for v in bad[0])
        raise ValueError(f"reward_baselines row {i}, action {j}: credit {float(cells[i, j])}")
    if not bool(torch.isfinite(value_full).all()):
        i = int((~torch.isfinite(value_full)).nonzero()[0, 0])
        raise ValueError(f"reward_baselines row {i}: v(N) is {float(value_full[i])}")
    slots = torch.arange(m, dtype=torch.float64)[None, :, None]
    return Rows(action_of[:, None, :] == slots, torch.where(valid, cells, 0.0), valid, value_full)


# ---------------------------------------------------------------------------- reward side


class CasiVerlReward:
    """The reward side: per-action credit of a verl batch, in-process or through a CASI server.

    ``casi``: the credit source (``CasiCredit.from_beir`` / ``from_components``, or a
    `casi_integrations.service.CreditClient` as its source for a CASI kept as a service), the
    parser, m and the credit mode — the only shaping setting read here; the others are the
    estimator's (``algorithm.casi``), and a ``casi`` that sets them is refused. The batch needs
    ``responses`` (bs, T) and ``response_mask`` (else the last T columns of ``attention_mask``),
    and ``non_tensor_batch["query_id"]`` (``["query"]`` too unless ``casi.queries`` has the ids).
    Only the tokens ``response_mask`` keeps are parsed (a multi-turn response's masked tool
    tokens are skipped); action spans are written at those tokens' own columns.

    ``seed`` and the step seed the ``shuffled`` placebo's draw: ``step`` of a call, or — when
    left out — a counter of this reward side's calls (``calls``); pass verl's ``global_steps``
    (`CasiTrainerMixin` does) to replay the draws of a resumed job. Each row draws its own
    permutation, seeded by (seed, step, its query id and response tokens): the draw does not
    depend on the order of the rows in the batch (`casi train` draws once per batch, in rollout
    order, so a ``shuffled`` run here has the same distribution, not the same permutations).
    """

    def __init__(self, casi: CasiCredit, *, seed: int = 0) -> None:
        default = ShapingConfig(credit=casi.shaping.credit)
        ignored = {
            f.name: getattr(casi.shaping, f.name)
            for f in fields(ShapingConfig)
            if getattr(casi.shaping, f.name) != getattr(default, f.name)
        }
        if ignored:
            raise ValueError(
                f"CasiVerlReward reads only the credit mode of CasiCredit's shaping; {ignored} "
                "belong in verl's algorithm.casi (the casi estimator's settings)"
            )
        self.casi, self.seed, self.calls = casi, seed, 0

    def __call__(self, data: DataProto, step: int | None = None) -> DataProto:
        """Write ``token_level_scores`` and ``reward_baselines`` (module docstring) into ``data``."""
        responses = data.batch["responses"]
        mask = _response_mask(data).cpu().bool()
        positions = [row.nonzero()[:, 0] for row in mask]
        ids = [row[pos].tolist() for row, pos in zip(responses.cpu(), positions, strict=True)]
        texts = data.non_tensor_batch.get("query")
        completions = self.casi.completions(
            ids,
            [str(q) for q in data.non_tensor_batch["query_id"]],
            None if texts is None else list(texts),
        )
        check_completions(completions, self.casi.n_actions, 1)
        credit = self.casi.credit(completions)  # non-finite v(N) or credit: ValueError
        step = self.calls if step is None else step
        rows = [
            f"{c.query_id}\x1f{','.join(map(str, x))}"
            for c, x in zip(completions, ids, strict=True)
        ]
        chosen = self.mode_credit(credit, step, rows)
        self.calls = step + 1
        scores = torch.zeros(responses.shape, dtype=torch.float32)
        last = torch.tensor([int(pos[-1]) if len(pos) else 0 for pos in positions])
        scores[torch.arange(len(ids)), last] = credit.value_full.float()  # verl's outcome reward
        data.batch["token_level_scores"] = scores.to(responses.device)
        packed = pack_rows(completions, chosen, credit.value_full, responses.shape[1], positions)
        data.batch["reward_baselines"] = packed.to(responses.device)
        data.meta_info["casi_cache"] = dict(getattr(credit, "cache", None) or {})
        return data

    def mode_credit(self, credit: CreditTables, step: int, rows: Sequence[str]) -> Tensor:
        """(bs, M) credit of the configured mode; ``shuffled`` permutes φ within each row with a
        generator of its own, seeded by (seed, step, ``rows[i]``: the row's query id and response
        tokens), so a row draws the same permutation wherever it sits in the batch."""
        from policy.trainer import step_seed

        action_mask = torch.arange(credit.phi.shape[1])[None, :] < credit.n_actions[:, None]
        if self.casi.shaping.credit != "shuffled":
            table = credit_table(credit, action_mask, torch.Generator().manual_seed(0))
            return select_credit(table, self.casi.shaping.credit)
        out = torch.zeros(credit.phi.shape, dtype=credit.phi.dtype)
        for i, row in enumerate(rows):
            digest = hashlib.blake2b(row.encode(), digest_size=8).hexdigest()
            gen = torch.Generator().manual_seed(step_seed(self.seed, step, f"shuffled/{digest}"))
            out[i] = shuffle_credits(credit.phi[i : i + 1], action_mask[i : i + 1], gen)[0]
        return out


def _response_mask(data: DataProto) -> Tensor:
    if "response_mask" in data.batch.keys():
        return torch.as_tensor(data.batch["response_mask"])
    width = data.batch["responses"].shape[1]
    return torch.as_tensor(data.batch["attention_mask"][:, -width:])


# ---------------------------------------------------------------------------- estimator


ESTIMATOR_KEYS = ("estimator", "mode", "scale", "kappa", "lam", "std_eps")
"""The `ShapingConfig` fields ``algorithm.casi`` sets; the credit mode is the reward side's."""
BASE_KEY = "base"
"""``algorithm.casi.base``: ``casi`` (default: CASI's float64 A_i, `casi train`'s numbers; a
group of equal rewards gets exactly 0) or ``verl`` (A_i from verl's own
``compute_grpo_outcome_advantage`` on ``token_level_rewards``: its float32 arithmetic, equal-reward
groups and one-row groups included; estimator ``grpo`` or ``drgrpo`` only)."""
BASES = ("casi", "verl")

_TRAINER_ROWS: ContextVar[Tensor | None] = ContextVar("casi_trainer_rows", default=None)
"""CASI's packed rows of the batch whose advantage verl's trainer is computing right now
(`CasiTrainerMixin`): verl 0.9.1's v1 trainer builds the estimator's batch from a fixed list of
fields, so ``reward_baselines`` cannot travel in it."""


@contextmanager
def trainer_rows(rows: Tensor) -> Iterator[None]:
    """While the block runs, the ``casi`` estimator takes ``rows`` (`pack_rows`, in the order of
    the batch verl's advantage step builds) when its batch has no ``reward_baselines``."""
    token = _TRAINER_ROWS.set(rows)
    try:
        yield
    finally:
        _TRAINER_ROWS.reset(token)


def base_source(config: Any) -> str:
    """``algorithm.casi.base`` (:data:`BASE_KEY`), checked; absent: ``casi``."""
    section = None if config is None else config.get("casi", None)
    base = "casi" if section is None else section.get(BASE_KEY, "casi")
    if base not in BASES:
        raise ValueError(f"algorithm.casi.base must be one of {list(BASES)}, got {base!r}")
    return str(base)


def shaping_config(config: Any) -> ShapingConfig:
    """``algorithm.casi`` (a mapping of :data:`ESTIMATOR_KEYS` and :data:`BASE_KEY`) →
    ShapingConfig; absent: defaults. ``credit`` is refused: the reward side chose the credit it
    packed."""
    section = None if config is None else config.get("casi", None)
    if section is None:
        return ShapingConfig()
    if "credit" in section:
        raise ValueError(
            "algorithm.casi.credit is not read: the credit mode is the reward side's "
            "(CasiCredit(..., credit=...) given to CasiVerlReward); drop it"
        )
    unknown = set(section) - {*ESTIMATOR_KEYS, BASE_KEY}
    if unknown:
        raise ValueError(
            f"unknown algorithm.casi keys {sorted(unknown)}; valid: "
            f"{sorted({*ESTIMATOR_KEYS, BASE_KEY})}"
        )
    return ShapingConfig(**{k: section[k] for k in section if k != BASE_KEY})


def _rewards(token_level_rewards: Tensor, value_full: Tensor) -> Tensor:
    """(bs,) float64 rewards: each row's v(N) as the reward side computed it (float64) where the
    row's summed ``token_level_rewards`` is exactly v(N) in their dtype (no KL in the reward),
    else that sum in float64. Non-finite token rewards are a `ValueError`."""
    bad = (~torch.isfinite(token_level_rewards)).any(dim=-1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"token_level_rewards of row {i} are not finite")
    summed = token_level_rewards.sum(-1)
    exact = summed == value_full.to(summed.dtype)
    return torch.where(exact, value_full, token_level_rewards.double().sum(-1))


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
    index (bs,) uids; reward_baselines: CASI's rows (``pack_rows``); absent, the rows
    `CasiTrainerMixin` holds for the batch verl's trainer is computing (:func:`trainer_rows`).
    ``algorithm.casi.base: verl`` takes A_i from verl's own GRPO function (:data:`BASE_KEY`).
    """
    if reward_baselines is None:
        reward_baselines = _TRAINER_ROWS.get()
    if reward_baselines is None:
        raise ValueError(
            "adv_estimator=casi needs CASI's per-action rows: run verl's trainer with "
            "casi_integrations.verl.CasiTrainerMixin, or CasiVerlReward on the batch (its "
            "reward_baselines) before compute_advantage"
        )
    width = token_level_rewards.shape[1]
    if reward_baselines.shape[0] != token_level_rewards.shape[0]:
        raise ValueError(
            f"CASI's rows hold {reward_baselines.shape[0]} rows for a batch of "
            f"{token_level_rewards.shape[0]}"
        )
    rows = unpack_rows(reward_baselines.cpu(), width)
    order, g = _groups(np.asarray(index))
    cfg = shaping_config(config)
    base_from = base_source(config)
    if base_from == "verl" and cfg.estimator not in ("grpo", "drgrpo"):
        raise ValueError(
            f"algorithm.casi.base=verl takes A_i from verl's grpo; estimator {cfg.estimator!r} "
            "has no verl counterpart there: use grpo or drgrpo"
        )
    m = rows.credit.shape[1]
    rewards = _rewards(token_level_rewards.detach().cpu(), rows.value_full)[order].reshape(-1, g)
    mask = rows.action_mask[order].reshape(-1, g, m)
    credit = rows.credit[order].reshape(-1, g, m)
    adv = group_advantages(rewards, {cfg.credit: credit}, mask, cfg)
    base, x = (
        torch.empty(len(order), dtype=torch.float64),
        torch.empty(len(order), m, dtype=torch.float64),
    )
    base[order], x[order] = adv.base.reshape(-1), adv.x.reshape(-1, m)  # back to the batch's rows
    base_tok, shaping_tok = token_stage(
        base, x, rows.action_token_mask, response_mask.cpu().bool(), cfg.lam
    )
    if base_from == "verl":  # verl's own arithmetic for A_i (float32, its group statistics)
        verl_base, _ = compute_grpo_outcome_advantage(
            token_level_rewards.detach().cpu(), response_mask.cpu(), np.asarray(index),
            epsilon=cfg.std_eps, norm_adv_by_std_in_grpo=cfg.estimator == "grpo",
        )  # fmt: skip
        base_tok = verl_base.float()
    out = (base_tok + shaping_tok).to(token_level_rewards.device, token_level_rewards.dtype)
    return out, out
