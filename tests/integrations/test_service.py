"""`casi_integrations.service.CreditClient` against a stand-in of ``POST /v1/credits``
(httpx.MockTransport; the real server: tests/api/test_credit_client.py): an action over the
server's limit is refused before any request, exactly as the in-process path refuses it, and the
returned tables carry the call's action-cache counts."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import torch

from app.limits import MAX_REWRITE_CHARS
from casi_integrations.credit import CasiCredit
from casi_integrations.service import CreditClient
from evaluator.credit import RolloutActions
from policy.credit_api import Completion, ValueFunctionCredit


def _value(actions: list[str], s: frozenset[int]) -> float:
    return 0.2 + sum(0.1 * (j + 1) * len(actions[j]) / 10 for j in s)


def _server(seen: list[dict[str, Any]]) -> httpx.Client:
    """A server that answers each completion's value table and 2 hits / 1 miss per call."""

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        acts = body["rewrites"]
        table = [
            _value(acts, frozenset(j for j in range(len(acts)) if mask >> j & 1))
            for mask in range(2 ** len(acts))
        ]
        return httpx.Response(200, json={"value_table": table, "cache": {"hits": 2, "misses": 1}})

    return httpx.Client(base_url="http://casi", transport=httpx.MockTransport(answer))


def _completion(actions: tuple[str, ...]) -> Completion:
    return Completion(
        "q", "query", actions, tuple((2 * j, 2 * j + 1) for j in range(len(actions))), 9
    )


def test_the_client_refuses_a_long_action_before_any_request(smol_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The server takes actions of at most MAX_REWRITE_CHARS (a 422 the client turned into a
    RuntimeError mid-step); the client refuses one in one line before sending anything, and an
    in-process source credits it, as `casi train` does."""
    seen: list[dict[str, Any]] = []
    client = CreditClient("http://casi", "key", client=_server(seen))
    local = ValueFunctionCredit(lambda i, s: float(len(s)))
    long = "x" * (MAX_REWRITE_CHARS + 1)
    completions = [_completion(("short",)), _completion(("fine", long))]
    with pytest.raises(ValueError, match="completion 1 .*action 1: 1,001 characters") as err:
        CasiCredit(client, smol_tokenizer, 2).credit(completions)
    assert "\n" not in str(err.value) and not seen  # refused before any request
    tables = CasiCredit(local, smol_tokenizer, 2).credit(completions)
    assert tables.value_full.tolist() == [1.0, 2.0]
    ok = "y" * MAX_REWRITE_CHARS  # at the limit: the client sends it
    CasiCredit(client, smol_tokenizer, 2).credit([_completion((ok,))])
    assert len(seen) == 1


def test_the_client_gives_the_in_process_numbers_and_its_cache_counts(smol_tokenizer) -> None:  # type: ignore[no-untyped-def]
    seen: list[dict[str, Any]] = []
    client = CreditClient("http://casi", "key", client=_server(seen))
    players = [
        RolloutActions("q", "query", ["alpha", "beta gamma"]),
        RolloutActions("q", "query", ["delta"]),
        RolloutActions("q", "query", []),
    ]
    local = ValueFunctionCredit(lambda i, s: _value(players[i].actions, s))
    ours, theirs = client(players, 3), local(players, 3)
    for name in ("values", "phi", "singleton", "leave_one_out", "broadcast"):
        torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), atol=1e-12, rtol=0)
    assert getattr(ours, "cache", None) == {
        "hits": 6,
        "misses": 3,
    }  # this call's counts: what the adapters log
    client(players[:1], 3)
    assert client.cache == {"hits": 8, "misses": 4}  # the running totals
    completions = [_completion(("alpha", "beta gamma"))]
    credit = CasiCredit(client, smol_tokenizer, 3).credit(completions)
    assert getattr(credit, "cache", None) == {"hits": 2, "misses": 1}
