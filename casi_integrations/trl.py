"""CASI's per-token advantages inside TRL's `GRPOTrainer` (tested on trl 1.16.0).

Read :class:`CasiGRPOTrainer`. It overrides the one method TRL's maintainers point to for other
advantages, ``_generate_and_score_completions`` (trl #4525): TRL generates and calls CASI's reward
(:meth:`CasiGRPOTrainer.casi_reward`: parse every completion into actions, run them through the
credit source once, return v(N)), computes its own group-normalised advantage, and the override
replaces it with CASI's (B, T) token advantages (`policy.credit_api`): A_i + λ·x_ij on the tokens
of action j, A_i elsewhere. TRL's loss takes (B, T) advantages as they are. Everything else —
generation, the loss and its clipping, the reference model, logging, ``report_to`` — stays TRL's.

The base advantage matches TRL's normalisation: ``scale_rewards="group"`` is CASI's ``grpo`` with
TRL's 1e-4 added to the std, ``"none"`` is ``drgrpo``. Under ``credit="broadcast"`` the token
advantages are TRL's own advantage on every completion token to 1e-6, except in a group whose
rewards are all equal: CASI's A_i is exactly 0 there (`policy.advantages.base_advantages`), TRL's
is its float32 mean's rounding error over 1e-4 (up to ~1.2e-3). ``base_advantage="trl"`` takes
TRL's own (B,) advantage as A_i instead: then broadcast credit is TRL's advantage exactly
(tests/integrations/test_trl.py). A group is gathered across processes before it is shaped, as
TRL gathers rewards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch import Tensor
from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]
from trl.trainer.utils import get_config_model_id

from app.training.splits import split_ids
from casi_integrations.credit import CasiCredit
from evaluator.corpus import Dataset as BeirDataset
from evaluator.feedback import FeedbackContext
from policy.advantages import ShapingConfig
from policy.credit_api import (
    Completion,
    CreditTables,
    GameCredit,
    TokenAdvantages,
    check_completions,
    group_stage,
    span_masks,
    token_stage,
)
from policy.prompts import DEFAULT_FEEDBACK_WORDS, build_prompt_text
from policy.sampler import default_stop_ids
from policy.trainer import step_seed

TRL_STD_EPS = 1e-4
"""What TRL's GRPOTrainer adds to the group's reward std (`_generate_and_score_completions`)."""
TRL_ESTIMATORS = {"group": "grpo", "none": "drgrpo"}
"""TRL's ``scale_rewards`` → CASI's base estimator with the same numbers."""
TRL_AGGREGATION = "sum_then_normalize"
"""TRL's ``multi_objective_aggregation`` whose advantage is a group's normalised reward."""
BaseAdvantage = Literal["casi", "trl"]
"""Where A_i comes from: CASI's float64 estimator (`casi train`'s numbers; a group of equal
rewards gets exactly 0) or TRL's own float32 advantage of the same rewards."""
BASE_ADVANTAGES: tuple[str, ...] = ("casi", "trl")
SEQUENCE_LOSSES = ("vespo",)
"""TRL loss types that read one advantage per completion (they cannot take CASI's per-token one)."""


def trl_matched(casi: CasiCredit, args: GRPOConfig) -> CasiCredit:
    """``casi`` with the base advantage TRL's settings compute (std eps, estimator).

    Refused (`ValueError`), as settings whose numbers CASI's advantage would not match:
    ``scale_rewards="batch"``, ``multi_objective_aggregation`` other than
    ``"sum_then_normalize"``, ``reward_weights`` other than one weight 1, a ``casi`` whose own
    ``estimator`` / ``std_eps`` (not the defaults) differ from what TRL's settings give, and the
    settings whose loss expects one advantage per completion: ``off_policy_mask_threshold`` (its
    mask multiplies a (B,) advantage) and ``loss_type="vespo"`` (sequence-level weights).
    """
    if getattr(args, "off_policy_mask_threshold", None) is not None:
        raise ValueError(
            "CasiGRPOTrainer gives per-token advantages; TRL's off_policy_mask_threshold "
            f"(={args.off_policy_mask_threshold}) expects one advantage per completion: leave it None"
        )
    if args.loss_type in SEQUENCE_LOSSES:
        raise ValueError(
            f"CasiGRPOTrainer gives per-token advantages; loss_type={args.loss_type!r} expects one "
            "advantage per completion: use a token-level loss (e.g. 'dapo', 'grpo', 'dr_grpo')"
        )
    if args.scale_rewards not in TRL_ESTIMATORS:
        raise ValueError(
            f"CasiGRPOTrainer supports scale_rewards {sorted(TRL_ESTIMATORS)} (a group's "
            f"advantage), got {args.scale_rewards!r}"
        )
    aggregation = getattr(args, "multi_objective_aggregation", TRL_AGGREGATION)
    if aggregation != TRL_AGGREGATION:
        raise ValueError(
            f"CasiGRPOTrainer supports multi_objective_aggregation {TRL_AGGREGATION!r} (CASI's "
            f"group advantage of v(N)), got {aggregation!r}"
        )
    weights = getattr(args, "reward_weights", None)
    if weights is not None and [float(w) for w in weights] != [1.0]:
        raise ValueError(
            f"CasiGRPOTrainer's one reward is CASI's v(N) with weight 1; got reward_weights {weights}"
        )
    matched = {"estimator": TRL_ESTIMATORS[args.scale_rewards], "std_eps": TRL_STD_EPS}
    default = ShapingConfig()
    for name, value in matched.items():
        own = getattr(casi.shaping, name)
        if own != getattr(default, name) and own != value:
            raise ValueError(
                f"CasiGRPOTrainer takes {name} from TRL's scale_rewards={args.scale_rewards!r} "
                f"({value!r}); the CasiCredit's {name}={own!r} would be ignored: drop it"
            )
    return casi.with_shaping(**matched)


def casi_dataset(
    beir: BeirDataset,
    split: str,
    tokenizer: Any,
    n_actions: int,
    *,
    prompt_style: str = "oneshot",
    limit: int | None = None,
    feedback: FeedbackContext | None = None,
    feedback_words: int = DEFAULT_FEEDBACK_WORDS,
) -> Any:
    """A `datasets.Dataset` of a split (its first ``limit`` queries) for TRL: ``prompt``
    (CASI's chat prompt asking for m numbered rewrites, as text), ``query_id`` and ``query``.
    The split is `casi train`'s (`app.training.splits.split_ids`): ``train`` leaves out the
    validation slice (``val``) where the dataset ships no DEV split. ``prompt_style`` feedback
    needs ``feedback``, the game's context builder (`CasiCredit.feedback`): each prompt then
    carries its query's first-retrieval words, as `casi train` builds them."""
    from datasets import Dataset

    ids = split_ids(beir, split)[:limit]
    texts = [beir.queries[q] for q in ids]
    contexts: list[str | None] = [None] * len(ids)
    if prompt_style == "feedback":
        if feedback is None:
            raise ValueError(
                "prompt_style 'feedback' needs feedback= (CasiCredit.from_beir(...).feedback)"
            )
        contexts = list(feedback.contexts(texts, feedback_words, n_actions))
    return Dataset.from_dict({
        "prompt": [build_prompt_text(tokenizer, t, n_actions, prompt_style, c)
                   for t, c in zip(texts, contexts, strict=True)],
        "query_id": list(ids),
        "query": [beir.queries[q] for q in ids],
    })  # fmt: skip


@dataclass
class CasiStep:
    """What the last generation batch gave (this process's rows): for tests and inspection."""

    completions: list[Completion]
    credit: CreditTables
    advantages: TokenAdvantages  # of the whole gathered batch; token parts of this process
    trl_advantages: Tensor  # (B,) TRL's own advantage of the same completions
    token_advantages: Tensor  # (B, T) what TRL's loss receives
    shuffle_seed: int  # what seeded the shuffled placebo's draw of this batch


def _columns(name: str, dataset: Any) -> list[tuple[str, Any]]:
    """(what to call it, a dataset) for each part of a dataset or dict of datasets."""
    if isinstance(dataset, dict):
        return [(f"{name}[{k!r}]", part) for k, part in dataset.items()]
    return [] if dataset is None else [(name, dataset)]


class CasiGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` whose advantages are CASI's per-token advantages.

    Takes what `GRPOTrainer` takes, in its order (``model`` positional, ``args`` optional: TRL's
    default `GRPOConfig`), plus ``casi``: the credit source, queries, m and shaping
    (`CasiCredit.from_beir` or `from_components`). The reward is CASI's v(N), so
    ``reward_funcs`` must stay None. Each dataset needs a ``query_id`` column (and ``query``,
    unless ``casi.queries`` has the ids): one without is refused here, in one line.
    ``base_advantage``: ``"casi"`` (default: CASI's A_i, `casi train`'s numbers) or ``"trl"``
    (TRL's own (B,) advantage as A_i, so that broadcast credit is TRL's advantage exactly, equal-
    reward groups included).

    The ``shuffled`` placebo's draw is seeded by (``args.seed``, ``state.global_step``, the batch's
    place in that step): TRL saves ``global_step`` in every checkpoint, so a resumed run draws
    what the uninterrupted run drew; evaluation batches draw from their own stream and never move
    the training draws.
    """

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        *more: Any,
        casi: CasiCredit,
        base_advantage: BaseAdvantage = "casi",
        **kwargs: Any,
    ) -> None:
        if reward_funcs is not None:
            raise ValueError("CasiGRPOTrainer's reward is CASI's v(N); do not pass reward_funcs")
        if base_advantage not in BASE_ADVANTAGES:
            raise ValueError(
                f"base_advantage must be one of {list(BASE_ADVANTAGES)}, got {base_advantage!r}"
            )
        if args is None:  # TRL's own default (GRPOTrainer.__init__)
            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = GRPOConfig(f"{name.split('/')[-1]}-GRPO")
        self.casi = trl_matched(casi, args)
        for where, part in _columns("train_dataset", train_dataset) + _columns(
            "eval_dataset", eval_dataset
        ):
            _check_columns(where, part, self.casi)
        self.casi_seed = args.seed
        self.casi_base: BaseAdvantage = base_advantage
        self.casi_last: CasiStep | None = None
        self._casi_draws: dict[str, tuple[int, int]] = {}  # train | eval → (global_step, batches)
        self._casi_pending: tuple[list[Completion], CreditTables] | None = None
        reward: Any = self.casi_reward  # TRL's reward type: Callable[..., list[float | None]]
        super().__init__(model, [reward], args, train_dataset, eval_dataset, *more, **kwargs)
        if self.casi.stop_token_ids is None:  # parse where `casi train` (and TRL's generation) stop
            stops = default_stop_ids(self.casi.tokenizer, self.model)
            self.casi = replace(self.casi, stop_token_ids=stops)

    def casi_shuffle_seed(self, mode: str) -> int:
        """The seed of this batch's shuffled draw: (args.seed, global_step) for a step's first
        training batch (`casi train`'s step seed), a purpose of its own for any later batch of the
        same step and for evaluation batches."""
        step = int(self.state.global_step)
        last, k = self._casi_draws.get(mode, (step, 0))
        k = k if last == step else 0
        self._casi_draws[mode] = (step, k + 1)
        purpose = "shuffled" if mode == "train" and k == 0 else f"shuffled/{mode}/{k}"
        return step_seed(self.casi_seed, step, purpose)

    def casi_reward(
        self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **kw: Any
    ) -> list[float]:
        """TRL's reward function: parse, credit every action once, remember, return v(N)."""
        parsed = self.casi.completions(completion_ids, kw["query_id"], kw.get("query"))
        check_completions(parsed, self.casi.n_actions, 1)
        credit = self.casi.credit(parsed)
        self._casi_pending = (parsed, credit)
        return [float(v) for v in credit.value_full]

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        return self.casi_apply(super()._generate_and_score_completions(inputs))

    def casi_apply(self, out: dict[str, Any]) -> dict[str, Any]:
        """Replace TRL's (B,) ``advantages`` of a scored batch by CASI's (B, T) ones."""
        if self._casi_pending is None:
            raise RuntimeError("CASI's reward did not run for this batch")
        completions, credit = self._casi_pending
        self._casi_pending = None
        token_mask = out["completion_mask"].bool()
        if "tool_mask" in out:
            token_mask &= out["tool_mask"].bool()
        masks = span_masks(completions, self.casi.n_actions, out["completion_ids"].shape[1])
        mode = "train" if self._training else "eval"
        seed = self.casi_shuffle_seed(mode)
        adv = self._casi_advantages(
            credit, masks.action_mask, masks.action_token_mask, token_mask, seed
        )
        if self.casi_base == "trl":  # A_i: TRL's own float32 advantage of these rows
            base_tok = out["advantages"].detach().float().cpu()[:, None] * token_mask.cpu()
            adv = replace(adv, base_tok=base_tok, token_adv=base_tok + adv.shaping_tok)
        token_adv = adv.token_adv.to(out["advantages"].device)
        self.casi_last = CasiStep(completions, credit, adv, out["advantages"], token_adv, seed)
        self._casi_log(credit, adv, mode)
        out["advantages"] = token_adv  # (B, T): TRL's loss unsqueezes only a (B,) advantage
        return out

    def _casi_advantages(
        self,
        credit: CreditTables,
        action_mask: Tensor,
        action_token_mask: Tensor,
        token_mask: Tensor,
        seed: int,
    ) -> TokenAdvantages:
        """Shape whole groups (gathered from every process), map this process's rows to tokens."""
        game, mask = _gather_game(self.accelerator, credit, action_mask)
        group = self.num_generations if self._training else self.num_generations_eval
        size = group or self.num_generations
        assert size is not None  # TRL's GRPOConfig always sets num_generations
        adv = group_stage(game, mask, self.casi.shaping, int(size), seed)
        start = self.accelerator.process_index * len(action_mask)  # this process's rows
        rows = slice(start, start + len(action_mask))
        m = mask.shape[1]
        base, x = adv.base.reshape(-1)[rows], adv.x.reshape(-1, m)[rows]
        base_tok, shaping_tok = token_stage(
            base, x, action_token_mask, token_mask.cpu(), self.casi.shaping.lam
        )
        return TokenAdvantages(
            adv.base, adv.x, base_tok, shaping_tok, base_tok + shaping_tok, adv.metrics, game
        )

    @property
    def _training(self) -> bool:
        return self.model is not None and self.model.training

    def _casi_log(self, credit: CreditTables, adv: TokenAdvantages, mode: str) -> None:
        cache = getattr(credit, "cache", None) or {}
        game = adv.credit if adv.credit is not None else credit
        values = {
            # adv.x and adv.credit are the gathered batch's (every process's groups)
            "casi/shaping_abs_mean": float(adv.x.abs().sum() / max(1, int(game.n_actions.sum()))),
            "casi/clip_fraction": float(adv.metrics["clip_fraction"]),
            "casi/actions_mean": float(credit.n_actions.double().mean()),
            "casi/cache_hits": float(cache.get("hits", 0)),
            "casi/cache_misses": float(cache.get("misses", 0)),
        }
        for name, value in values.items():
            self._metrics[mode][name].append(value)


def _check_columns(where: str, dataset: Any, casi: CasiCredit) -> None:
    """A dataset without ``query_id`` (or without ``query`` while ``casi.queries`` lacks some of
    its ids) is a one-line `ValueError`; a dataset that does not list its columns passes."""
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        return
    if "query_id" not in columns:
        raise ValueError(
            f"CasiGRPOTrainer's {where} has no 'query_id' column (columns: {list(columns)}); "
            "build it with casi_integrations.trl.casi_dataset or add the query ids"
        )
    if "query" not in columns:
        missing = sorted({str(q) for q in dataset["query_id"]} - set(casi.queries))
        if missing:
            raise ValueError(
                f"CasiGRPOTrainer's {where} has no 'query' column and {len(missing)} of its query "
                f"ids (e.g. {missing[0]!r}) are not in the CasiCredit's queries"
            )


def _gather_game(
    accelerator: Any, credit: CreditTables, action_mask: Tensor
) -> tuple[CreditTables, Tensor]:
    """Every process's credit tables and action masks, concatenated in process order (TRL's
    layout: the G completions of a prompt may sit on several processes)."""
    if accelerator.num_processes == 1:
        return credit, action_mask
    device = accelerator.device

    def gather(t: Tensor) -> Tensor:
        return torch.as_tensor(accelerator.gather(t.to(device))).cpu()

    game = GameCredit(
        gather(credit.n_actions), gather(credit.values), gather(credit.phi),
        gather(credit.singleton), gather(credit.leave_one_out), gather(credit.broadcast),
        torch.zeros(0),
    )  # fmt: skip
    return game, gather(action_mask)


__all__: Sequence[str] = (
    "BASE_ADVANTAGES", "CasiGRPOTrainer", "CasiStep", "casi_dataset", "trl_matched",
)  # fmt: skip
