"""The TRL adapter (`casi_integrations.trl`): the same numbers as CASI's trainer in every credit
mode, TRL's own advantage under broadcast credit, and two real `GRPOTrainer` steps on a tiny
model over the SciFact slice with real Redis."""

from __future__ import annotations

import copy
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl", reason="the TRL adapter needs the trl extra: pip install -e '.[trl]'")

from fixed_batch import SEED, B, G, M, trainer_advantages  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from app.training.splits import train_val_ids  # noqa: E402
from casi_integrations.credit import CasiCredit  # noqa: E402
from casi_integrations.trl import (  # noqa: E402
    TRL_STD_EPS,
    CasiGRPOTrainer,
    casi_dataset,
    trl_matched,
)
from policy.advantages import CREDIT_MODES, ShapingConfig  # noqa: E402
from policy.credit_api import ValueFunctionCredit  # noqa: E402
from policy.model import build_tiny_policy  # noqa: E402
from policy.parse import parse_actions  # noqa: E402
from policy.sampler import default_stop_ids  # noqa: E402

FORMAT_QUERIES, FORMAT_ACTIONS = 2, 2  # the format policy of tests/conftest.py


def _args(tmp: Path, **kw: Any) -> GRPOConfig:
    base = dict(
        output_dir=str(tmp), use_cpu=True, report_to="none", save_strategy="no", seed=SEED,
        per_device_train_batch_size=B * G, num_generations=G, max_completion_length=40,
        max_steps=2, logging_steps=1, learning_rate=1e-3, beta=0.0, temperature=0.7,
        scale_rewards="group", dataloader_num_workers=0,
    )  # fmt: skip
    return GRPOConfig(**{**base, **kw})


def _trainer(model: Any, tok: Any, casi: CasiCredit, ds: Any, tmp: Path, **kw: Any) -> Any:
    return CasiGRPOTrainer(
        model=model, casi=casi, args=_args(tmp, **kw), train_dataset=ds, processing_class=tok
    )


@pytest.mark.parametrize("mode", CREDIT_MODES)
def test_trl_path_gives_the_trainers_token_advantages(
    mode, fixed_batch, smol_tokenizer, slice_retrieval, train_scorer, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    credit, _, ref = trainer_advantages(
        smol_tokenizer, slice_retrieval, train_scorer, fixed_batch, mode, std_eps=TRL_STD_EPS
    )
    casi = CasiCredit.from_components(
        slice_retrieval.executor, train_scorer, smol_tokenizer, n_actions=M, credit=mode
    )
    ds = casi_dataset(slice_retrieval.dataset, "train", smol_tokenizer, M, limit=B)
    trainer = _trainer(build_tiny_policy(smol_tokenizer), smol_tokenizer, casi, ds, tmp_path)
    ids = fixed_batch["completion_ids"]
    trainer.model.train()  # a training batch: the shuffled draw of step 0 is casi train's
    rewards = trainer.casi_reward(
        prompts=[""] * len(ids), completions=[""] * len(ids), completion_ids=ids,
        query_id=fixed_batch["query_ids"], query=fixed_batch["queries"],
    )  # fmt: skip
    width = max(map(len, ids))
    padded = torch.tensor([x + [0] * (width - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
    out = trainer.casi_apply(
        {"completion_ids": padded, "completion_mask": mask, "advantages": torch.zeros(len(ids))}
    )
    assert rewards == pytest.approx(credit.value_full.tolist(), abs=1e-6)
    torch.testing.assert_close(out["advantages"], ref.token_adv, atol=1e-6, rtol=0)
    assert out["advantages"].shape == (B * G, width) and ref.token_adv.abs().max() > 0.1
    if mode != "broadcast":  # the per-action part is there: action tokens differ from A_i
        assert ref.shaping_tok.abs().max() > 0.1


def _history(trainer: Any) -> list[Any]:
    seen = []
    original = trainer.casi_apply

    def record(out: dict[str, Any]) -> dict[str, Any]:
        res = original(out)
        seen.append(copy.copy(trainer.casi_last))
        return res

    trainer.casi_apply = record
    return seen


def test_two_real_grpo_steps_with_per_action_advantages(
    format_policy, smol_tokenizer, slice_retrieval, train_scorer, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    casi = CasiCredit.from_components(  # no anchor: the slice's query alone scores 1 already
        slice_retrieval.executor, train_scorer, smol_tokenizer, n_actions=FORMAT_ACTIONS,
        anchor_query=False,
    )  # fmt: skip
    ds = casi_dataset(
        slice_retrieval.dataset, "train", smol_tokenizer, FORMAT_ACTIONS, limit=FORMAT_QUERIES
    )
    model = copy.deepcopy(format_policy)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(model, smol_tokenizer, casi, ds, tmp_path)
    steps = _history(trainer)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 2 and len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    # advantages differ between the actions of one completion
    split = False
    for step in steps:
        for i, c in enumerate(step.completions):
            means = {float(step.token_advantages[i, s:e].mean()) for s, e in c.spans}
            split |= len(c.spans) >= 2 and max(means) - min(means) > 1e-3
    assert split, [c.actions for c in steps[0].completions]
    # the second step's actions were cached by the first: hits, and a repeated action
    first = {a.lower() for c in steps[0].completions for a in c.actions}
    assert steps[1].credit.cache["hits"] > 0
    assert first & {a.lower() for c in steps[1].completions for a in c.actions}


def test_broadcast_credit_is_trls_own_advantage(
    format_policy, smol_tokenizer, slice_retrieval, train_scorer, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    casi = CasiCredit.from_components(
        slice_retrieval.executor, train_scorer, smol_tokenizer, n_actions=FORMAT_ACTIONS,
        credit="broadcast", anchor_query=False,
    )  # fmt: skip
    ds = casi_dataset(
        slice_retrieval.dataset, "train", smol_tokenizer, FORMAT_ACTIONS, limit=FORMAT_QUERIES
    )
    for scale in ("group", "none"):
        trainer = _trainer(
            copy.deepcopy(format_policy), smol_tokenizer, casi, ds, tmp_path, max_steps=1,
            scale_rewards=scale, temperature=1.5,
        )  # fmt: skip
        steps = _history(trainer)
        trainer.train()
        last = steps[0]
        mask = torch.tensor([[t < c.n_tokens for t in range(last.token_advantages.shape[1])]
                             for c in last.completions])  # fmt: skip
        expected = last.trl_advantages[:, None] * mask
        torch.testing.assert_close(last.token_advantages, expected, atol=1e-6, rtol=0)
        assert last.trl_advantages.abs().max() > 0, "rewards equal in every group: nothing tested"


def test_trl_settings_casi_cannot_match_are_refused(smol_tokenizer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    casi = CasiCredit(lambda players, n: None, smol_tokenizer, 2)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="scale_rewards"):
        CasiGRPOTrainer(model=build_tiny_policy(smol_tokenizer), casi=casi,
                        args=_args(tmp_path, scale_rewards="batch"), processing_class=smol_tokenizer)  # fmt: skip
    with pytest.raises(ValueError, match="reward_funcs"):
        CasiGRPOTrainer(model=build_tiny_policy(smol_tokenizer), casi=casi, args=_args(tmp_path),
                        reward_funcs=[len], processing_class=smol_tokenizer)  # fmt: skip
    # TRL's normalize_then_sum is not a group's normalised v(N); nor is a weighted reward
    with pytest.raises(ValueError, match="multi_objective_aggregation 'sum_then_normalize'"):
        trl_matched(casi, _args(tmp_path, multi_objective_aggregation="normalize_then_sum"))
    with pytest.raises(ValueError, match="reward_weights"):
        trl_matched(casi, _args(tmp_path, reward_weights=[2.0]))
    trl_matched(casi, _args(tmp_path, reward_weights=[1.0]))
    # the base estimator is TRL's: a CasiCredit asking for another one is refused, not ignored
    with pytest.raises(ValueError, match="estimator='rloo' would be ignored"):
        trl_matched(casi.with_shaping(estimator="rloo"), _args(tmp_path))
    with pytest.raises(ValueError, match="estimator='drgrpo' would be ignored"):
        trl_matched(casi.with_shaping(estimator="drgrpo"), _args(tmp_path, scale_rewards="group"))
    assert trl_matched(casi, _args(tmp_path, scale_rewards="none")).shaping.estimator == "drgrpo"


def test_completions_are_parsed_where_trl_and_casi_train_stop(smol_tokenizer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A model whose generation_config declares another end token (an end-of-turn id): TRL stops
    there, and `casi train` parses with `default_stop_ids(tokenizer, model)`; so does the
    adapter, unless the CasiCredit names its own stop ids."""

    def enc(text: str) -> list[int]:
        return list(smol_tokenizer(text, add_special_tokens=False)["input_ids"])

    end = enc(" stop")[0]  # not a special token: only the model's config makes it an end
    assert end not in smol_tokenizer.all_special_ids
    model: Any = build_tiny_policy(smol_tokenizer)
    model.generation_config.eos_token_id = [smol_tokenizer.eos_token_id, end]
    ids = enc("1. alpha beta\n2. gamma delta") + [end] + enc("\n3. after the end")
    casi = CasiCredit(ValueFunctionCredit(_game), smol_tokenizer, 3, queries={"q": "query"})
    trainer = CasiGRPOTrainer(
        model=model, casi=casi, args=_args(tmp_path), train_dataset=_prompts(),
        processing_class=smol_tokenizer,
    )  # fmt: skip
    stops = default_stop_ids(smol_tokenizer, model)
    assert end in stops and trainer.casi.stop_token_ids == stops
    expected = parse_actions(ids, smol_tokenizer, 3, stops)
    (got,) = trainer.casi.completions([ids], ["q"])
    assert got.actions == ("alpha beta", "gamma delta") == tuple(a.text for a in expected.actions)
    assert got.spans == tuple((a.token_start, a.token_end) for a in expected.actions)
    own = CasiCredit(
        ValueFunctionCredit(_game), smol_tokenizer, 3, queries={"q": "query"}, stop_token_ids=(7,)
    )
    kept = CasiGRPOTrainer(
        model=model, casi=own, args=_args(tmp_path), train_dataset=_prompts(),
        processing_class=smol_tokenizer,
    )  # fmt: skip
    assert kept.casi.stop_token_ids == (7,)


def _prompts() -> Any:
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ["a query"] * B * G, "query_id": ["q"] * B * G})


def _game(i: int, s: frozenset[int]) -> float:
    return 0.1 * len(s) + 0.3 * (0 in s) + 0.05 * i


class _Processes:
    """An accelerator of ``n`` processes whose every process holds the same rows (process 0)."""

    def __init__(self, n: int) -> None:
        self.num_processes, self.process_index, self.device = n, 0, "cpu"

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t] * self.num_processes)


def test_the_logged_shaping_mean_is_over_the_gathered_actions(smol_tokenizer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """casi/shaping_abs_mean: the gathered Σ|x| over the gathered action count, so the same
    groups on 1, 2 or 4 processes log the same number."""
    casi = CasiCredit(ValueFunctionCredit(_game), smol_tokenizer, 2, queries={"q": "query"})
    trainer = CasiGRPOTrainer(
        model=build_tiny_policy(smol_tokenizer), casi=casi, args=_args(tmp_path, num_generations=2),
        train_dataset=_prompts(), processing_class=smol_tokenizer,
    )  # fmt: skip

    def enc(text: str) -> list[int]:
        return list(smol_tokenizer(text, add_special_tokens=False)["input_ids"])

    rows = [enc(a) + [smol_tokenizer.eos_token_id] for a in ["1. alpha\n2. beta", "1. c\n2. d"]]
    width = max(map(len, rows))
    logged = []
    for n in (1, 2, 4):
        trainer.accelerator = _Processes(n)
        trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        trainer.casi_reward(
            prompts=["", ""], completions=["", ""], completion_ids=rows, query_id=["q", "q"]
        )
        trainer.casi_apply({
            "completion_ids": torch.zeros(2, width, dtype=torch.long),
            "completion_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
            "advantages": torch.zeros(2),
        })  # fmt: skip
        (values,) = [m["casi/shaping_abs_mean"] for m in trainer._metrics.values() if m]
        logged.append(values[0])
    assert logged[0] > 0.01 and logged == pytest.approx([logged[0]] * 3, rel=1e-12)


def test_casi_dataset_holds_out_casi_trains_validation_slice(smol_tokenizer, slice_dataset) -> None:  # type: ignore[no-untyped-def]
    train, val = train_val_ids(slice_dataset)
    assert val, "the slice has no validation slice: nothing tested"
    assert casi_dataset(slice_dataset, "train", smol_tokenizer, M)["query_id"] == train
    assert casi_dataset(slice_dataset, "val", smol_tokenizer, M)["query_id"] == val


# ---------------------------------------------------------------- issue 51: promises made true


def _constant_casi(tok: Any, value: float, credit: str = "broadcast") -> CasiCredit:
    """A game worth ``value`` whatever the actions: every group's rewards are equal."""
    return CasiCredit(
        ValueFunctionCredit(lambda i, s: value), tok, 2, ShapingConfig(credit=credit),  # type: ignore[arg-type]
        queries={"q": "a query"},
    )  # fmt: skip


def test_equal_reward_groups_casi_gives_0_and_base_advantage_trl_gives_trls_own(
    smol_tokenizer, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """G = 8 completions whose rewards are all 0.7: TRL's float32 mean misses 0.7 by a rounding
    step and its advantage is that step over 1e-4 (5.96e-4) on every token; CASI's A_i is exactly
    0 (casi train's numbers). base_advantage="trl" takes TRL's own advantage: equal to it bit for
    bit under broadcast credit."""
    for base in ("casi", "trl"):
        trainer = CasiGRPOTrainer(
            model=build_tiny_policy(smol_tokenizer), casi=_constant_casi(smol_tokenizer, 0.7),
            args=_args(tmp_path, num_generations=8, per_device_train_batch_size=8,
                       max_completion_length=8, max_steps=1),
            train_dataset=_prompts(), processing_class=smol_tokenizer, base_advantage=base,
        )  # fmt: skip
        steps = _history(trainer)
        trainer.train()
        last = steps[0]
        trl = last.trl_advantages
        assert trl.abs().max().item() == pytest.approx(5.96e-4, rel=1e-2), "TRL's own is not 0"
        if base == "casi":
            assert torch.equal(last.token_advantages, torch.zeros_like(last.token_advantages))
        else:
            mask = torch.tensor([[t < c.n_tokens for t in range(last.token_advantages.shape[1])]
                                 for c in last.completions])  # fmt: skip
            assert torch.equal(last.token_advantages, trl[:, None] * mask)
            assert last.token_advantages.abs().max() > 0
    with pytest.raises(ValueError, match="base_advantage must be one of"):
        CasiGRPOTrainer(model=build_tiny_policy(smol_tokenizer), casi=_constant_casi(smol_tokenizer, 1),
                        args=_args(tmp_path), base_advantage="verl")  # type: ignore[arg-type]  # fmt: skip


def test_the_trainer_takes_what_grpotrainer_takes(smol_tokenizer, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """model positional, args optional (TRL's default GRPOConfig), the rest in GRPOTrainer's order.
    TRL's default config asks for bf16, which this CPU machine lacks (GRPOTrainer itself fails the
    same way here): the default is built with use_cpu added."""
    import casi_integrations.trl as adapter

    monkeypatch.chdir(tmp_path)
    made = []

    def default_config(output_dir: str) -> GRPOConfig:
        made.append(output_dir)
        return GRPOConfig(output_dir, use_cpu=True, report_to="none", num_generations=2,
                          per_device_train_batch_size=2)  # fmt: skip

    monkeypatch.setattr(adapter, "GRPOConfig", default_config)
    casi = _constant_casi(smol_tokenizer, 0.5)
    model = build_tiny_policy(smol_tokenizer)
    default = CasiGRPOTrainer(model, casi=casi, train_dataset=_prompts(),
                              processing_class=smol_tokenizer)  # fmt: skip
    assert made == [f"{model.config._name_or_path.split('/')[-1]}-GRPO"]
    assert default.args.output_dir.endswith("-GRPO")
    positional = CasiGRPOTrainer(model, None, _args(tmp_path), _prompts(), None, smol_tokenizer,
                                 casi=casi)  # fmt: skip
    assert positional.train_dataset is not None and positional.processing_class is smol_tokenizer


def test_a_dataset_without_query_ids_is_refused_in_one_line(smol_tokenizer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from datasets import Dataset

    casi = _constant_casi(smol_tokenizer, 0.5)
    no_ids = Dataset.from_dict({"prompt": ["a query"] * 4})
    for kw in ({"train_dataset": no_ids}, {"train_dataset": _prompts(), "eval_dataset": no_ids}):
        with pytest.raises(ValueError, match="has no 'query_id' column") as err:
            CasiGRPOTrainer(model=build_tiny_policy(smol_tokenizer), args=_args(tmp_path), casi=casi,
                            processing_class=smol_tokenizer, **kw)  # fmt: skip
        assert "\n" not in str(err.value)
    unknown = Dataset.from_dict({"prompt": ["a"] * 4, "query_id": ["elsewhere"] * 4})
    with pytest.raises(ValueError, match="no 'query' column and 1 of its query ids"):
        CasiGRPOTrainer(model=build_tiny_policy(smol_tokenizer), args=_args(tmp_path), casi=casi,
                        train_dataset=unknown, processing_class=smol_tokenizer)  # fmt: skip


def test_losses_that_expect_one_advantage_per_completion_are_refused(
    smol_tokenizer, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    casi = _constant_casi(smol_tokenizer, 0.5)
    with pytest.raises(ValueError, match="off_policy_mask_threshold"):
        trl_matched(casi, _args(tmp_path, off_policy_mask_threshold=0.5))
    with pytest.raises(ValueError, match="loss_type='vespo'"):
        trl_matched(casi, _args(tmp_path, loss_type="vespo"))
    trl_matched(casi, _args(tmp_path, loss_type="dapo"))


def test_the_shuffled_draw_resumes_from_a_checkpoint_and_ignores_eval(
    smol_tokenizer, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """Three steps with a checkpoint and an evaluation after each: the training batches draw
    with casi train's step seeds (evaluation does not advance them); a run resumed from the
    step-2 checkpoint draws step 2's seed again (TRL saved global_step = 2)."""
    from policy.trainer import step_seed

    casi = _constant_casi(smol_tokenizer, 0.5, credit="shuffled")
    kw = dict(num_generations=2, per_device_train_batch_size=2, per_device_eval_batch_size=2,
              max_completion_length=6, max_steps=3, save_strategy="steps", save_steps=1,
              eval_strategy="steps", eval_steps=1, logging_steps=1)  # fmt: skip

    def run(resume: str | None = None) -> list[int]:
        trainer = CasiGRPOTrainer(
            model=build_tiny_policy(smol_tokenizer), casi=casi, args=_args(tmp_path, **kw),
            train_dataset=_prompts(), eval_dataset=_prompts(), processing_class=smol_tokenizer,
        )  # fmt: skip
        seeds: list[int] = []
        original = trainer.casi_apply

        def record(out: dict[str, Any]) -> dict[str, Any]:
            training = trainer._training
            res = original(out)
            if training:
                seeds.append(trainer.casi_last.shuffle_seed)
            return res

        trainer.casi_apply = record
        trainer.train(resume_from_checkpoint=resume)
        assert any("eval_loss" in h for h in trainer.state.log_history), "no evaluation ran"
        return seeds

    assert run() == [step_seed(SEED, k, "shuffled") for k in range(3)]
    checkpoint = tmp_path / "checkpoint-2"
    assert '"global_step": 2' in (checkpoint / "trainer_state.json").read_text()
    assert run(str(checkpoint)) == [step_seed(SEED, 2, "shuffled")]
