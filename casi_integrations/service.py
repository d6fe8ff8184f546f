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
from typing import Any

import httpx
import torch

from evaluator.credit import RolloutActions
from policy.credit_api import CreditTables, game_credit, pad_values


class CreditClient:
    """``(players, n_players) → tables`` through ``{base_url}/v1/credits`` with an API key.

    A completion without actions is sent as one empty rewrite (a null player): its table is
    v(∅) twice. ``client``: an httpx.Client to reuse (default: one per source, ``timeout`` s).
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
        rows = [pad_values(self._table(p), len(p.actions), n_players) for p in players]
        counts = torch.tensor([len(p.actions) for p in players], dtype=torch.int64)
        return game_credit(torch.stack(rows), counts)

    def _table(self, player: RolloutActions) -> list[float]:
        body = {
            "query_id": player.query_id,
            "query": player.query_text,
            "rewrites": list(player.actions) or [""],
            "evaluator": self.evaluator,
            "anchor_query": self.anchor_query,
        }
        res = self.http.post("/v1/credits", json=body, headers=self.headers)
        if res.status_code not in (200, 201):  # 201: the credit record was stored
            raise RuntimeError(f"POST /v1/credits answered {res.status_code}: {res.text[:300]}")
        out = res.json()
        for key in ("hits", "misses"):
            self.cache[key] += int(out.get("cache", {}).get(key, 0))
        table: list[float] = out["value_table"]
        return table if player.actions else table[:1]
