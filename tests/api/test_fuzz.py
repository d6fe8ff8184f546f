"""A bounded schemathesis run over the server's own OpenAPI (issue 18), once with a user key and
once with an admin key, with every check schemathesis has (its ``--checks all``; issue 27): no
generated request, valid or not, gets a 5xx; every response conforms to the documented
contract (status code, content type, headers and body schema); a request the schema accepts
is accepted (or 401 / 403 / 404 / 409 / 429), one it refuses is refused with a 4xx; an
operation that declares authentication refuses the same request without a key or with a bad
one. The checks schemathesis runs only in its CLI's coverage phase (Allow on OPTIONS / 405, an
undocumented method, a missing required header) find nothing to check here: OPTIONS and 405
are tested in tests/api/test_openapi_rules.py.

~25 cases per operation and key in `make test`; the long run is `make fuzz`
(``CASI_FUZZ_EXAMPLES`` per operation; ``CASI_FUZZ_REPORT=<file>`` writes the case counts as
JSON). With the admin key the generated job requests are real: the server runs at most one job
at a time (``CASI_API_MAX_RUNNING_JOBS=1``, the rest are 409) and every job is cancelled at the
end of the run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from api_support import ApiServer, auth

pytestmark = pytest.mark.integration
SERVER_ENV = {
    "CASI_API_RATE_PER_S": "0",
    "CASI_API_MAX_NEW_TOKENS": "8",
    "CASI_API_MAX_RUNNING_JOBS": "1",
    "CASI_API_AUTH_FAILURES_PER_MIN": "0",  # generated bad keys must not lock the good one out
}
EXAMPLES = int(os.environ.get("CASI_FUZZ_EXAMPLES", "25"))
REPORT = os.environ.get("CASI_FUZZ_REPORT")
_HTTPX = {"method", "url", "params", "headers", "cookies", "json", "content", "data", "files"}


def _checks() -> list:  # type: ignore[type-arg]
    """Every check schemathesis has (its CLI's ``--checks all``): the response ones (server
    error, status code, content type, headers, body schema), positive data accepted and
    negative data rejected, Allow on 405 / OPTIONS, authentication not ignored, and the ones
    that need a sequence of calls (they pass on a single call)."""
    from schemathesis.checks import CHECKS, is_check_class, load_all_checks

    load_all_checks()
    return [check for check in CHECKS.get_all() if not is_check_class(check)]


def _strategy(op):  # type: ignore[no-untyped-def]
    """Valid requests (positive: the server must accept them, or say 401 / 403 / 404 / 409 /
    429) and invalid ones (negative: the server must refuse them with a 4xx)."""
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    return st.one_of(op.as_strategy(mode) for mode in GenerationMode)


@pytest.mark.parametrize("scope", ["user", "admin"])
def test_no_generated_request_breaks_the_contract(
    server: ApiServer, keys: dict[str, str], scope: str
) -> None:
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    spec = httpx.get(server.url + "/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(spec)
    checks = _checks()
    failures: list[str] = []
    counts: dict[str, int] = {}
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for result in schema.get_all_operations():
            op = result.ok()
            counts[op.label] = 0

            @given(case=_strategy(op))
            @settings(max_examples=EXAMPLES, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))  # fmt: skip
            def one(case) -> None:  # type: ignore[no-untyped-def]
                # The key on the case itself: ignored_auth re-sends it without / with a bad key
                case.headers = {**(case.headers or {}), **auth(keys[scope])}
                kwargs = case.as_transport_kwargs(base_url=server.url)
                r = c.request(**{k: v for k, v in kwargs.items() if k in _HTTPX})
                counts[case.operation.label] += 1
                try:
                    case.validate_response(r, checks=checks, headers=kwargs["headers"],
                                           transport_kwargs={"base_url": server.url})  # fmt: skip
                except (AssertionError, BaseExceptionGroup) as exc:  # Failure / FailureGroup
                    failures.append(
                        f"{case.operation.label}: {r.status_code} {r.text[:300]}\n{exc}"[:1200]
                    )

            one()
        if scope == "admin":
            _cancel_all_jobs(c, keys["admin"])
    total = sum(counts.values())
    if REPORT:
        path = Path(REPORT)
        path.parent.mkdir(parents=True, exist_ok=True)
        previous = json.loads(path.read_text()) if path.is_file() else {}
        previous[scope] = {"cases": total, "failures": len(failures), "per_operation": counts,
                           "first_failures": failures[:20]}  # fmt: skip
        path.write_text(json.dumps(previous, indent=2))
    assert total >= len(counts), counts  # every operation was exercised
    assert not failures, (len(failures), failures[:10])
    assert "Traceback" not in server.log()


def _cancel_all_jobs(c: httpx.Client, admin_key: str) -> None:
    """Cancel every job the fuzzing started (cancel is idempotent), so nothing keeps running."""
    jobs = c.get("/v1/train-jobs", params={"limit": 100}, headers=auth(admin_key)).json()
    for job in jobs.get("items", []):
        c.post(f"/v1/train-jobs/{job['id']}/cancel", headers=auth(admin_key))
