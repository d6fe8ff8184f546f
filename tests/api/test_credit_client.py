"""`casi_integrations.service.CreditClient` — the credit source of a trainer that keeps CASI as a
service (the verl adapter's ``POST /v1/credits`` path) — against a real server: its game equals
the in-process `compute_credits` on the same slice, and so do the token advantages."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from api_support import ApiServer

from app.runtime import build_retrieval, build_scorer
from app.settings import Settings
from casi_integrations.service import CreditClient
from evaluator.credit import RolloutActions
from policy.advantages import ShapingConfig
from policy.credit_api import Completion, EnvironmentCredit, credit_advantages

pytestmark = pytest.mark.integration


def _completions(dataset: Any) -> list[Completion]:
    """2 queries x 2: a full game, a partial game (1 of 2 actions), and one with no action."""
    q0, q1 = dataset.split_query_ids("train")[:2]
    t0, t1 = dataset.queries[q0], dataset.queries[q1]
    rows = [
        (q0, t0, (" ".join(t0.split()[:4]), "zebra")),
        (q0, t0, (t0,)),
        (q1, t1, ("cell biology", " ".join(t1.split()[-4:]))),
        (q1, t1, ()),
    ]
    return [
        Completion(q, t, a, tuple((3 * j, 3 * j + 2) for j in range(len(a))), 8) for q, t, a in rows
    ]


@pytest.fixture(scope="module")
def server_side(server: ApiServer) -> tuple[EnvironmentCredit, Any]:
    """The server's own game, in process: its settings (dataset, var dir and its index, Redis,
    embedder defaults), its replay evaluator (every loaded split's judgments) and CASI_LIST_K."""
    env = server.env
    settings = Settings(
        var_dir=Path(env["CASI_VAR_DIR"]), dataset=Path(env["CASI_DATASET"]),
        redis_url=env["REDIS_URL"], database_url=env["DATABASE_URL"],
    )  # fmt: skip
    r = build_retrieval(settings)
    scorer = build_scorer("replay", settings, r)
    return EnvironmentCredit(r.executor, scorer, settings.list_k), r.dataset


@pytest.mark.parametrize("anchor", [True, False], ids=["anchor", "no-anchor"])
def test_the_server_game_equals_the_in_process_one(
    server: ApiServer, keys: dict[str, str], server_side: tuple[EnvironmentCredit, Any],
    anchor: bool,
) -> None:  # fmt: skip
    game, dataset = server_side
    game = dataclasses.replace(game, anchor_query=anchor)
    comps = _completions(dataset)
    players = [RolloutActions(c.query_id, c.query, list(c.actions)) for c in comps]
    local = game(players, 2)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        client = CreditClient(server.url, keys["user"], anchor_query=anchor, client=http)
        remote = client(players, 2)
        torch.testing.assert_close(remote.values, local.values, atol=1e-12, rtol=0)
        for name in ("phi", "singleton", "leave_one_out", "broadcast"):
            torch.testing.assert_close(
                getattr(remote, name), getattr(local, name), atol=1e-12, rtol=0
            )
        cfg = ShapingConfig()
        ours = credit_advantages(comps, client, cfg, n_actions=2, group_size=2)
    theirs = credit_advantages(comps, game, cfg, n_actions=2, group_size=2)
    torch.testing.assert_close(ours.token_adv, theirs.token_adv, atol=1e-6, rtol=0)
    if not anchor:  # the slice's query finds its abstract at rank 1: with the anchor on, no
        # rewrite changes v here; with it off, the rewrites find it and share the credit
        assert float(local.phi.abs().max()) > 0


def test_a_refused_request_is_an_error_naming_the_status(server: ApiServer) -> None:
    client = CreditClient(server.url, "casi_not-a-key")
    with pytest.raises(RuntimeError, match="answered 401"):
        client([RolloutActions("0", "a claim", ["a rewrite"])], 1)
