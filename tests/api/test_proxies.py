"""What a client (or a proxy) says about where the request came from and went to.

Issue 38, item 14: behind a TLS proxy. `casi serve` ignored X-Forwarded-Proto and
X-Forwarded-For from everyone (uvicorn ran with proxy_headers off), so the dashboard's cookie
was never Secure behind TLS, and the auth-failure limit counted the proxy's address: 31 wrong
keys from one client got the next good key from any other client a 429 (here the limit is 3
wrong keys a minute, so the test does not race its refill).

With CASI_API_TRUSTED_PROXIES those headers are believed from the listed peers only. The
server here trusts 127.0.0.1; requests sent from 127.0.0.2 (another loopback address, bound
by the client) are a peer it does not trust. A real `casi serve`, real database.

Item 18: the trailing-slash redirect built its absolute `Location` from the `Host` header
(`Host: evil.example` redirected to `http://evil.example/…`); it is relative now.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from api_support import ApiServer, auth

pytestmark = pytest.mark.integration
SERVER_ENV = {  # read by the `server` fixture
    "CASI_API_TRUSTED_PROXIES": "127.0.0.1",
    # 3 wrong keys, then one more every 20 s: a loaded machine cannot refill it mid-test (the
    # default 30/min refills one every 2 s)
    "CASI_API_AUTH_FAILURES_PER_MIN": "3",
}
FAILURES = 3
UNTRUSTED_PEER = "127.0.0.2"


@pytest.fixture()
def untrusted(server: ApiServer) -> Iterator[httpx.Client]:
    """A client whose connections come from 127.0.0.2: not a trusted proxy."""
    transport = httpx.HTTPTransport(local_address=UNTRUSTED_PEER)
    with httpx.Client(base_url=server.url, timeout=60, transport=transport) as c:
        yield c


def _cookie_flags(r: httpx.Response) -> list[list[str]]:
    """The attributes of every Set-Cookie, lower-cased."""
    return [[part.strip().lower() for part in h.split(";")] for h in r.headers.get_list("set-cookie")]  # fmt: skip


def test_cookie_is_secure_behind_tls_only_from_a_trusted_proxy(
    client: httpx.Client, untrusted: httpx.Client
) -> None:
    https = {"X-Forwarded-Proto": "https"}
    behind_tls = client.get("/ui/login", headers=https)
    assert behind_tls.status_code == 200
    (flags,) = _cookie_flags(behind_tls)
    assert "secure" in flags and "httponly" in flags and "samesite=strict" in flags

    (plain,) = _cookie_flags(client.get("/ui/login"))  # the proxy said nothing: plain http
    assert "secure" not in plain
    (spoofed,) = _cookie_flags(untrusted.get("/ui/login", headers=https))
    assert "secure" not in spoofed  # a peer that is no proxy cannot claim https


def test_auth_failures_count_per_client_behind_a_trusted_proxy(
    client: httpx.Client, untrusted: httpx.Client, keys: dict[str, str]
) -> None:
    good, wrong = auth(keys["user"]), auth("casi_" + "0" * 43)

    def via_proxy(address: str, headers: dict[str, str]) -> httpx.Response:
        return client.get("/v1/policies", headers={**headers, "X-Forwarded-For": address})

    codes = [via_proxy("203.0.113.7", wrong).status_code for _ in range(FAILURES + 1)]
    assert codes == [401] * FAILURES + [429]
    assert via_proxy("203.0.113.7", good).status_code == 429  # that client waits
    assert via_proxy("203.0.113.8", good).status_code == 200  # another client behind it doesn't
    assert client.get("/v1/policies", headers=good).status_code == 200  # nor the proxy itself

    # an untrusted peer's X-Forwarded-For is not believed: a new address per wrong key does
    # not escape the limit, which counts the peer
    codes = [
        untrusted.get(
            "/v1/policies", headers={**wrong, "X-Forwarded-For": f"198.51.100.{i}"}
        ).status_code
        for i in range(FAILURES + 1)
    ]
    assert codes == [401] * FAILURES + [429]
    fresh = {**good, "X-Forwarded-For": "198.51.100.200"}
    assert untrusted.get("/v1/policies", headers=fresh).status_code == 429


def test_trailing_slash_redirect_is_relative_whatever_the_host_header(
    client: httpx.Client, untrusted: httpx.Client
) -> None:
    evil = {"Host": "evil.example"}
    for c in (client, untrusted):
        for path, location in (
            ("/v1/policies/", "/v1/policies"),
            ("/v1/policies/?limit=5&offset=0", "/v1/policies?limit=5&offset=0"),
            ("/v1/credits/12/", "/v1/credits/12"),
            ("/ui/runs/", "/ui/runs"),
        ):
            r = c.get(path, headers=evil, follow_redirects=False)
            assert r.status_code == 307 and r.headers["location"] == location, (path, r.headers)
        # a target that would read as another host is not redirected at all
        r = c.get(c.base_url.copy_with(raw_path=b"//evil.example/"), headers=evil)
        assert r.status_code == 404 and "location" not in r.headers
    # a client that follows it stays on this server (before: off to http://evil.example)
    followed = client.get(
        "/v1/policies/", headers={**evil, "X-API-Key": "casi_x"}, follow_redirects=True
    )
    assert followed.url.host == "127.0.0.1" and followed.url.path == "/v1/policies"
    assert followed.status_code == 401
