"""Issue 27, item 6: the credit explorer showed three of the four credit modes (no broadcast),
each rewrite's documents only as ids inside the merged top-K (titles on hover only, nothing
about the documents that did not make it), no word on why a φ of 0 gets a shaped x of +1.10,
and no way to reach the stored API credits from the menus. Checked on the functions and the
rendered templates (no server, no browser); tests/ui/test_ui_pages.py checks the live pages."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from app.db.models import CreditRecord
from app.ui import charts, data
from app.ui.hits import add_hits
from app.ui.render import env, pages
from evaluator.coalitions import coalition_lists
from evaluator.shapley import broadcast, exact_shapley, leave_one_out, singleton

M = 3
# v(S) of a 3-rewrite game with an interaction (not additive), v(∅) = 0.2 (the query alone)
TABLE = [0.2, 0.5, 0.1, 0.45, 0.3, 0.55, 0.25, 0.6]


def _row(with_broadcast: bool = True) -> CreditRecord:
    values = torch.tensor(TABLE, dtype=torch.float64)
    base = {"singleton": singleton(values, M).tolist(),
            "leave_one_out": leave_one_out(values, M).tolist()}  # fmt: skip
    if with_broadcast:
        base["broadcast"] = broadcast(values, M).tolist()
    return CreditRecord(
        id=11, run_id=None, step=None, query_id="q1", query_text="aspirin and heart attacks",
        sample_index=0, policy_version="p" * 12, actions=["aspirin", "heart", "attack"],
        format_status="ok", value_table=TABLE, credits=exact_shapley(values, M).tolist(),
        baselines=base, advantages={"base": 0.0, "shaped": [1.1, -1.3, 0.2]},
        value_full=TABLE[-1], efficiency_residual=0.0, index_version="idx",
        embedder_version="emb", evaluator_name="replay", evaluator_version="v",
        anchor_query=False, created_at=None,
    )  # fmt: skip


def _render(template: str, rec: dict[str, Any], **extra: Any) -> str:
    rec.update(figures=charts.sample_figures(rec), token_adv=charts.token_advantages(rec, 0.5))
    rec["lam"] = 0.5
    return env.get_template(template).render(
        who=SimpleNamespace(name="u", prefix="abcd", scope="user"), is_admin=False, csrf="",
        info={"id": 1, "name": "r", "credit": "shapley"}, step=3, prev_step=None,
        next_step=None, total=1, per=4, pager=pages(1, 4, 0), rec=rec,
        groups=[{"query_id": "q1", "query_text": "aspirin", "samples": [rec]}], **extra,
    )  # fmt: skip


def _column(html: str, name: str) -> list[float]:
    return [
        float(v) for v in re.findall(rf'<td class="num {name} [\w-]+" data-value="([^"]*)"', html)
    ]


def test_the_four_credit_modes_stand_side_by_side() -> None:
    html = _render("explorer.html", data.record_dict(_row()))
    head = re.search(r"<thead><tr>(.*?)</tr></thead>", html, re.S)
    assert head is not None
    columns = re.findall(r"<th>([^<]+)</th>", head.group(1))
    assert columns[2:6] == ["φ (Shapley)", "singleton", "leave-one-out", "broadcast"]
    values = torch.tensor(TABLE, dtype=torch.float64)
    assert _column(html, "phi") == exact_shapley(values, M).tolist()
    assert _column(html, "broadcast") == broadcast(values, M).tolist() == [TABLE[-1]] * M
    # a record stored without it gets the credit path's own baseline of its value table
    assert data.record_dict(_row(with_broadcast=False))["broadcast"] == [TABLE[-1]] * M
    # the other columns keep their colours: broadcast has its own scale
    plain = _render("explorer.html", data.record_dict(_row()))
    assert re.findall(r'class="num phi (c-\w+)"', plain) == re.findall(
        r'class="num phi (c-\w+)"',
        _render("explorer.html", {**data.record_dict(_row()), "broadcast": []}),
    )


class _Executor:
    """The action executor's interface over a fixed table: rewrite text → its top-4 rows."""

    merge, rrf_k = "max", 60.0
    LISTS = {"aspirin": [0, 1, 2, 3], "heart": [4, 0, 5, 6], "attack": [7, 8, 1, 9]}

    def __init__(self) -> None:
        self.retriever = SimpleNamespace(version="idx", encoder_version="emb",
                                         doc_ids=[f"d{i}" for i in range(10)])  # fmt: skip

    def run(self, texts: list[str]) -> SimpleNamespace:
        rows = np.array([self.LISTS[t] for t in texts], dtype=np.int64)
        scores = np.array([[0.9, 0.8, 0.7, 0.6], [0.95, 0.5, 0.4, 0.3], [0.85, 0.75, 0.2, 0.1]])
        return SimpleNamespace(rows=rows, scores=scores[: len(texts)].astype(np.float32))


def test_every_rewrite_lists_its_own_top_k_with_titles_and_relevance() -> None:
    retrieval = SimpleNamespace(
        executor=_Executor(),
        dataset=SimpleNamespace(
            qrels={"test": {"q1": {"d1": 1, "d5": 1, "d4": 0}}},
            documents=[SimpleNamespace(doc_id=f"d{i}", title=f"Title <{i}>") for i in range(10)],
        ),
    )
    rec = data.record_dict(_row())
    add_hits(retrieval, [rec], 3)  # merged top-3 of all three rewrites
    rows = torch.tensor([list(v) for v in _Executor.LISTS.values()])[None]
    scores = torch.from_numpy(_Executor().run(list(_Executor.LISTS)).scores)[None]
    merged = coalition_lists(rows, scores, torch.tensor([M]), 3).doc_idx[0, -1].tolist()
    assert [h["doc_id"] for h in rec["merged"]] == [f"d{i}" for i in merged]

    html = _render("credit.html", rec)
    sections = re.findall(r'<section class="own" data-action="(\d)">(.*?)</section>', html, re.S)
    assert [j for j, _ in sections] == ["0", "1", "2"]
    for (_, body), (text, own) in zip(sections, _Executor.LISTS.items(), strict=True):
        assert f'<span class="rewrite">{text}</span>: own top-4' in body
        items = re.findall(
            r'<li class="own-hit (\w+)" data-doc="(d\d)" data-own-rank="(\d)" data-rank="(\d*)"'
            r'.*?<span class="mark">(.)</span>.*?<span class="title">([^<]*)</span>', body
        )  # fmt: skip
        assert [doc for _, doc, *_ in items] == [f"d{i}" for i in own]  # all k, in its order
        assert [int(r) for _, _, r, *_ in items] == [1, 2, 3, 4]
        for cls, doc, _, rank, mark, title in items:
            assert title == f"Title &lt;{doc[1:]}&gt;"  # shown (escaped), not only on hover
            relevant = doc in ("d1", "d5")
            assert (cls, mark) == (("rel", "✓") if relevant else ("nonrel", "✗")), doc
            row = int(doc[1:])
            assert rank == (str(merged.index(row) + 1) if row in merged else ""), doc
        assert "not in merged top-3" in body  # 4 own documents, 3 merged slots in all
    unjudged = data.record_dict(_row())
    unjudged["query_id"] = "q-without-judgements"
    add_hits(retrieval, [unjudged], 3)
    marks = re.findall(r'<span class="mark">(.)</span>', _render("credit.html", unjudged))
    assert set(marks) == {"?"} and len(marks) == 12


def test_the_shaped_x_is_explained_and_the_api_credits_are_in_the_menu() -> None:
    for template in ("explorer.html", "credit.html"):
        html = _render(template, data.record_dict(_row()))
        note = re.search(r'<p class="note" id="shaped-note">(.*?)</p>', html, re.S)
        assert note is not None, template
        for words in ("centred within its rollout", "one scale for the query's group",
                      "s_g", "Σ x = 0, |x| ≤ κ", "φ of 0", "+1.10"):  # fmt: skip
            assert words in note.group(1), (template, words)
        credits = re.search(r'<p class="note" id="credit-note">(.*?)</p>', html, re.S)
        assert credits is not None and "broadcast = v(N) for every rewrite" in credits.group(1)
        nav = re.search(r"<nav>(.*?)</nav>", html, re.S)
        assert nav is not None and '<a href="/ui/credits">API credits</a>' in nav.group(1)
    listing = env.get_template("credits.html").render(
        who=SimpleNamespace(name="u", prefix="abcd", scope="user"), is_admin=False, csrf="",
        credits=[data.record_dict(_row())], pager=pages(1, 25, 0),
    )  # fmt: skip
    assert '<a href="/ui/credits/11">11</a>' in listing
