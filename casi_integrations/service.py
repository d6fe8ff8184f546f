"""A credit source that asks a running CASI server: ``POST /v1/credits``, one call per completion.

Read :class:`CreditClient`. For a trainer (e.g. a verl job) that keeps CASI as a service: the
server runs the actions through its action cache and scores every coalition (the same
`compute_credits`), and returns each completion's value table v(S); the client pads the tables
to m players (missing players are null) and computes φ and the baselines locally with
`policy.credit_api.game_credit`, so the credit equals the in-process source's on the same
environment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import httpx
import torch

from app.limits import MAX_REWRITE_CHARS
from evaluator.credit import RolloutActions
from policy.credit_api import CreditTables, game_credit, pad_values


def check_action_lengths(players: Sequence[RolloutActions]) -> None:
    """Refuse, before any request, an action longer than a CASI server takes
    (`app.limits.MAX_REWRITE_CHARS`): the server would answer 422. An in-process source, like
    `casi train`, credits any length."""
    for i, p in enumerate(players):
        for j, text in enumerate(p.actions):
            if len(text) > MAX_REWRITE_CHARS:
                raise ValueError(
                    f"completion {i} (query {p.query_id!r}), action {j}: {len(text):,} characters, "
                    f"more than the {MAX_REWRITE_CHARS:,} a CASI server takes "
                    "(app.limits.MAX_REWRITE_CHARS); cap the completion length or the line length"
                )


class CreditClient:
    """``(players, n_players) → tables`` through ``{base_url}/v1/credits`` with an API key.

    A completion without actions is sent as one empty rewrite (a null player): its table is
    v(∅) twice. ``client``: an httpx.Client to reuse (default: one per source, ``timeout`` s).
    An action over the server's limit (`app.limits.MAX_REWRITE_CHARS`) is a `ValueError` before
    any request (:func:`check_action_lengths`; an in-process source credits it, as `casi train`
    does). The returned tables carry
    the call's action-cache ``cache`` counts (``hits``, ``misses``: the adapters log them);
    ``self.cache`` keeps the running totals.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        evaluator: str = "replay",
        anchor_query: bool = True,
        timeout: float = 60.0,
        client: httpx.Client | None = None,
    ) -> None:
        self.evaluator, self.anchor_query = evaluator, anchor_query
        self.http = client or httpx.Client(base_url=base_url, timeout=timeout)
        self.headers = {"X-API-Key": api_key}
        self.cache: dict[str, Any] = {"hits": 0, "misses": 0}

    def __call__(self, players: Sequence[RolloutActions], n_players: int) -> CreditTables:
        check_action_lengths(players)  # before any request: the server would answer 422
        for i, p in enumerate(players):
            if len(p.actions) > n_players:
                raise ValueError(
                    f"completion {i} has {len(p.actions)} actions but n_players is {n_players}"
                )
        calls = {"hits": 0, "misses": 0}
        rows = [pad_values(self._table(p, calls), len(p.actions), n_players) for p in players]
        counts = torch.tensor([len(p.actions) for p in players], dtype=torch.int64)
        for key, value in calls.items():
            self.cache[key] += value
        return replace(game_credit(torch.stack(rows), counts), cache=calls)

    def _table(self, player: RolloutActions, calls: dict[str, int]) -> list[float]:
        body = {
            "query_id": player.query_id,
            "query": player.query_text,
            # a completion without actions reads only v(∅), which no rewrite changes: the query
            # stands in for the one rewrite the request needs (an empty one is refused)
            "rewrites": list(player.actions) or [player.query_text or player.query_id],
            "evaluator": self.evaluator,
            "anchor_query": self.anchor_query,
        }
        res = self.http.post("/v1/credits", json=body, headers=self.headers)
        if res.status_code not in (200, 201):  # 201: the credit record was stored
            raise RuntimeError(f"POST /v1/credits answered {res.status_code}: {res.text[:300]}")
        out = res.json()
        for key in ("hits", "misses"):
            calls[key] += int((out.get("cache") or {}).get(key, 0))
        table: list[float] = out["value_table"]
        return table if player.actions else table[:1]
