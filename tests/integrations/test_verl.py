"""The verl adapter (`casi_integrations.verl`), in verl's own environment (`make test-verl`): its
reward side on a CPU `DataProto`, then verl's `compute_advantage` with ``adv_estimator=casi``.

Checked: the same token advantages as CASI's trainer on the fixed batch in every credit mode (the
batch's rows shuffled between the reward and the advantage, as verl may reorder them), verl's own
``grpo`` under broadcast credit, and the refusals. Not run here: a real verl GRPO job (Ray
workers, vLLM/SGLang rollouts, FSDP) — there is no GPU on this machine.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="the verl adapter runs in its own environment: make test-verl")

from fixed_batch import SEED, B, G, M, trainer_advantages  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo.ray_trainer import compute_advantage  # noqa: E402

from casi_integrations.credit import CasiCredit  # noqa: E402
from casi_integrations.verl import CasiVerlReward, compute_casi_advantage  # noqa: E402
from policy.advantages import CREDIT_MODES  # noqa: E402

ROWS = [4, 0, 5, 2, 1, 3]  # the order verl hands the rows to compute_advantage


def _batch(fixed: dict[str, Any], pad: int) -> DataProto:
    ids = fixed["completion_ids"]
    width = max(map(len, ids))
    responses = torch.tensor([x + [pad] * (width - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
    uids = np.array([f"uid-{q}" for q in fixed["query_ids"]], dtype=object)
    return DataProto.from_dict(
        tensors={"responses": responses, "response_mask": mask},
        non_tensors={
            "uid": uids,
            "query_id": np.array(fixed["query_ids"], dtype=object),
            "query": np.array(fixed["queries"], dtype=object),
        },
    )


def _score(data: DataProto, casi: CasiCredit) -> DataProto:
    data = CasiVerlReward(casi, seed=SEED)(data, step=0)
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]  # no KL in the reward
    return data


@pytest.mark.parametrize("mode", CREDIT_MODES)
def test_casi_estimator_gives_the_trainers_token_advantages(
    mode, fixed_batch, smol_tokenizer, slice_retrieval, train_scorer
) -> None:  # type: ignore[no-untyped-def]
    credit, _, ref = trainer_advantages(
        smol_tokenizer, slice_retrieval, train_scorer, fixed_batch, mode
    )
    casi = CasiCredit.from_components(
        slice_retrieval.executor, train_scorer, smol_tokenizer, n_actions=M, credit=mode
    )
    data = _score(_batch(fixed_batch, smol_tokenizer.pad_token_id), casi)
    sums = data.batch["token_level_rewards"].sum(-1)
    torch.testing.assert_close(sums.double(), credit.value_full, atol=1e-6, rtol=0)
    data.reorder(torch.tensor(ROWS))
    out = compute_advantage(data, adv_estimator="casi", config={"casi": {"lam": 0.5}})
    back = torch.empty_like(out.batch["advantages"])
    back[torch.tensor(ROWS)] = out.batch["advantages"]
    torch.testing.assert_close(back, ref.token_adv, atol=1e-6, rtol=0)
    assert back.shape == (B * G, ref.token_adv.shape[1]) and ref.token_adv.abs().max() > 0.1
    if mode != "broadcast":
        assert ref.shaping_tok.abs().max() > 0.1


@pytest.mark.parametrize(("norm", "estimator"), [(True, "grpo"), (False, "drgrpo")])
def test_broadcast_credit_is_verls_grpo(
    norm, estimator, fixed_batch, smol_tokenizer, slice_retrieval, train_scorer
) -> None:  # type: ignore[no-untyped-def]
    casi = CasiCredit.from_components(
        slice_retrieval.executor, train_scorer, smol_tokenizer, n_actions=M, credit="broadcast"
    )
    data = _score(_batch(fixed_batch, smol_tokenizer.pad_token_id), casi)
    data.reorder(torch.tensor(ROWS))
    theirs = compute_advantage(data, adv_estimator="grpo", norm_adv_by_std_in_grpo=norm)
    theirs = theirs.batch["advantages"].clone()
    ours = compute_advantage(data, adv_estimator="casi", config={"casi": {"estimator": estimator}})
    torch.testing.assert_close(ours.batch["advantages"], theirs, atol=1e-6, rtol=0)
    assert theirs.abs().max() > 0.1


def test_the_estimator_refuses_what_it_cannot_align() -> None:
    rewards, mask = torch.zeros(4, 5), torch.ones(4, 5)
    uids = np.array(["a", "a", "b", "b"], dtype=object)
    with pytest.raises(ValueError, match="CasiVerlReward"):
        compute_casi_advantage(rewards, mask, uids)
    with pytest.raises(ValueError, match="shape"):
        compute_casi_advantage(rewards, mask, uids, reward_baselines=torch.zeros(4, 5))
    rows = torch.cat([torch.full((4, 5), -1.0), torch.zeros(4, 2)], dim=1)
    with pytest.raises(ValueError, match="group sizes \\[1, 3\\]"):
        compute_casi_advantage(
            rewards, mask, np.array(["a", "a", "a", "b"], dtype=object), reward_baselines=rows
        )
    with pytest.raises(ValueError, match="unknown algorithm.casi keys \\['lamda'\\]"):
        compute_casi_advantage(rewards, mask, uids, {"casi": {"lamda": 1.0}}, reward_baselines=rows)


def test_the_verl_example_runs_as_written(tmp_path: Any) -> None:
    """docs/integrations.md's verl example, as written, in this environment."""
    from docs_examples import run_example

    out = run_example("verl", tmp_path)
    assert "tensor(" in out and "nan" not in out.lower()
