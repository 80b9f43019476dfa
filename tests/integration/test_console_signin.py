"""Signing in to the operator console and out again, against a real ``keel serve``: the session cookie, the
sign-in limit per address and over every address, the token's rate shared by its console POSTs and its API
calls, and forms whose fields are not what the console sent."""

from __future__ import annotations

import time
from collections.abc import Iterator
from html import unescape
from pathlib import Path

import httpx
import pytest

from agents.ingress.tokens import revoke_token
from models.db import Database
from tests.support.api import Api, journal_count, problem, waiting_agent
from tests.support.broker import Broker
from tests.support.console import Browse, Browsers, Serve, browsing, csrf_of, serving

pytestmark = pytest.mark.integration


@pytest.fixture
def browsers(api: Api) -> Iterator[Browsers]:
    found = Browsers(api)
    yield found
    found.close()


@pytest.fixture
def serve(db: Database, db_url: str, broker: Broker, tmp_path: Path) -> Iterator[Serve]:
    with serving(db, db_url, broker, tmp_path) as start:
        yield start


@pytest.fixture
def browse() -> Iterator[Browse]:
    """Browsers of an API started by ``serve``, closed after the test."""
    with browsing() as of:
        yield of


def test_sign_in_sets_a_strict_http_only_session_and_sign_out_ends_it(api: Api, browsers: Browsers) -> None:
    client, answer = browsers.sign_in(api.token("approver", name="alice"))
    assert answer.status_code == 303 and answer.headers["location"] == "/agents"
    cookie = next(v for k, v in answer.headers.multi_items() if k == "set-cookie" and v.startswith("keel_session="))
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert "Secure" not in cookie  # KEEL_ENVIRONMENT defaults to development: plain http on 127.0.0.1
    page = client.get("/agents")
    assert page.status_code == 200 and "alice" in page.text and "Agents" in page.text
    policy = page.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy  # nothing from elsewhere
    out = client.post("/signout", data={"csrf": csrf_of(page)})
    assert out.status_code == 303
    again = client.get("/agents")
    assert again.status_code == 303 and again.headers["location"].startswith("/signin")


def test_a_wrong_token_or_a_producer_token_cannot_sign_in(api: Api, browsers: Browsers) -> None:
    _, wrong = browsers.sign_in("keel_" + "x" * 43)
    assert wrong.status_code == 401 and "unknown or revoked" in wrong.text
    assert "keel_session" not in wrong.headers.get("set-cookie", "")
    _, producer = browsers.sign_in(api.token("producer", name="robot"))
    assert producer.status_code == 403 and "producer token" in producer.text
    assert "keel_session" not in producer.headers.get("set-cookie", "")


def test_a_page_without_a_session_sends_to_the_sign_in_form(api: Api, browsers: Browsers) -> None:
    answer = browsers.new().get("/agents?phase=done")
    assert answer.status_code == 303
    assert answer.headers["location"] == "/signin?next=%2Fagents%3Fphase%3Ddone"


def test_revoking_the_token_ends_its_console_sessions(api: Api, browsers: Browsers) -> None:
    client = browsers.signed_in(api.token("operator", name="temp"))
    assert client.get("/agents").status_code == 200
    revoke_token(api.db, "temp", actor="test")
    gone = client.get("/agents")
    assert gone.status_code == 303 and gone.headers["location"].startswith("/signin")


def test_signing_out_ends_the_session_even_for_a_copy_of_its_cookie(api: Api, browsers: Browsers) -> None:
    with api.http(api.token("operator")) as http:
        state = waiting_agent(api, http)
    secret = api.token("approver", name="alice")
    client = browsers.signed_in(secret)
    elsewhere = browsers.signed_in(secret)  # the same token signed in on another machine
    cookie = client.cookies["keel_session"]
    page = client.get(f"/agents/{state['id']}")
    assert client.post("/signout", data={"csrf": csrf_of(page)}).status_code == 303
    copy = browsers.new()  # whoever kept the cookie (a shared machine, a proxy's log) after the person signed out
    copy.cookies.set("keel_session", cookie)
    again = copy.get("/agents")
    assert again.status_code == 303 and again.headers["location"].startswith("/signin")
    before = journal_count(api.db)
    forged = copy.post(f"/agents/{state['id']}/approve", data={"csrf": csrf_of(page), "revision": "3"})
    assert forged.status_code == 401 and journal_count(api.db) == before
    assert elsewhere.get("/agents").status_code == 200  # signing out ends that session, not the token's others


def test_odd_characters_in_a_form_are_refused_naming_the_problem_not_an_internal_error(
    api: Api, browsers: Browsers
) -> None:
    with api.http(api.token("operator")) as http:
        state = waiting_agent(api, http)
    before = journal_count(api.db)
    # Before anyone signs in: a sign-in form whose CSRF token is not ASCII.
    visitor = browsers.new()
    visitor.get("/signin")
    signin = visitor.post("/signin", data={"csrf": "é", "token": api.token("approver"), "next": "/agents"})
    assert signin.status_code == 403 and "The sign-in form expired" in signin.text
    client = browsers.signed_in(api.token("approver", "operator", name="alice"))
    page = client.get(f"/agents/{state['id']}")
    approve = client.post(f"/agents/{state['id']}/approve", data={"csrf": "é", "revision": str(state["revision"])})
    assert approve.status_code == 403 and "CSRF" in approve.text
    assert client.post("/signout", data={"csrf": "ü"}).status_code == 403
    retry = client.post("/outbox/retry", data={"csrf": csrf_of(page), "key": "a\x00b"})
    assert retry.status_code == 400 and "key" in retry.text
    assert journal_count(api.db) == before
    assert "unexpected error" not in api.log()


def _token_used(api: Api, name: str) -> bool:
    with api.db.connection() as conn:
        row = conn.execute("SELECT last_used_at FROM api_tokens WHERE name = %s", (name,)).fetchone()
        conn.rollback()
    assert row is not None
    return row[0] is not None


def test_failed_sign_ins_from_one_address_are_refused_until_the_allowance_comes_back(
    serve: Serve, browse: Browse
) -> None:
    # Three failures at once, then one more every 10 s; X-Forwarded-For believed from no one (the default).
    api = serve({"KEEL_CONSOLE_SIGNIN_BURST": "3", "KEEL_CONSOLE_SIGNIN_PER_MINUTE": "6"})
    browsers = browse(api)
    alice, bob = api.token("approver", name="alice"), api.token("approver", name="bob")
    guesser = browsers.new()  # from 127.0.0.1
    for _ in range(3):
        _, wrong = browsers.sign_in("keel_" + "x" * 43, client=guesser)
        assert wrong.status_code == 401 and "unknown or revoked" in wrong.text
    _, limited = browsers.sign_in("keel_" + "y" * 43, client=guesser)
    assert limited.status_code == 429
    wait = int(limited.headers["retry-after"])
    assert 1 <= wait <= 10
    assert f"Too many failed sign-ins from your address: wait {wait} seconds, then try again" in unescape(limited.text)
    assert limited.headers["ratelimit-policy"] == '"signin-address";q=3;w=30'

    # Over the limit a correct token is refused too, without being looked up (its last use is not noted).
    _, refused = browsers.sign_in(alice, client=guesser)
    assert refused.status_code == 429 and "keel_session" not in refused.headers.get("set-cookie", "")
    assert not _token_used(api, "alice")
    # Claiming another address is no way round it: no proxy is trusted.
    _, spoofed = browsers.sign_in(alice, client=guesser, headers={"X-Forwarded-For": "203.0.113.9"})
    assert spoofed.status_code == 429

    # Someone at another address signs in as if nothing happened.
    _, elsewhere = browsers.sign_in(bob, client=browsers.new(source="127.0.0.2"))
    assert elsewhere.status_code == 303 and elsewhere.headers["location"] == "/agents"

    time.sleep(int(refused.headers["retry-after"]))  # what the page told the person to do
    _, back = browsers.sign_in(alice, client=guesser)
    assert back.status_code == 303, back.text
    assert guesser.get("/agents").status_code == 200


def test_a_spray_from_many_addresses_never_locks_out_a_correct_token_at_a_console_or_the_api(
    serve: Serve, browse: Browse
) -> None:
    # Behind a trusted proxy each forwarded address counts; every address together may fail 3 times, then 1 a minute.
    api = serve(
        {
            "KEEL_API_FORWARDED_ALLOW_IPS": '["127.0.0.1"]',
            "KEEL_CONSOLE_SIGNIN_BURST": "2",
            "KEEL_CONSOLE_SIGNIN_PER_MINUTE": "1",
            "KEEL_CONSOLE_SIGNIN_GLOBAL_BURST": "3",
            "KEEL_CONSOLE_SIGNIN_GLOBAL_PER_MINUTE": "1",
        }
    )
    browsers = browse(api)
    secret = api.token("operator", name="olga")
    wrong = "keel_" + "x" * 43

    def sign_in(address: str, token: str) -> httpx.Response:
        return browsers.sign_in(token, headers={"X-Forwarded-For": address})[1]

    def call(address: str, token: str) -> int:
        with api.http(token) as http:
            return http.get("/v1/agents", headers={"X-Forwarded-For": address}).status_code

    assert [sign_in("203.0.113.5", wrong).status_code for _ in range(2)] == [401, 401]
    own = sign_in("203.0.113.5", secret)
    assert own.status_code == 429 and "from your address" in own.text  # the address's own failures
    assert own.headers["ratelimit-policy"].startswith('"signin-address";q=2')
    assert call("203.0.113.5", secret) == 429  # the same allowance at the API's door
    assert sign_in("203.0.113.6", secret).status_code == 303  # its own bucket; a success counts nowhere
    assert call("203.0.113.7", wrong) == 401  # the third failure over every address: the ceiling is reached
    # Sprayed from more addresses: each gets one failure, then its address is out of allowance.
    for n in range(10, 14):
        assert sign_in(f"203.0.113.{n}", wrong).status_code == 401
        assert call(f"203.0.113.{n}", wrong) == 429
        assert sign_in(f"203.0.113.{n}", secret).status_code == 429
    # Every operator at an address of their own still signs in and calls the API: successes are charged nowhere.
    for n in range(20, 24):
        assert sign_in(f"203.0.113.{n}", secret).status_code == 303
        assert call(f"203.0.113.{n}", secret) == 200


def test_failed_api_tokens_from_one_address_are_refused_before_the_lookup(serve: Serve) -> None:
    api = serve({"KEEL_CONSOLE_SIGNIN_BURST": "3", "KEEL_CONSOLE_SIGNIN_PER_MINUTE": "1"})
    secret = api.token("auditor", name="ada")
    with api.http("keel_" + "z" * 43) as guesser:
        assert [guesser.get("/v1/agents").status_code for _ in range(3)] == [401, 401, 401]
        over = guesser.get("/v1/agents")
    refused = problem(over, 429, "rate-limited")
    assert "too many failed tokens from your address" in refused["detail"]
    assert int(over.headers["retry-after"]) >= 1
    with api.http(secret) as http:
        assert http.get("/v1/agents").status_code == 429
    assert not _token_used(api, "ada")  # not looked up


def test_console_posts_count_against_the_tokens_rate_like_its_api_calls(serve: Serve, browse: Browse) -> None:
    api = serve({"KEEL_API_RATE_LIMITS": '{"approver": {"rate": 0.001, "burst": 2}}'})
    with api.http(api.token("operator")) as http:
        state = waiting_agent(api, http)
    browsers = browse(api)
    secret = api.token("approver", name="alice")
    client = browsers.signed_in(secret)  # signing in and reading pages cost nothing
    page = client.get(f"/agents/{state['id']}")
    assert client.get("/agents").status_code == 200
    drawn = str(state["revision"])
    forged = [client.post(f"/agents/{state['id']}/approve", data={"csrf": "forged", "revision": drawn}) for _ in "ab"]
    assert [f.status_code for f in forged] == [403, 403]  # refused, but counted: the API counts before it checks
    before = journal_count(api.db)
    over = client.post(f"/agents/{state['id']}/approve", data={"csrf": csrf_of(page), "revision": drawn})
    assert over.status_code == 429 and int(over.headers["retry-after"]) > 1
    assert "Token &#39;alice&#39; is over its rate" in over.text and "Nothing was changed" in over.text
    assert journal_count(api.db) == before
    for path in ("/outbox/retry", "/signout"):
        assert client.post(path, data={"csrf": csrf_of(page), "key": "k"}).status_code == 429
    with api.http(secret) as http:
        assert http.get("/v1/agents").status_code == 429  # one bucket for the token, console and API alike
    with api.http(api.token("operator")) as http:
        assert http.get(f"/v1/agents/{state['id']}").json()["revision"] == state["revision"]
