"""The adapter tests' fixed batch and what CASI's own `Trainer` computes on it.

The batch: the slice's first B = 2 train queries, G = 3 completions each, m = 3 — complete,
partial (2 actions: a partial game) and over-long (4 lines: the first 3 kept) answers, tokenized
by the real SmolLM2 tokenizer and ended by EOS. Its actions run through the slice's real
retrieval stack and Redis (tests/conftest.py), so the result lists are real.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

B, G, M = 2, 3, 3
SEED = 7


def answers(queries: list[str]) -> list[str]:
    """G answers per query, query-major: on-topic, junk, partial and over-long lines."""
    out = []
    for q in queries:
        words = q.split()
        head, tail = " ".join(words[:4]), " ".join(words[-4:])
        out += [
            f"1. {head}\n2. zebra\n3. {tail}",
            f"1. zebra stripes\n2. {q}",
            f"1. {tail} study\n2. {head}\n3. cell biology\n4. an extra line",
        ]
    return out


def trainer_config(mode: str, **shaping: Any) -> Any:
    from policy.advantages import ShapingConfig
    from policy.train_config import TrainConfig

    cfg = TrainConfig.from_preset(
        "casi", steps=1, queries=B, samples=G, n_actions=M, anchor_query=True, seed=SEED,
        format="free",
    )  # fmt: skip
    return dataclasses.replace(cfg, advantages=ShapingConfig(credit=mode, **shaping))  # type: ignore[arg-type]


def trainer_advantages(
    tokenizer: Any, retrieval: Any, scorer: Any, batch: dict[str, Any], mode: str, **shaping: Any
) -> Any:
    """`Trainer.advantages` (what `train_step` runs) on the fixed batch as the trainer's rollouts."""
    from policy.model import build_tiny_policy
    from policy.parse import parse_actions
    from policy.prompts import build_prompt
    from policy.rollout import Rollout
    from policy.trainer import Trainer

    cfg = trainer_config(mode, **shaping)
    trainer = Trainer(
        build_tiny_policy(tokenizer, seed=0), tokenizer, cfg, retrieval.executor, scorer
    )
    rollouts = []
    for i, (qid, text, ids) in enumerate(
        zip(batch["query_ids"], batch["queries"], batch["completion_ids"], strict=True)
    ):
        t = len(ids)
        rollouts.append(Rollout(
            query=text, query_id=qid, query_index=i // G, sample_index=i % G,
            prompt_ids=build_prompt(tokenizer, text, M), response_ids=list(ids),
            sampler_logp=torch.zeros(t), topk_logp=torch.zeros(t, 1),
            topk_ids=torch.zeros(t, 1, dtype=torch.long),
            parsed=parse_actions(ids, tokenizer, M), n_actions=M, policy_version="v0",
            finish_reason="stop", precision="float32", temperature=1.0,
        ))  # fmt: skip
    credit, rbatch, adv = trainer.advantages(rollouts)
    return credit, rbatch, adv
