"""The security headers on every answer of the console, against a real ``keel serve``: pages, redirects,
refusals, static files and the 429 alike."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from models.db import Database
from tests.support.broker import Broker
from tests.support.console import Browse, Serve, browsing, csrf_of, serving

pytestmark = pytest.mark.integration


@pytest.fixture
def serve(db: Database, db_url: str, broker: Broker, tmp_path: Path) -> Iterator[Serve]:
    with serving(db, db_url, broker, tmp_path) as start:
        yield start


@pytest.fixture
def browse() -> Iterator[Browse]:
    """Browsers of an API started by ``serve``, closed after the test."""
    with browsing() as of:
        yield of


#: What every console answer carries, error pages included.
_SECURITY_HEADERS = {
    "content-security-policy": "frame-ancestors 'none'",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
}


def _secured(answer: httpx.Response) -> None:
    for name, value in _SECURITY_HEADERS.items():
        assert value in answer.headers.get(name, ""), (answer.status_code, answer.request.url, name, answer.headers)


def test_every_console_answer_carries_the_security_headers_errors_included(serve: Serve, browse: Browse) -> None:
    api = serve({"KEEL_API_RATE_LIMITS": '{"approver": {"rate": 0.001, "burst": 1}}'})
    browsers = browse(api)
    signed_out = browsers.new()
    unauthorized = signed_out.post("/agents/x/approve", data={"csrf": "c", "revision": "1"})
    assert unauthorized.status_code == 401 and "Sign in again" in unauthorized.text
    _secured(unauthorized)
    _secured(signed_out.get("/agents"))  # the redirect to the sign-in form
    _secured(signed_out.get("/signin"))
    client = browsers.signed_in(api.token("approver"))
    page = client.get("/agents")
    _secured(page)
    for path, status in (
        ("/agents?cursor=garbage", 400),
        ("/agents?phase=sleeping", 400),
        ("/agents/nobody", 404),
        ("/agents/nobody/panel?drawn=-1", 422),  # refused by the query's own validation (a problem document)
        ("/agents/a/b/c", 404),  # no such console page
        ("/static/console.css", 200),
    ):
        answer = client.get(path)
        assert answer.status_code == status, (path, answer.text)
        _secured(answer)
    assert client.post("/signout", data={"csrf": "forged"}).status_code == 403  # counted: the token's burst is spent
    over = client.post("/signout", data={"csrf": csrf_of(page)})
    assert over.status_code == 429
    _secured(over)
    with api.http() as http:  # the API's docs are not the console's: Swagger UI loads its assets from elsewhere
        assert "content-security-policy" not in http.get("/docs").headers
