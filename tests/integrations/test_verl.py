"""The verl adapter (`casi_integrations.verl`), in verl's own environment (`make test-verl`): its
reward side on a CPU `DataProto`, then verl's `compute_advantage` with ``adv_estimator=casi``.

Checked: the same token advantages as CASI's trainer on the fixed batch in every credit mode (the
batch's rows shuffled between the reward and the advantage, as verl may reorder them), verl's own
``grpo`` under broadcast credit, and the refusals. Not run here: a real verl GRPO job (Ray
workers, vLLM/SGLang rollouts, FSDP) — there is no GPU on this machine.
"""

from __future__ import annotations

import dataclasses
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
from policy.advantages import CREDIT_MODES, ShapingConfig, base_advantages  # noqa: E402
from policy.credit_api import (  # noqa: E402
    GameCredit,
    ValueFunctionCredit,
    advantages_from_credit,
    credit_advantages,
    span_masks,
)

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


def _reference(
    mode: str,
    fixed: dict[str, Any],
    tok: Any,
    retrieval: Any,
    scorer: Any,
    casi: CasiCredit,
    packed: torch.Tensor,
) -> Any:
    """What `casi train` computes on the fixed batch; for ``shuffled``, the same shaping of the
    permutations the reward side drew (its draw is per row, casi train's per batch: the same
    distribution, not the same permutations)."""
    credit, _, ref = trainer_advantages(tok, retrieval, scorer, fixed, mode)
    if mode != "shuffled":
        return credit, ref
    width = max(map(len, fixed["completion_ids"]))
    drawn = packed[:, width + 1 : width + 1 + M]
    completions = casi.completions(fixed["completion_ids"], fixed["query_ids"], fixed["queries"])
    masks = span_masks(completions, M, width)
    ref = advantages_from_credit(
        dataclasses.replace(credit, phi=drawn), masks.action_mask, masks.action_token_mask,
        masks.token_mask, ShapingConfig(credit="shapley"), group_size=G, shuffle_seed=0,
    )  # fmt: skip
    return credit, ref


@pytest.mark.parametrize("mode", CREDIT_MODES)
def test_casi_estimator_gives_the_trainers_token_advantages(
    mode, fixed_batch, smol_tokenizer, slice_retrieval, train_scorer
) -> None:  # type: ignore[no-untyped-def]
    casi = CasiCredit.from_components(
        slice_retrieval.executor, train_scorer, smol_tokenizer, n_actions=M, credit=mode
    )
    data = _score(_batch(fixed_batch, smol_tokenizer.pad_token_id), casi)
    credit, ref = _reference(
        mode, fixed_batch, smol_tokenizer, slice_retrieval, train_scorer, casi,
        data.batch["reward_baselines"],
    )  # fmt: skip
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
    # the base taken from verl (algorithm.casi.base: verl): its grpo, bit for bit
    config = {"casi": {"estimator": estimator, "base": "verl"}}
    verl = compute_advantage(data, adv_estimator="casi", config=config)
    assert torch.equal(verl.batch["advantages"], theirs)


def test_the_estimator_refuses_what_it_cannot_align() -> None:
    rewards, mask = torch.zeros(4, 5), torch.ones(4, 5)
    uids = np.array(["a", "a", "b", "b"], dtype=object)
    with pytest.raises(ValueError, match="CasiVerlReward"):
        compute_casi_advantage(rewards, mask, uids)
    with pytest.raises(ValueError, match="shape"):
        compute_casi_advantage(rewards, mask, uids, reward_baselines=torch.zeros(4, 5))
    rows = torch.cat([torch.full((4, 5), -1.0), torch.zeros(4, 3)], dim=1)  # T, v(N), M = 1
    with pytest.raises(ValueError, match="group sizes \\[1, 3\\]"):
        compute_casi_advantage(
            rewards, mask, np.array(["a", "a", "a", "b"], dtype=object), reward_baselines=rows
        )
    with pytest.raises(ValueError, match="unknown algorithm.casi keys \\['lamda'\\]"):
        compute_casi_advantage(rewards, mask, uids, {"casi": {"lamda": 1.0}}, reward_baselines=rows)
    # the credit mode is the reward side's: set in algorithm.casi it would be ignored
    with pytest.raises(ValueError, match="algorithm.casi.credit is not read"):
        compute_casi_advantage(
            rewards, mask, uids, {"casi": {"credit": "broadcast"}}, reward_baselines=rows
        )
    # non-finite rewards, or a non-finite credit on a real slot, never pass as numbers
    nan_rewards = rewards.clone()
    nan_rewards[2, 4] = float("nan")
    with pytest.raises(ValueError, match="token_level_rewards of row 2 are not finite"):
        compute_casi_advantage(nan_rewards, mask, uids, reward_baselines=rows)
    bad = rows.clone()
    bad[1, 6], bad[1, 7] = float("nan"), 1.0  # slot 0 of row 1: valid, credit NaN
    with pytest.raises(ValueError, match="row 1, action 0: credit nan"):
        compute_casi_advantage(rewards, mask, uids, reward_baselines=bad)


def test_the_verl_example_runs_as_written(tmp_path: Any) -> None:
    """docs/integrations.md's verl example, as written, in this environment."""
    from docs_examples import run_example

    out = run_example("verl", tmp_path)
    assert "tensor(" in out and "nan" not in out.lower()


# ---------------------------------------------------------------- beyond the fixed batch


def _game(i: int, s: frozenset[int]) -> float:
    """A small game with distinct credits per row and action (no retrieval)."""
    return 0.1 * len(s) + 0.3 * (0 in s) + 0.07 * i * (1 in s) + 0.05 * i + 0.011 * (2 in s)


def _proto(tok: Any, answers: list[str], uid: str = "g") -> tuple[DataProto, list[list[int]]]:
    rows = [tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for a in answers]
    width = max(map(len, rows))
    data = DataProto.from_dict(
        tensors={
            "responses": torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows]),
            "response_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
        },
        non_tensors={
            "uid": np.array([uid] * len(rows), dtype=object),
            "query_id": np.array(["q"] * len(rows), dtype=object),
        },
    )
    return data, rows


def _advantages(data: DataProto, config: Any = None) -> torch.Tensor:
    out, _ = compute_casi_advantage(
        data.batch["token_level_rewards"], data.batch["response_mask"],
        data.non_tensor_batch["uid"], config, reward_baselines=data.batch["reward_baselines"],
    )  # fmt: skip
    return out


def test_masked_tool_tokens_keep_each_action_on_its_own_tokens(
    fixed_batch, smol_tokenizer, slice_retrieval, train_scorer
) -> None:  # type: ignore[no-untyped-def]
    """A multi-turn response_mask with holes: tool tokens (masked out) before the answer and
    inside it. The actions are parsed from the kept tokens and credited on those tokens' own
    columns: the kept tokens carry the trainer's advantages, the tool tokens 0."""
    _, _, ref = trainer_advantages(
        smol_tokenizer, slice_retrieval, train_scorer, fixed_batch, "shapley"
    )
    casi = CasiCredit.from_components(
        slice_retrieval.executor, train_scorer, smol_tokenizer, n_actions=M
    )
    tool = smol_tokenizer("<tool output: retrieved text>", add_special_tokens=False)["input_ids"]
    rows, keep = [], []
    for ids in fixed_batch["completion_ids"]:
        rows.append(tool + ids[:4] + tool + ids[4:])
        keep.append([0] * len(tool) + [1] * 4 + [0] * len(tool) + [1] * (len(ids) - 4))
    width = max(map(len, rows))
    pad = smol_tokenizer.pad_token_id
    data = _batch(fixed_batch, pad)
    data = DataProto.from_dict(
        tensors={
            "responses": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
            "response_mask": torch.tensor([k + [0] * (width - len(k)) for k in keep]),
        },
        non_tensors=dict(data.non_tensor_batch),
    )
    data = _score(data, casi)
    out = compute_advantage(data, adv_estimator="casi", config={"casi": {"lam": 0.5}})
    expected = torch.zeros(len(rows), width)
    last = []
    for i, k in enumerate(keep):
        pos = torch.tensor(k).nonzero()[:, 0]
        expected[i, pos] = ref.token_adv[i, : len(pos)]
        last.append(int(pos[-1]))
    torch.testing.assert_close(out.batch["advantages"], expected, atol=1e-6, rtol=0)
    assert ref.shaping_tok.abs().max() > 0.1
    # v(N) sits on the last kept token, verl's place of an outcome reward
    scores = data.batch["token_level_scores"]
    assert scores[torch.arange(len(rows)), torch.tensor(last)].tolist() == scores.sum(-1).tolist()


def test_the_reward_side_refuses_shaping_the_estimator_would_ignore(smol_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Each setting has one home: the credit mode on the reward side, the rest in algorithm.casi."""
    shaping = ShapingConfig(lam=0.0, estimator="drgrpo")
    casi = CasiCredit(ValueFunctionCredit(_game), smol_tokenizer, 2, shaping)
    with pytest.raises(ValueError, match="'estimator': 'drgrpo', 'lam': 0.0.*algorithm.casi"):
        CasiVerlReward(casi)
    CasiVerlReward(casi.with_shaping(lam=ShapingConfig().lam, estimator="grpo", credit="singleton"))


def test_the_base_advantage_reads_the_float64_reward(smol_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Rewards that differ below float32's resolution: the estimator's base advantage is the
    entry point's (float64 v(N)), not that of the float32 token_level_scores; with a KL term in
    the reward it falls back to the summed token rewards."""
    base = 0.6309297535714575
    full = [base, base + 2.5e-8, base + 5.5e-8]

    def value(i: int, s: frozenset[int]) -> float:
        return full[i] - 0.3 + 0.3 * (0 in s) if len(s) == 2 else (full[i] - 0.3) * 0.5 * len(s)

    source = ValueFunctionCredit(value)
    casi = CasiCredit(source, smol_tokenizer, 2, queries={"q": "query"})
    data, rows = _proto(smol_tokenizer, ["1. alpha\n2. beta", "1. gamma\n2. delta", "1. e\n2. z"])
    data = CasiVerlReward(casi)(data)
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    ref = credit_advantages(
        casi.completions(rows, ["q"] * 3), source, ShapingConfig(), n_actions=2, group_size=3,
        width=data.batch["responses"].shape[1],
    )  # fmt: skip
    torch.testing.assert_close(_advantages(data), ref.token_adv, atol=1e-6, rtol=0)
    f32 = base_advantages(data.batch["token_level_scores"].sum(-1).double()[None], "grpo")
    assert (f32 - ref.base).abs().max() > 1e-3  # what float32 rewards would have given
    # KL in the reward: the sum of the token rewards is the reward
    kl = 1e-3 * torch.arange(data.batch["responses"].shape[1]) * data.batch["response_mask"]
    data.batch["token_level_rewards"] = data.batch["token_level_scores"] - kl
    rewards = data.batch["token_level_rewards"].double().sum(-1)
    expected = base_advantages(rewards[None], "grpo")[0]
    got = _advantages(data)
    torch.testing.assert_close(got[:, 0], expected.float(), atol=1e-6, rtol=0)


def test_the_shuffled_draw_changes_with_each_call_without_a_step(smol_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Without step= the reward side counts its calls (as the TRL adapter counts batches): the
    placebo's permutation is drawn anew each step, and equals the draws of steps 0, 1, 2."""
    casi = CasiCredit(
        ValueFunctionCredit(lambda i, s: sum((j + 1) * 10.0 ** (-j) for j in s) + 0.01 * i),
        smol_tokenizer, 4, ShapingConfig(credit="shuffled"), queries={"q": "q"},
    )  # fmt: skip
    answers = ["1. a\n2. b\n3. c\n4. d"] * 4

    def draws(reward: CasiVerlReward, steps: list[int | None]) -> list[torch.Tensor]:
        out = []
        for step in steps:
            data = reward(_proto(smol_tokenizer, answers)[0], step=step)
            out.append(data.batch["reward_baselines"].clone())
        return out

    counted = draws(CasiVerlReward(casi, seed=3), [None, None, None])
    assert not torch.equal(counted[0], counted[1]) and not torch.equal(counted[1], counted[2])
    explicit = draws(CasiVerlReward(casi, seed=3), [0, 1, 2])
    assert all(torch.equal(a, b) for a, b in zip(counted, explicit, strict=True))


def test_a_non_finite_credit_is_an_error_not_a_missing_action(smol_tokenizer) -> None:  # type: ignore[no-untyped-def]
    good = ValueFunctionCredit(_game)

    def nan_phi(players: Any, n: int) -> Any:
        t = good(players, n)
        assert isinstance(t, GameCredit)
        phi = t.phi.clone()
        phi[0, 1] = float("nan")
        return dataclasses.replace(t, phi=phi)

    data, _ = _proto(smol_tokenizer, ["1. alpha\n2. beta", "1. gamma\n2. delta"])
    with pytest.raises(ValueError, match=r"completion 0 \(query 'q'\), action 1: .*non-finite phi"):
        CasiVerlReward(CasiCredit(nan_phi, smol_tokenizer, 2, queries={"q": "q"}))(data)
    # a partial game's missing slot is no action (flag 0), whatever its credit cell holds
    data = CasiVerlReward(CasiCredit(good, smol_tokenizer, 3, queries={"q": "q"}))(data)
    width = data.batch["responses"].shape[1]
    flags = data.batch["reward_baselines"][:, width + 1 + 3 :]
    assert flags.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]


# ---------------------------------------------------------------- issue 51: promises made true


class _TransferQueue:
    """TransferQueue's kv interface in memory, as verl 0.9.1's v1 trainer uses it: per-sample
    fields under keys; tensor fields come back as jagged nested tensors, the others as a
    NonTensorStack; fields no row holds are left out (verl asks for optional log-prob fields)."""

    def __init__(self, rows: dict[str, dict[str, Any]]) -> None:
        self.rows = rows

    def kv_batch_get(self, keys: list[str], partition_id: str, select_fields: list[str]) -> Any:
        from tensordict import NonTensorData, NonTensorStack, TensorDict

        out: dict[str, Any] = {}
        for name in select_fields:
            if not all(name in self.rows[k] for k in keys):
                continue
            values = [self.rows[k][name] for k in keys]
            if isinstance(values[0], torch.Tensor):
                out[name] = torch.nested.as_nested_tensor(values, layout=torch.jagged)
            else:
                out[name] = NonTensorStack(*[NonTensorData(v) for v in values])
        return TensorDict(out, batch_size=len(keys))

    def kv_batch_put(self, keys: list[str], partition_id: str, fields: Any) -> Any:
        from transfer_queue import KVBatchMeta

        for name in fields.keys():
            for key, value in zip(keys, fields[name].unbind(), strict=True):
                self.rows[key][name] = value
        return KVBatchMeta(keys=list(keys), tags=[{}] * len(keys), partition_id=partition_id)


def _verl_trainer(
    monkeypatch: Any, rows: dict[str, dict[str, Any]], reward: Any, **casi: Any
) -> Any:
    """verl's v1 sync trainer with CASI's mixin, without Ray: its config, step and TransferQueue."""
    from omegaconf import OmegaConf

    from casi_integrations import verl_trainer

    monkeypatch.setattr(verl_trainer.verl_trainer_base, "tq", _TransferQueue(rows))
    trainer = object.__new__(verl_trainer.CasiPPOTrainerSync)
    trainer.config = OmegaConf.create({
        "algorithm": {"adv_estimator": "casi", "use_kl_in_reward": False, "gamma": 1.0,
                      "lam": 1.0, "norm_adv_by_std_in_grpo": True, "casi": casi},
        "actor_rollout_ref": {"rollout": {"n": G}},
    })  # fmt: skip
    trainer.global_steps, trainer.casi_reward = 0, reward
    return trainer


def test_verls_default_trainer_runs_the_casi_estimator(
    fixed_batch, smol_tokenizer, slice_retrieval, train_scorer, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """verl 0.9.1's default (v1) trainer: its own `_compute_advantage` (the fields it reads from
    TransferQueue, its DataProto, compute_advantage_for_multi_trajectories) with CASI's mixin
    gives casi train's token advantages on the fixed batch, its rows in another order; rm_scores
    hold v(N). A stock v1 trainer never hands the estimator CASI's rows: it refuses, naming the
    mixin."""
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1 import PPOTrainerSync, get_trainer_cls

    from casi_integrations.verl_trainer import CASI_TRAINER_MODE, CasiPPOTrainerSync

    assert get_trainer_cls(CASI_TRAINER_MODE) is CasiPPOTrainerSync
    credit, _, ref = trainer_advantages(
        smol_tokenizer, slice_retrieval, train_scorer, fixed_batch, "shapley"
    )
    casi = CasiCredit.from_components(
        slice_retrieval.executor, train_scorer, smol_tokenizer, n_actions=M,
        queries=dict(zip(fixed_batch["query_ids"], fixed_batch["queries"], strict=True)),
    )  # fmt: skip
    keys = [f"uid-{q}_{i % G}_0" for i, q in enumerate(fixed_batch["query_ids"])]

    def store() -> dict[str, dict[str, Any]]:
        return {
            key: {"responses": torch.tensor(ids), "response_mask": torch.ones(len(ids), dtype=torch.long),
                  "uid": f"uid-{q}", "query_id": q, "rm_scores": torch.zeros(len(ids))}
            for key, ids, q in zip(keys, fixed_batch["completion_ids"], fixed_batch["query_ids"], strict=True)
        }  # fmt: skip

    rows = store()
    trainer = _verl_trainer(monkeypatch, rows, CasiVerlReward(casi, seed=SEED), lam=0.5)
    order = [keys[i] for i in ROWS]
    metrics: dict[str, Any] = {}
    trainer._compute_advantage(
        KVBatchMeta(keys=order, tags=[{}] * len(order), partition_id="train"), metrics
    )
    for i, key in enumerate(keys):
        n = len(fixed_batch["completion_ids"][i])
        torch.testing.assert_close(rows[key]["advantages"], ref.token_adv[i, :n], atol=1e-6, rtol=0)
        assert float(rows[key]["rm_scores"].sum()) == pytest.approx(
            float(credit.value_full[i]), abs=1e-6
        )
    assert ref.shaping_tok.abs().max() > 0.1 and "casi/cache_hits" in metrics
    stock = object.__new__(PPOTrainerSync)
    stock.config = trainer.config
    with pytest.raises(ValueError, match="CasiTrainerMixin"):
        stock._compute_advantage(
            KVBatchMeta(keys=order, tags=[{}] * len(order), partition_id="train"), {}
        )


@pytest.mark.parametrize(
    ("g", "value", "norm", "estimator", "size"),
    [
        (8, 0.997, True, "grpo", 0.106),
        (5, 0.999, True, "grpo", 0.0559),
        (8, 0.997, False, "drgrpo", 1.19e-7),
    ],
)
def test_equal_reward_groups_casi_gives_0_and_base_verl_gives_verls_grpo(
    g, value, norm, estimator, size, smol_tokenizer
) -> None:  # type: ignore[no-untyped-def]
    """Groups whose rewards are all equal (one v(N) for every completion): verl's grpo
    divides its float32 mean's rounding error by std + 1e-6 and pushes every token (the sizes
    docs/integrations.md states); CASI's A_i is exactly 0 (casi train's numbers).
    ``algorithm.casi.base: verl`` takes verl's own arithmetic: bit for bit its grpo."""
    casi = CasiCredit(
        ValueFunctionCredit(lambda i, s: value), smol_tokenizer, 2, ShapingConfig(credit="broadcast"),
        queries={"q": "q"},
    )  # fmt: skip
    answers = [f"1. alpha {i}\n2. beta" for i in range(g)]
    data = CasiVerlReward(casi)(_proto(smol_tokenizer, answers)[0])
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    theirs = compute_advantage(data, adv_estimator="grpo", norm_adv_by_std_in_grpo=norm)
    theirs = theirs.batch["advantages"].clone()
    ours = compute_advantage(data, adv_estimator="casi", config={"casi": {"estimator": estimator}})
    assert torch.equal(ours.batch["advantages"], torch.zeros_like(theirs))
    verl = compute_advantage(
        data, adv_estimator="casi", config={"casi": {"estimator": estimator, "base": "verl"}}
    )
    assert torch.equal(verl.batch["advantages"], theirs)
    assert theirs.abs().max().item() == pytest.approx(size, rel=1e-2, abs=1e-12)
    with pytest.raises(ValueError, match="algorithm.casi.base must be one of"):
        compute_advantage(data, adv_estimator="casi", config={"casi": {"base": "trl"}})
    with pytest.raises(ValueError, match="estimator 'rloo' has no verl counterpart"):
        compute_advantage(
            data, adv_estimator="casi", config={"casi": {"estimator": "rloo", "base": "verl"}}
        )


def test_the_shuffled_draw_does_not_depend_on_row_order(smol_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The same rows handed to the reward side in another order draw the same permutations."""
    casi = CasiCredit(
        ValueFunctionCredit(lambda i, s: sum((j + 1) * 10.0 ** (-j) for j in s)), smol_tokenizer, 4,
        ShapingConfig(credit="shuffled"), queries={"q": "q"},
    )  # fmt: skip
    answers = [f"1. a{i}\n2. b{i}\n3. c{i}\n4. d{i}" for i in range(6)]
    first = CasiVerlReward(casi, seed=3)(_proto(smol_tokenizer, answers)[0], step=5)
    order = [5, 2, 0, 4, 1, 3]
    second = CasiVerlReward(casi, seed=3)(
        _proto(smol_tokenizer, [answers[i] for i in order])[0], step=5
    )
    packed = first.batch["reward_baselines"]
    assert torch.equal(second.batch["reward_baselines"], packed[torch.tensor(order)])
    width = first.batch["responses"].shape[1]
    cells = packed[:, width + 1 : width + 5]
    assert len({tuple(row.tolist()) for row in cells}) > 1, "every row drew the same permutation"
