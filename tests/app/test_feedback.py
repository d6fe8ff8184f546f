"""The feedback context (evaluator.feedback) on a real slice of NFCorpus (BM25, real Redis): its
words are keyword expansion's ranking of the query's own top documents, the warm start's
teacher rewrites are keyword expansion's, and training and the held-out evaluation build the
``feedback`` prompt from the same context."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from app.runtime import Retrieval, build_retrieval
from app.settings import Settings
from app.training.evaluate import build_eval_request
from app.training.splits import split_ids, train_val_ids
from app.training.warmstart import recipe_key, teacher_examples
from evaluator.prf import KeywordExpansion, deal, dealt_order
from evaluator.rerank import PoolReranker
from evaluator.scorers import make_scorer
from policy.constrain import free_response_cap
from policy.evaluate import EvalConfig, evaluate_policy
from policy.model import build_tiny_policy
from policy.prompts import build_prompt, build_prompt_text
from policy.rollout import RolloutConfig, contexts_for, sample_rollouts
from policy.sampler import SamplerConfig
from policy.train_config import TrainConfig
from policy.trainer import Trainer
from policy.warmstart import WarmstartExample, encode_example


@pytest.fixture()
def pool_retrieval(nf_slice: Path, tmp_path: Path) -> Retrieval:
    settings = Settings(
        var_dir=tmp_path, dataset=nf_slice, retriever="bm25", bm25_stemmer="none", game="pool",
        retrieval_k=5,
    )  # fmt: skip
    return build_retrieval(settings)


def _expansion(r: Retrieval) -> KeywordExpansion:
    return KeywordExpansion([d.retrieval_text for d in r.dataset.documents])


def test_the_context_is_keyword_expansions_ranking_in_the_order_it_deals_it(
    pool_retrieval: Retrieval,
) -> None:
    r = pool_retrieval
    texts = [r.dataset.queries[q] for q in split_ids(r.dataset, "val")[:4]]
    own = r.executor.run(texts).rows
    prf = _expansion(r)
    words = r.feedback().words(texts, 30, 4)
    assert words == [dealt_order(prf.ranked(list(row)), 4)[:30] for row in own.tolist()]
    assert all(len(w) == 30 for w in words)  # the slice's documents have enough words
    assert [sorted(w) for w in words] == [sorted(prf.ranked(list(row))[:30]) for row in own]
    assert r.feedback().contexts(texts, 30, 4) == [" ".join(w) for w in words]
    # the teacher is keyword expansion: its line i is the context's i-th run of 6 words
    teacher = r.feedback().teacher(texts, 4)
    assert teacher == [prf.rewrites(list(row), 4) for row in own.tolist()]
    assert teacher == [[" ".join(w[6 * i : 6 * i + 6]) for i in range(4)] for w in words]
    assert r.feedback() is r.feedback()  # built once per retrieval
    with pytest.raises(ValueError, match="n_words must be in 1..64"):
        r.feedback().words(texts, 0, 4)
    with pytest.raises(ValueError, match="n_actions must be in 1..12"):
        r.feedback().words(texts, 30, 13)


def test_keyword_expansion_deals_its_ranking_round_robin() -> None:
    ranked = [f"w{i}" for i in range(10)]
    assert deal(ranked, 3, words=3) == ["w0 w3 w6", "w1 w4 w7", "w2 w5 w8"]
    assert dealt_order(ranked, 3, words=3) == [f"w{i}" for i in (0, 3, 6, 1, 4, 7, 2, 5, 8, 9)]
    assert deal(ranked[:2], 3, words=3) == ["w0", "w1"]  # too few words: fewer lines
    assert dealt_order(ranked[:2], 3, words=3) == ["w0", "w1"]


def test_the_teachers_examples_are_keyword_expansions_rewrites_of_train_queries(
    pool_retrieval: Retrieval, smol_tokenizer: Any
) -> None:
    r = pool_retrieval
    examples = teacher_examples(r, 2, None, 12)
    train = train_val_ids(r.dataset)[0]
    assert [e.query for e in examples] == [r.dataset.queries[q] for q in train]  # TRAIN only
    prf = _expansion(r)
    for e in examples:
        own = list(r.executor.run([e.query]).rows[0])
        assert e.answer.splitlines() == [f"{i}. {t}" for i, t in enumerate(prf.rewrites(own, 2), 1)]
        assert e.context == " ".join(dealt_order(prf.ranked(own), 2)[:12])
    ids, labels = encode_example(smol_tokenizer, examples[0], 320, "feedback")
    prompt = build_prompt(smol_tokenizer, examples[0].query, 2, "feedback", examples[0].context)
    assert ids[: len(prompt)] == prompt and all(x == -100 for x in labels[: len(prompt)])
    # the context is part of the recipe: another context is another warm start
    other = [WarmstartExample(e.query, e.n_actions, e.answer, "x") for e in examples]
    assert recipe_key("p", examples) != recipe_key("p", other)
    plain = [WarmstartExample(e.query, e.n_actions, e.answer) for e in examples]
    assert recipe_key("p", plain) != recipe_key("p", examples)


def test_an_empty_first_retrieval_is_answered_with_the_querys_keywords() -> None:
    """A query whose first retrieval found nothing ("okra": no context, no keyword expansion)
    is in the teacher's examples, its missing lines the query's keywords: left out, the start
    had never seen an empty context and wrote strings of repeats ("1. 1. 1. 1.") for it."""
    from policy.warmstart import teacher_examples as make_examples

    examples = make_examples(
        ["Okra", "fried food and cancer", "statins"],
        ["", "oil fried", "ldl statin risk heart"],
        [[], ["oil", "fried"], ["ldl", "statin", "risk", "heart"]],
        4,
    )
    assert [e.answer.splitlines() for e in examples] == [
        ["1. okra", "2. okra", "3. okra", "4. okra"],
        ["1. oil", "2. fried", "3. fried food cancer", "4. fried food cancer"],
        ["1. ldl", "2. statin", "3. risk", "4. heart"],
    ]
    assert [e.context for e in examples] == ["", "oil fried", "ldl statin risk heart"]


def test_the_feedback_prompt_needs_its_context_and_only_it_takes_one(smol_tokenizer: Any) -> None:
    text = build_prompt_text(smol_tokenizer, "fried food  cancer", 4, "feedback", "oil  fried")
    assert "Query: fried food cancer\nWords: oil fried" in text
    with pytest.raises(ValueError, match="needs one feedback context per query"):
        build_prompt_text(smol_tokenizer, "q", 4, "feedback")
    with pytest.raises(ValueError, match="takes no feedback context"):
        build_prompt_text(smol_tokenizer, "q", 4, "short", "oil")
    with pytest.raises(ValueError, match="feedback_words must be in 1..64"):
        RolloutConfig(prompt="feedback", feedback_words=65)
    with pytest.raises(ValueError, match="needs a feedback context source"):
        contexts_for(RolloutConfig(prompt="feedback"), None, ["q"])
    assert contexts_for(RolloutConfig(prompt="short"), None, ["q"]) is None
    model = build_tiny_policy(smol_tokenizer, seed=0)
    with pytest.raises(ValueError, match="needs one feedback context per query"):
        sample_rollouts(model, smol_tokenizer, ["a", "b"], 1, 2, prompt_style="feedback",
                        contexts=["x"])  # fmt: skip
    cfg = TrainConfig.from_preset("casi", prompt="feedback", n_actions=2)
    with pytest.raises(ValueError, match="feedback context source"):
        Trainer(model, smol_tokenizer, cfg, None, None)  # type: ignore[arg-type]
    assert TrainConfig.from_preset("casi", feedback_words=12).idle_options(
        {"feedback_words": 12}
    ) == ["--feedback-words has no effect here — it sizes the feedback prompt's context: add "
          "--prompt feedback"]  # fmt: skip


def test_training_and_evaluation_prompt_with_the_same_context(
    pool_retrieval: Retrieval, smol_tokenizer: Any
) -> None:
    r = pool_retrieval
    model = build_tiny_policy(smol_tokenizer, seed=0)
    rollout = RolloutConfig(n_actions=2, line_cap=6, prompt="feedback", feedback_words=8)
    ids = split_ids(r.dataset, "val")[:3]
    queries = [(q, r.dataset.queries[q]) for q in ids]
    texts = [t for _, t in queries]
    expected = [
        build_prompt(smol_tokenizer, t, 2, "feedback", c)
        for t, c in zip(texts, r.feedback().contexts(texts, 8, 2), strict=True)
    ]
    # training: the trainer's rollouts
    cfg = TrainConfig.from_preset(
        "casi", prompt="feedback", feedback_words=8, n_actions=2, line_cap=6, samples=2,
        queries=3, list_k=5,
    )  # fmt: skip
    scorer = make_scorer("replay", qrels=r.dataset.qrels_rows("train"), k=5)
    trainer = Trainer(
        copy.deepcopy(model), smol_tokenizer, cfg, r.executor, scorer,
        feedback=r.feedback().contexts,
    )  # fmt: skip
    rollouts = trainer.sample(queries, 2, seed=0, greedy=True)
    assert [ro.prompt_ids for ro in rollouts] == [p for p in expected for _ in range(2)]
    # evaluation: the held-out request carries the same builder, and its greedy rewrites are
    # the ones sampled from those prompts
    request = build_eval_request(r, "val", 3, EvalConfig(rollout=rollout, batch_size=4))
    assert request.feedback is r.feedback()
    res = evaluate_policy(
        model, smol_tokenizer, request.queries, request.executor, request.ndcg, request.recall,
        request.config, recall_executor=request.recall_executor, pool=request.pool,
        feedback=request.feedback.contexts,
    )  # fmt: skip
    sampler = SamplerConfig(
        max_new_tokens=rollout.response_cap, do_sample=False, precision="float32", batch_size=4
    )
    direct = sample_rollouts(
        model, smol_tokenizer, texts, 1, 2, sampler, prompt_style="feedback", format="constrained",
        line_cap=6, contexts=r.feedback().contexts(texts, 8, 2),
    )  # fmt: skip
    assert [d.prompt_ids for d in direct] == expected
    assert [row["rewrites"] for row in res.per_query] == [d.action_texts for d in direct]
    with pytest.raises(ValueError, match="needs a feedback context source"):
        evaluate_policy(
            model, smol_tokenizer, request.queries, request.executor, request.ndcg,
            request.recall, request.config, recall_executor=request.recall_executor,
            pool=request.pool,
        )  # fmt: skip


def test_the_served_list_is_the_pool_re_ranked_by_the_second_stage(
    pool_retrieval: Retrieval, smol_tokenizer: Any
) -> None:
    """served_ndcg@10 of each held-out query is the nDCG@10 of its pool (the query's list and
    every rewrite's, as sets from the executor) ranked by evaluator.rerank; the keyword
    expansion's served number likewise; a degenerate rate is reported."""
    r = pool_retrieval
    rollout = RolloutConfig(n_actions=2, line_cap=6, prompt="feedback", feedback_words=8)
    request = build_eval_request(r, "val", 4, EvalConfig(rollout=rollout, batch_size=4))
    assert request.pool is not None and isinstance(request.pool.reranker, PoolReranker)
    assert request.feedback is not None
    model = build_tiny_policy(smol_tokenizer, seed=0)
    res = evaluate_policy(
        model, smol_tokenizer, request.queries, request.executor, request.ndcg, request.recall,
        request.config, recall_executor=request.recall_executor, pool=request.pool,
        feedback=request.feedback.contexts,
    )  # fmt: skip
    reranker = PoolReranker(r.index)  # type: ignore[arg-type]
    ndcg = make_scorer("replay", qrels=r.dataset.qrels_rows("dev"), k=10)
    for (qid, text), row, prf in zip(
        request.queries, res.per_query, request.pool.baseline, strict=True
    ):
        for rewrites, key in ((row["rewrites"], "served_ndcg"), (list(prf), "prf_served_ndcg")):
            found: set[int] = set()
            for t in [text, *rewrites]:
                found |= {int(d) for d in r.executor.run([t]).rows[0] if d >= 0}
            ranked, _ = reranker.rerank([text], [rewrites], np.array([sorted(found)]))
            want = ndcg.score([qid], torch.zeros(1, 0), torch.from_numpy(ranked)[:, None])
            assert row[key] == pytest.approx(float(want[0, 0]), abs=1e-12)
    mean = sum(row["served_ndcg"] for row in res.per_query) / len(res.per_query)
    assert res.metrics["served_ndcg@10"] == pytest.approx(mean)
    assert 0.0 <= res.metrics["degenerate_rate"] <= 1.0


def test_the_audit_samples_a_feedback_policy_with_the_games_context(
    pool_retrieval: Retrieval, smol_tokenizer: Any, tmp_path: Path
) -> None:
    from app.services.audit import sampled_rollouts
    from app.training.policy_loader import LoadedPolicy
    from app.training.policy_prompt import PolicyPrompt, write_prompt
    from app.workers.audit_records import AuditRequest

    r = pool_retrieval
    write_prompt(tmp_path, PolicyPrompt("feedback", 8))
    model = build_tiny_policy(smol_tokenizer, seed=0)
    policy = LoadedPolicy(model, smol_tokenizer, "v", "tiny", "tiny", str(tmp_path), "warmstart")
    request = AuditRequest(
        ("cosine",), split="val", queries=2, samples=2, n_actions=2, line_cap=4,
        prompt="feedback",
    )  # fmt: skip
    got = sampled_rollouts(request, r, lambda _ref: policy)
    ids = split_ids(r.dataset, "val")[:2]
    texts = [r.dataset.queries[q] for q in ids]
    draw = SamplerConfig(temperature=0.7, max_new_tokens=free_response_cap(2, 4), seed=0)
    want = sample_rollouts(
        model, smol_tokenizer, texts, 2, 2, draw, prompt_style="feedback", format="constrained",
        line_cap=4, contexts=r.feedback().contexts(texts, 8, 2),
    )  # fmt: skip
    assert [a.actions for a in got.actions] == [w.action_texts for w in want]


def test_a_run_that_refuses_degenerate_rewrites_plays_them_as_empty_actions(
    pool_retrieval: Retrieval, smol_tokenizer: Any
) -> None:
    """refuse_degenerate: a string of repeats retrieves nothing, so its credit is 0 and v(N)
    is that of the other rewrites; off (the default), it is played as written."""
    r = pool_retrieval
    qid = split_ids(r.dataset, "val")[0]
    query = r.dataset.queries[qid]
    junk = "cancer cancer cancer"
    good = r.feedback().teacher([query], 2)[0][0]
    model = build_tiny_policy(smol_tokenizer, seed=0)
    scorer = make_scorer("replay", qrels=r.dataset.qrels_rows("dev"), k=13 * 5,
                         metric="graded_recall")  # fmt: skip
    rollout = sample_rollouts(model, smol_tokenizer, [query], 1, 2, query_ids=[qid],
                              format="constrained", line_cap=4)[0]  # fmt: skip
    actions = [
        replace(a, text=t) for a, t in zip(rollout.parsed.actions, (good, junk), strict=True)
    ]
    rollout = replace(rollout, parsed=replace(rollout.parsed, actions=actions))
    results = {}
    for refuse in (False, True):
        cfg = TrainConfig.from_preset("casi", n_actions=2, list_k=5, refuse_degenerate=refuse)
        trainer = Trainer(copy.deepcopy(model), smol_tokenizer, cfg, r.executor, scorer)
        results[refuse] = trainer.credit([rollout])
    refused, played = results[True], results[False]
    assert float(refused.phi[0, 1]) == 0.0 and float(refused.singleton[0, 1]) == 0.0
    assert int(refused.n_actions[0]) == 2  # still a player: a null one
    assert (refused.action_rows[0, 1] == -1).all()  # it retrieved nothing
    assert (played.action_rows[0, 1] >= 0).any()  # played as written, it retrieves documents
    # the good rewrite plays the same game either way
    assert torch.equal(refused.action_rows[0, 0], played.action_rows[0, 0])
