"""What both adapters share: a credit source, the queries, m, the shaping, and the parser.

Read :class:`CasiCredit`. A foreign trainer hands over token ids of completions and the query
ids of their prompts; :meth:`CasiCredit.completions` parses each into at most m actions with
token spans (`policy.parse.parse_actions`, the trainer's parser), and :meth:`CasiCredit.credit`
runs them through the credit source (CASI's action cache, retriever and scorer by default).
Build one from a BEIR folder (:meth:`CasiCredit.from_beir`, through `app.runtime` like
`casi train`) or from CASI's executor and scorer (:meth:`CasiCredit.from_components`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from evaluator.actions import ActionExecutor
from evaluator.credit import RolloutActions
from evaluator.feedback import FeedbackContext
from evaluator.scorers import SetScorer
from policy.advantages import CreditMode, ShapingConfig
from policy.credit_api import Completion, CreditSource, CreditTables, EnvironmentCredit
from policy.parse import parse_actions
from policy.sampler import default_stop_ids


def check_tables(credit: CreditTables, completions: Sequence[Completion]) -> None:
    """Refuse a source's non-finite v(N) or credit on a real action slot (j < its action count),
    naming the completion and action: NaN must never pass for "no such action"."""
    if not bool(torch.isfinite(credit.value_full).all()):
        i = int((~torch.isfinite(credit.value_full)).nonzero()[0, 0])
        raise ValueError(
            f"completion {i} (query {completions[i].query_id!r}): the credit source returned a "
            f"non-finite reward v(N) = {float(credit.value_full[i])}"
        )
    real = torch.arange(credit.phi.shape[1])[None, :] < credit.n_actions[:, None]
    for name in ("phi", "singleton", "leave_one_out", "broadcast"):
        bad = real & ~torch.isfinite(getattr(credit, name))
        if bool(bad.any()):
            i, j = (int(v) for v in bad.nonzero()[0])
            raise ValueError(
                f"completion {i} (query {completions[i].query_id!r}), action {j}: the credit "
                f"source returned a non-finite {name} ({float(getattr(credit, name)[i, j])})"
            )


@dataclass(frozen=True)
class CasiCredit:
    """Credit settings of an adapter. ``queries``: query id → text, for completions whose
    prompts carry only an id; ``stop_token_ids``: where a completion ends for the parser.
    ``casi train`` parses with `policy.sampler.default_stop_ids` (tokenizer, model): the
    tokenizer's special tokens and EOS plus the model's ``generation_config.eos_token_id``.
    `CasiGRPOTrainer` fills that set in from its model when this is None; elsewhere (verl) None
    means the tokenizer's special tokens and EOS only: pass
    ``default_stop_ids(tokenizer, model)`` (the actor's model) to parse as ``casi train`` does."""

    source: CreditSource
    tokenizer: Any
    n_actions: int
    shaping: ShapingConfig = field(default_factory=ShapingConfig)
    queries: Mapping[str, str] = field(default_factory=dict)
    stop_token_ids: Sequence[int] | None = None
    feedback: FeedbackContext | None = None
    """The game's feedback context builder (`evaluator.feedback`; `from_beir` sets it): what a
    policy prompted with the ``feedback`` style reads (`casi_integrations.trl.casi_dataset`)."""

    @classmethod
    def from_components(
        cls,
        executor: ActionExecutor,
        scorer: SetScorer,
        tokenizer: Any,
        *,
        n_actions: int,
        list_k: int = 10,
        anchor_query: bool = True,
        credit: CreditMode = "shapley",
        queries: Mapping[str, str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        feedback: FeedbackContext | None = None,
        **shaping: Any,
    ) -> CasiCredit:
        """CASI's retriever (through its executor and action cache) and scorer."""
        source = EnvironmentCredit(executor, scorer, list_k, anchor_query=anchor_query)
        return cls(
            source, tokenizer, n_actions, ShapingConfig(credit=credit, **shaping), queries or {},
            None if stop_token_ids is None else tuple(int(t) for t in stop_token_ids),
            feedback,
        )  # fmt: skip

    @classmethod
    def from_beir(
        cls,
        folder: str | Path,
        tokenizer: Any,
        *,
        n_actions: int,
        credit: CreditMode = "shapley",
        split: str = "train",
        var_dir: str | Path = "var",
        max_docs: int | None = None,
        evaluator: str = "replay",
        anchor_query: bool = True,
        stop_token_ids: Sequence[int] | None = None,
        **shaping: Any,
    ) -> CasiCredit:
        """A BEIR folder (corpus.jsonl, queries.jsonl, qrels/<split>.tsv): its index is built
        under ``var_dir`` (or loaded), the action cache is Redis (``REDIS_URL``, else the embedded
        server), the scorer reads ``split``'s judgments; other CASI_* settings apply as usual.
        ``queries`` holds the ids of ``split`` as `casi train` splits it
        (`app.training.splits.split_ids`: ``train`` without its validation slice, or ``val``)."""
        from app.runtime import build_retrieval, build_scorer
        from app.settings import Settings
        from app.training.splits import check_split, qrels_split, split_ids

        check_split(split, Path(folder))
        settings = Settings(dataset=Path(folder), var_dir=Path(var_dir))
        retrieval = build_retrieval(
            settings, dataset_path=Path(folder), max_docs=max_docs, use_default_slice=False
        )
        ds = retrieval.dataset
        scorer = build_scorer(evaluator, settings, retrieval, qrels_split(split, ds))
        return cls.from_components(
            retrieval.executor, scorer, tokenizer, n_actions=n_actions, list_k=settings.list_k,
            anchor_query=anchor_query, credit=credit, stop_token_ids=stop_token_ids,
            queries={q: ds.queries[q] for q in split_ids(ds, split)},
            feedback=retrieval.feedback(), **shaping,
        )  # fmt: skip

    def with_shaping(self, **changes: Any) -> CasiCredit:
        """The same source and parser with other shaping settings (e.g. TRL's std_eps)."""
        return replace(self, shaping=replace(self.shaping, **changes))

    def completions(
        self,
        completion_ids: Sequence[Sequence[int]],
        query_ids: Sequence[str],
        query_texts: Sequence[str | None] | None = None,
    ) -> list[Completion]:
        """Parse each completion (its generated ids, unpadded) into at most m actions with spans.

        A completion with fewer numbered lines than m is a partial game (its missing players are
        null); extra lines are shared tokens, as in `casi train`. A query text defaults to
        ``queries[query_id]``; an unknown id without a text is a `KeyError` naming it.
        """
        if len(query_ids) != len(completion_ids):
            raise ValueError(f"{len(query_ids)} query ids for {len(completion_ids)} completions")
        texts = list(query_texts) if query_texts is not None else [None] * len(query_ids)
        stops = self.stop_token_ids
        stops = default_stop_ids(self.tokenizer) if stops is None else stops
        out = []
        for ids, qid, text in zip(completion_ids, query_ids, texts, strict=True):
            parsed = parse_actions(ids, self.tokenizer, self.n_actions, stops)
            out.append(
                Completion(
                    str(qid),
                    text if text is not None else self._query(str(qid)),
                    tuple(a.text for a in parsed.actions),
                    tuple((a.token_start, a.token_end) for a in parsed.actions),
                    len(ids),
                )  # fmt: skip
            )
        return out

    def credit(self, completions: Sequence[Completion]) -> CreditTables:
        """The game of every completion (one call: every action through the cache). A source's
        non-finite reward or credit is a `ValueError`."""
        players = [RolloutActions(c.query_id, c.query, list(c.actions)) for c in completions]
        credit = self.source(players, self.n_actions)
        check_tables(credit, completions)
        return credit

    def _query(self, query_id: str) -> str:
        if query_id not in self.queries:
            raise KeyError(
                f"query id {query_id!r} is not among the {len(self.queries)} queries given"
            )
        return self.queries[query_id]
