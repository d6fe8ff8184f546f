"""Issue 37: the credit explorer shows who found what in the pooled game. Records made by THE
credit path (`compute_credits`, BM25 over a slice of NFCorpus, real Redis) and stored in the
form training and the API store (`app.db.records.credit_record`) are rendered by the explorer's
templates: a pool record gets the matrix of its candidates (in the pool's order, the query's
own documents marked Q, one column per rewrite), checked against the executor's own lists
computed here; two copies of a rewrite hold the same candidates, and the stored counts say
that neither found one alone. A list-game record gets no matrix."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from app.db.models import CreditRecord
from app.db.records import credit_record
from app.runtime import Retrieval, build_retrieval, build_scorer
from app.settings import Settings
from app.ui import charts, data
from app.ui.hits import add_hits
from app.ui.render import env, pages
from evaluator.credit import RolloutActions, compute_credits
from evaluator.scorers import SetScorer
from tests.pool_support import doc_lists, opening_rewrites

pytestmark = pytest.mark.integration
GAME = {"retriever": "bm25", "bm25_stemmer": "none", "retrieval_k": 5}


def _game(var: Path, dataset: Path, redis_url: str, game: str) -> tuple[Retrieval, SetScorer]:
    """The retrieval stack and the replay evaluator of ``game`` (list | pool), from settings."""
    settings = Settings(
        var_dir=var, dataset=dataset, REDIS_URL=redis_url, device="cpu", game=game, **GAME
    )
    retrieval = build_retrieval(settings)
    return retrieval, build_scorer("replay", settings, retrieval)


@pytest.fixture(scope="module")
def pool_var(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pool-ui-var")


def _record(retrieval: Retrieval, scorer: SetScorer, rewrites: list[str]) -> dict[str, Any]:
    """One rollout credited by THE credit path (query as anchor), stored and read back as the
    explorer reads it, with its lists rebuilt from the cache."""
    ds = retrieval.dataset
    qid = ds.split_query_ids("train")[0]
    res = compute_credits([RolloutActions(qid, ds.queries[qid], rewrites)], retrieval.executor,
                          scorer, 10, anchor_query=True)  # fmt: skip
    stored = credit_record(res, 0, run_id=None, step=None, sample_index=0, policy_version="p",
                           format_status="ok", advantages={"shaped": [0.0] * len(rewrites)})  # fmt: skip
    rec = data.record_dict(CreditRecord(id=7, created_at=None, **stored))
    add_hits(retrieval, [rec], 10)
    rec.update(figures=charts.sample_figures(rec), token_adv=[None] * len(rewrites), lam=None)
    return rec


def _render(template: str, rec: dict[str, Any]) -> str:
    return env.get_template(template).render(
        who=SimpleNamespace(name="u", prefix="abcd", scope="user"), is_admin=False, csrf="",
        info={"id": 1, "name": "r", "credit": "shapley"}, step=3, prev_step=None,
        next_step=None, total=1, per=4, pager=pages(1, 4, 0), rec=rec,
        groups=[{"query_id": rec["query_id"], "query_text": rec["query_text"], "samples": [rec]}],
    )  # fmt: skip


def test_the_explorer_shows_who_found_each_candidate_of_a_pool(
    nf_slice: Path, pool_var: Path, ui_redis_url: str
) -> None:
    retrieval, scorer = _game(pool_var, nf_slice, ui_redis_url, "pool")
    rewrites = opening_rewrites(retrieval.dataset)[1]
    rec = _record(retrieval, scorer, rewrites)
    assert rec["game"] == "pool" and rec["merge"] == "pool"
    lists = doc_lists(retrieval, rewrites)
    query = doc_lists(retrieval, [rec["query_text"]])[0]
    union = set(query).union(*lists)
    new = [set(own) - set(query) for own in lists]
    only = [len({d for d in new[j] if sum(d in own for own in lists) == 1}) for j in range(4)]
    assert only[0] == only[1] == 0 and len(new[0]) > 0  # copies find nothing alone
    # the stored counts (what GET /v1/credits returns) are the matrix's
    assert rec["pool"]["new"] == [len(s) for s in new] and rec["pool"]["only"] == only
    for template in ("explorer.html", "credit.html"):
        html = _render(template, rec)
        assert '<span class="game game-pool">pooled game</span>' in html
        assert f"the pool of {len(union)} candidates, {len(query)} of them" in html
        rows = re.findall(
            r'<tr class="pool-doc \w+" data-doc="([^"]+)" data-found-by="([\d,]*)" '
            r'data-query="(yes|no)"(.*?)</tr>', html, re.S,
        )  # fmt: skip
        assert [d for d, *_ in rows] == [h["doc_id"] for h in rec["merged"]]  # the pool's order
        assert len(rows) == len(union) and {d for d, *_ in rows} == union  # every candidate once
        for doc, found, in_query, cells in rows:
            expected = [j for j, own in enumerate(lists) if doc in own]
            assert found == ",".join(map(str, expected)), doc
            assert (in_query == "yes") == (doc in query), doc
            marks = re.findall(r'<td class="found( yes)?">(●?)</td>', cells)
            assert [bool(mark) for _, mark in marks] == [j in expected for j in range(4)], doc
            assert ('<td class="q">Q</td>' in cells) == (doc in query), doc
        # the two copies hold the same candidates: their columns are the same
        copies = [[str(j) in f.split(",") for _, f, *_ in rows] for j in (0, 1)]
        assert copies[0] == copies[1] and any(copies[0])
        footer_new = re.search(r'<tr class="pool-new">(.*?)</tr>', html, re.S)
        footer_only = re.search(r'<tr class="pool-only">(.*?)</tr>', html, re.S)
        assert footer_new is not None and footer_only is not None
        cell = r'<td class="num" data-action="\d">(\d+)</td>'
        assert [int(v) for v in re.findall(cell, footer_new.group(1))] == [len(s) for s in new]
        assert [int(v) for v in re.findall(cell, footer_only.group(1))] == only


def test_a_list_game_record_gets_no_pool_matrix(
    nf_slice: Path, pool_var: Path, ui_redis_url: str
) -> None:
    retrieval, scorer = _game(pool_var, nf_slice, ui_redis_url, "list")
    rec = _record(retrieval, scorer, opening_rewrites(retrieval.dataset)[1])
    assert rec["game"] == "list" and rec["merge"] == "rrf" and rec["pool"] is None
    assert rec["own"] and rec["merged"]  # its lists were rebuilt: it has hits, not a pool
    for template in ("explorer.html", "credit.html"):
        html = _render(template, rec)
        assert 'class="pool-doc' not in html and "pooled game" not in html
        assert 'class="own-hit' in html
