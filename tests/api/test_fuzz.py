"""A bounded schemathesis run over the server's own OpenAPI (issue 18): no generated request,
valid or not, gets a 5xx or a non-JSON error. A user key is used, so the admin-only routes
(start jobs and audits, activate) answer 403 and nothing heavy is started. ~1-2 minutes; a
longer run: ``CASI_FUZZ_EXAMPLES=500 pytest tests/api/test_fuzz.py``."""

from __future__ import annotations

import os

import httpx
import pytest
from api_support import ApiServer, auth

pytestmark = pytest.mark.integration
SERVER_ENV = {"CASI_API_RATE_PER_S": "0", "CASI_API_MAX_NEW_TOKENS": "8"}
EXAMPLES = int(os.environ.get("CASI_FUZZ_EXAMPLES", "25"))


def test_no_generated_request_gets_a_5xx(server: ApiServer, keys: dict[str, str]) -> None:
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    spec = httpx.get(server.url + "/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(spec)
    failures: list[str] = []
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for result in schema.get_all_operations():
            op = result.ok()

            @given(case=op.as_strategy())
            @settings(max_examples=EXAMPLES, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))  # fmt: skip
            def one(case) -> None:  # type: ignore[no-untyped-def]
                kwargs = case.as_transport_kwargs(base_url=server.url)
                kwargs["headers"] = {**(kwargs.get("headers") or {}), **auth(keys["user"])}
                kwargs.pop("base_url", None)
                r = c.request(**{k: v for k, v in kwargs.items() if k in _HTTPX})
                ctype = r.headers.get("content-type", "")
                if r.status_code >= 500 or (r.status_code >= 400 and "json" not in ctype):
                    failures.append(f"{case.operation.label}: {r.status_code} {r.text[:200]}")

            one()
    assert not failures, failures[:10]
    assert "Traceback" not in server.log()


_HTTPX = {"method", "url", "params", "headers", "cookies", "json", "content", "data", "files"}
