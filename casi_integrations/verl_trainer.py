"""CASI's per-action credit inside verl 0.9.1's default trainer (the v1 ``PPOTrainer``).

Read :class:`CasiTrainerMixin`. verl 0.9.1's default trainer (``trainer.use_v1``) computes
advantages in ``PPOTrainer._compute_advantage``: it reads a fixed list of fields of the batch
from TransferQueue (``uid``, ``response_mask``, ``rm_scores`` and a few log-prob fields), builds a
``DataProto`` from them and calls ``compute_advantage_for_multi_trajectories``, which hands a
registered estimator ``token_level_rewards``, ``response_mask``, the uids and ``algorithm`` —
never ``reward_baselines``, and nothing a reward function wrote. So CASI's reward side runs in
that step, on the whole batch, before verl's own code:

1. the mixin reads the batch's ``responses``, ``response_mask``, ``uid`` and query ids
   (``casi_query_field``, a dataset column: ``query_id``) from TransferQueue;
2. runs `casi_integrations.verl.CasiVerlReward` on them (``step`` = verl's ``global_steps``);
3. writes v(N) back as the batch's ``rm_scores`` (verl's outcome layout: v(N) on the last kept
   token), so verl's rewards, KL-in-reward and logged scores are CASI's v(N);
4. runs verl's own ``_compute_advantage`` while the packed per-action rows are held for the
   ``casi`` estimator (`casi_integrations.verl.trainer_rows`).

``CasiPPOTrainerSync`` is verl's ``PPOTrainerSync`` with the mixin, registered as trainer mode
``casi_sync``: ``trainer.v1.trainer_mode=casi_sync algorithm.adv_estimator=casi``. Importing this
module registers it and the ``casi`` estimator; verl builds its trainer inside its Ray
``TaskRunnerV1`` actor, so that process must import it too (docs/integrations.md).

Needs TransferQueue (verl's ``verl-core`` extra; ``make verl-env`` installs it).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tensordict import TensorDict
from verl import DataProto
from verl.trainer.ppo.v1 import PPOTrainerSync, register_trainer
from verl.trainer.ppo.v1 import trainer_base as verl_trainer_base
from verl.workers.utils.padding import response_to_nested

from casi_integrations.credit import CasiCredit
from casi_integrations.verl import CASI_ESTIMATOR, CasiVerlReward, trainer_rows

CASI_TRAINER_MODE = "casi_sync"


def _values(column: Any) -> list[Any]:
    """A non-tensor TransferQueue column (NonTensorStack, list or array) as a list."""
    return list(column.tolist() if hasattr(column, "tolist") else column)


class CasiTrainerMixin:
    """A verl 0.9.1 v1 trainer whose advantage step runs CASI's reward side (module docstring).

    ``casi_reward``: the reward side; left None, :meth:`build_casi_reward` builds it from the
    config's ``casi`` section at the first step. ``casi_query_field``: the TransferQueue field
    (a dataset column) holding each row's query id. Only ``algorithm.adv_estimator=casi`` is
    touched: another estimator runs verl's step unchanged. One response per prompt session (a
    multi-output agent loop gives a session several rows: CASI shapes equal groups only).
    """

    casi_reward: CasiVerlReward | None = None
    casi_query_field: str = "query_id"
    config: Any
    global_steps: int
    tokenizer: Any

    def build_casi_reward(self) -> CasiVerlReward:
        """The reward side from the config's ``casi`` section: ``dataset`` (a BEIR folder),
        ``n_actions``, and optionally ``credit``, ``split``, ``max_docs``, ``var_dir``, ``seed``
        (`CasiCredit.from_beir`, with the trainer's tokenizer). Override it for another source
        (e.g. a `casi_integrations.service.CreditClient`)."""
        section = self.config.get("casi", None)
        if section is None:
            raise ValueError(
                "CasiTrainerMixin needs a casi section (+casi.dataset=…, +casi.n_actions=…) or "
                "a casi_reward set before the first step"
            )
        known = {"dataset", "n_actions", "credit", "split", "max_docs", "var_dir", "seed"}
        unknown = set(section) - known
        if unknown:
            raise ValueError(f"unknown casi keys {sorted(unknown)}; valid: {sorted(known)}")
        casi = CasiCredit.from_beir(
            section["dataset"], self.tokenizer, n_actions=int(section["n_actions"]),
            credit=section.get("credit", "shapley"), split=section.get("split", "train"),
            max_docs=section.get("max_docs", None), var_dir=section.get("var_dir", "var"),
        )  # fmt: skip
        return CasiVerlReward(casi, seed=int(section.get("seed", 0)))

    def _compute_advantage(self, batch: Any, metrics: dict[str, Any]) -> Any:
        if self.config.algorithm.adv_estimator != CASI_ESTIMATOR:
            return super()._compute_advantage(batch, metrics)  # type: ignore[misc]
        if self.casi_reward is None:
            self.casi_reward = self.build_casi_reward()
        tq = verl_trainer_base.tq  # the TransferQueue verl's own step reads
        fields = ["responses", "response_mask", "uid", self.casi_query_field]
        got = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id, select_fields=fields
        )
        nested_mask = got["response_mask"]
        data = DataProto.from_dict(
            tensors={
                "responses": got["responses"].to_padded_tensor(padding=0),
                "response_mask": nested_mask.to_padded_tensor(padding=0),
            },
            non_tensors={
                "uid": np.array(_values(got["uid"]), dtype=object),
                "query_id": np.array([str(q) for q in _values(got[self.casi_query_field])],
                                     dtype=object),
            },
        )  # fmt: skip
        data = self.casi_reward(data, step=int(self.global_steps))
        scores = data.batch["token_level_scores"]
        rm_scores = response_to_nested(scores, nested_mask)
        tq.kv_batch_put(
            keys=batch.keys, partition_id=batch.partition_id,
            fields=TensorDict({"rm_scores": rm_scores}, batch_size=len(batch.keys)),
        )  # fmt: skip
        cache = data.meta_info.get("casi_cache", {})
        metrics.update({
            "casi/cache_hits": float(cache.get("hits", 0)),
            "casi/cache_misses": float(cache.get("misses", 0)),
            "casi/reward_mean": float(scores.sum(-1).double().mean()),
        })  # fmt: skip
        with trainer_rows(data.batch["reward_baselines"]):
            return super()._compute_advantage(batch, metrics)  # type: ignore[misc]


@register_trainer(CASI_TRAINER_MODE)  # type: ignore[untyped-decorator, unused-ignore]
class CasiPPOTrainerSync(CasiTrainerMixin, PPOTrainerSync):  # type: ignore[misc, unused-ignore]
    """verl's synchronous v1 trainer with CASI's reward side in its advantage step."""


def register() -> None:
    """Ray's ``worker_process_setup_hook`` (``casi_integrations.verl_trainer.register``): run in
    each Ray worker at its start, so that verl's ``TaskRunnerV1`` actor finds the ``casi_sync``
    trainer and the ``casi`` estimator. Importing this module registered both; nothing else to do."""


__all__ = ("CASI_TRAINER_MODE", "CasiPPOTrainerSync", "CasiTrainerMixin", "register")
