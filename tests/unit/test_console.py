"""The console's pure parts: its session cookies and CSRF tokens, and what its pages compute (spend, time left,
charts, the order of the agents)."""

from __future__ import annotations

import asyncio
import base64
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from uuid import uuid4

import httpx
import pytest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from agents.ingress.console import paging, sessions, signin_limits, views
from agents.ingress.console.headers import NOT_CACHED, SECURITY_HEADERS, ConsoleHeaders
from agents.ingress.tokens import ApiToken, Scope
from models.console_sql import AgentKey
from models.schemas import AgentState, WaitingApproval
from models.settings import Settings

KEY = b"k" * 32
NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def _token(*scopes: Scope, revoked: bool = False) -> ApiToken:
    return ApiToken(
        id=uuid4(),
        name="alice",
        scopes=scopes,
        agent_prefix=None,
        created_at=NOW,
        created_by="test",
        last_used_at=None,
        revoked_at=NOW if revoked else None,
    )


def test_a_session_cookie_round_trips_and_any_tampering_is_refused() -> None:
    session = sessions.new_session(_token(Scope.APPROVER))
    cookie = sessions.encode_session(KEY, session)
    assert sessions.decode_session(KEY, cookie) == session
    assert session.csrf not in cookie.split(".")[1]  # the signature, not the CSRF token in the clear
    body, mac = cookie.rsplit(".", 1)
    assert sessions.decode_session(KEY, f"{body}x.{mac}") is None
    assert sessions.decode_session(KEY, f"{body}.{'0' * len(mac)}") is None
    assert sessions.decode_session(b"another key" * 3, cookie) is None
    assert sessions.decode_session(KEY, "") is None and sessions.decode_session(KEY, "garbage") is None


def test_a_session_ends_after_its_lifetime() -> None:
    old = sessions.Session(uuid4(), int(time.time()) - sessions.SESSION_SECONDS - 1, "c")
    assert sessions.decode_session(KEY, sessions.encode_session(KEY, old)) is None


def test_a_session_cookie_is_not_a_sign_in_cookie_and_back() -> None:
    nonce, signin = sessions.new_signin_nonce(KEY)
    assert sessions.signin_nonce_ok(KEY, signin, nonce)
    assert not sessions.signin_nonce_ok(KEY, signin, "other")
    assert sessions.decode_session(KEY, signin) is None
    session_cookie = sessions.encode_session(KEY, sessions.new_session(_token(Scope.OPERATOR)))
    assert not sessions.signin_nonce_ok(KEY, session_cookie, nonce)


def test_csrf_must_match_the_sessions() -> None:
    session = sessions.new_session(_token(Scope.OPERATOR))
    assert sessions.csrf_ok(session, session.csrf)
    assert not sessions.csrf_ok(session, None) and not sessions.csrf_ok(session, session.csrf + "x")


def test_a_csrf_token_that_is_not_ascii_is_refused_not_an_error() -> None:
    # hmac.compare_digest raises TypeError on str with non-ASCII characters: a forged form must be a refusal, not a
    # 500 (the sign-in form's check runs before anyone is signed in).
    session = sessions.new_session(_token(Scope.OPERATOR))
    assert not sessions.csrf_ok(session, "é") and not sessions.csrf_ok(session, session.csrf + "\u00e9")
    _, signin = sessions.new_signin_nonce(KEY)
    assert not sessions.signin_nonce_ok(KEY, signin, "é")


def test_who_may_sign_in() -> None:
    assert sessions.may_sign_in(_token(Scope.APPROVER))
    assert sessions.may_sign_in(_token(Scope.AUDITOR))
    assert sessions.may_sign_in(_token(Scope.PRODUCER, Scope.OPERATOR))
    assert not sessions.may_sign_in(_token(Scope.PRODUCER))
    assert not sessions.may_sign_in(_token(Scope.OPERATOR, revoked=True))


@pytest.mark.parametrize(("environment", "secure"), [("development", False), ("test", True), ("production", True)])
def test_the_cookie_is_http_only_strict_and_secure_unless_development(environment: str, secure: bool) -> None:
    settings = Settings(environment=environment, database_url="postgresql://h/db", broker_url="redis://h/0")  # type: ignore[arg-type]
    response = Response()
    sessions.set_cookie(response, settings, sessions.SESSION_COOKIE, "v", max_age=60)
    header = response.headers["set-cookie"]
    assert "HttpOnly" in header and "SameSite=strict" in header
    assert ("Secure" in header) is secure


def test_the_session_key_setting_must_be_long() -> None:
    with pytest.raises(ValidationError, match="at least 32 characters"):
        Settings(console_session_key="short")  # type: ignore[arg-type]
    configured = Settings(console_session_key="s" * 32)  # type: ignore[arg-type]
    assert sessions.session_key(configured) == b"s" * 32
    assert sessions.session_key(Settings()) == sessions.session_key(Settings())  # one random key per process


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"api_forwarded_allow_ips": ["*"]}, "not '\\*': with '\\*' any client could claim any address"),
        ({"api_forwarded_allow_ips": ["10.0.0.1/8"]}, "'10.0.0.1/8' is not an IP address or network"),
        ({"api_forwarded_allow_ips": ["proxy.internal"]}, "'proxy.internal' is not an IP address or network"),
        ({"console_signin_burst": 0}, "greater than or equal to 1"),
        ({"console_signin_per_minute": 0}, "greater than 0"),
        ({"console_signin_burst": 20, "console_signin_global_burst": 10}, "KEEL_CONSOLE_SIGNIN_GLOBAL_BURST: must not"),
        ({"console_page_size": 0}, "greater than or equal to 1"),
    ],
)
def test_the_sign_in_limit_proxy_and_paging_settings_refuse_bad_values(env: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Settings(**env)  # type: ignore[arg-type]


def test_the_sign_in_limit_and_proxy_settings_have_safe_defaults() -> None:
    settings = Settings()
    assert settings.api_forwarded_allow_ips == []  # X-Forwarded-For believed from no one
    assert settings.console_signin_limit_enabled
    limits = signin_limits.SignInLimits.from_settings(settings, limiter=None)  # type: ignore[arg-type]
    assert (limits.per_address.burst, limits.per_address.interval_microseconds) == (10, 12_000_000)
    assert (limits.overall.burst, limits.overall.interval_microseconds) == (100, 1_000_000)
    trusted = Settings(api_forwarded_allow_ips=[" 10.0.0.0/8", "192.168.1.7", "fd00::/8"])
    assert trusted.api_forwarded_allow_ips == ["10.0.0.0/8", "192.168.1.7", "fd00::/8"]


def test_sign_ins_count_per_address_and_ipv6_per_64_network() -> None:
    assert signin_limits.client_key("203.0.113.5") == "203.0.113.5"
    assert signin_limits.client_key("::ffff:203.0.113.5") == "203.0.113.5"
    assert signin_limits.client_key("2001:db8:1:2:aaaa::1") == signin_limits.client_key("2001:db8:1:2:bbbb::9")
    assert signin_limits.client_key("2001:db8:1:2::1") == "2001:db8:1:2::/64"
    assert signin_limits.client_key("2001:db8:1:3::1") != signin_limits.client_key("2001:db8:1:2::1")
    assert signin_limits.client_key(None) == signin_limits.client_key("/run/keel.sock") == "other"


def test_page_cursors_round_trip_and_anything_else_is_refused() -> None:
    key = AgentKey("idle", NOW, uuid4())
    assert paging.agents_key(paging.agents_cursor(key)) == key
    made = paging.agents_cursor(AgentKey("waiting_approval", NOW, key.id))
    for bad in ("", "garbage", made[:-3], made + "x" * 300, paging.agents_cursor(AgentKey("sleeping", NOW, key.id))):
        with pytest.raises(paging.BadCursor, match="is not one this list made"):
            paging.agents_key(bad)
    naive = base64.urlsafe_b64encode(f"idle|2026-12-01T12:00:00|{key.id}".encode()).decode()
    with pytest.raises(paging.BadCursor):
        paging.agents_key(naive)
    assert paging.seq_cursor("57", low=2) == 57
    for bad in ("1", "0", "-3", "5.0", "x", "٣", str(2**63)):
        with pytest.raises(paging.BadCursor):
            paging.seq_cursor(bad, low=2)


def _agent(phase: str, *, minutes_ago: int = 0, **fields: object) -> AgentState:
    at = NOW - timedelta(minutes=minutes_ago)
    return AgentState.model_validate(
        {
            "id": uuid4(),
            "name": f"{phase}-{minutes_ago}",
            "phase": phase,
            "revision": 1,
            "request_id": None,
            "soft_deadline": None,
            "hard_deadline": None,
            "budget_tokens": None,
            "budget_cost": None,
            "spent_tokens": 0,
            "spent_cost": Decimal(0),
            "created_at": at,
            "updated_at": at,
            **fields,
        }
    )


def test_spend_against_the_tighter_budget() -> None:
    assert views.spend(_agent("idle", spent_tokens=50, budget_tokens=200)).percent == 25
    both = views.spend(
        _agent("idle", spent_tokens=50, budget_tokens=200, spent_cost=Decimal("0.9"), budget_cost=Decimal(1))
    )
    assert both.percent == 90 and not both.over
    over = views.spend(_agent("idle", spent_tokens=300, budget_tokens=200))
    assert over.percent == 100 and over.over and "300 / 200 tokens" in over.text
    assert views.spend(_agent("idle", spent_tokens=7)).percent is None


def test_time_left() -> None:
    assert views.time_left(None, NOW) == ""
    assert views.time_left(NOW + timedelta(minutes=4, seconds=10), NOW) == "4m 10s left"
    assert views.time_left(NOW - timedelta(hours=2, minutes=5), NOW) == "passed 2h 5m ago"
    assert views.time_left(NOW + timedelta(days=3, hours=1), NOW) == "3d 1h left"


def test_a_chart_scales_its_bars_to_the_peak_and_places_them_by_minute() -> None:
    points = [(NOW - timedelta(minutes=30), 2.0), (NOW - timedelta(minutes=1), 4.0), (NOW - timedelta(hours=2), 9.0)]
    chart = views.chart("Requests", points, NOW, timedelta(hours=1), width=600)
    assert chart.peak == 4.0  # the point before the span counts for nothing
    assert len(chart.bars) == 2
    (x1, _, _, h1, tip1), (x2, _, _, h2, _) = chart.bars
    assert x1 == 300 and x2 == 590 and h2 == 2 * h1 and tip1 == "11:30 2"
    assert views.chart("Nothing", [], NOW, timedelta(hours=1)).bars == ()


# --- the inbox and edit-and-approve -------------------------------------------------------------------------------


def test_the_inbox_minimum_age_is_a_number_with_a_unit() -> None:
    assert views.parse_age(None) is None and views.parse_age("  ") is None
    assert views.parse_age("90") == timedelta(seconds=90) == views.parse_age("90s")
    assert views.parse_age(" 15m ") == timedelta(minutes=15)
    assert views.parse_age("2H") == timedelta(hours=2)
    assert views.parse_age("1.5d") == timedelta(hours=36)
    for bad in ("soon", "-5m", "5 minutes", "1h30m", "1e3", "5w"):
        with pytest.raises(ValueError, match=r"^min_age '.*' is not an age: give a number with s, m, h or d"):
            views.parse_age(bad)
    with pytest.raises(ValueError, match="min_age must be at most 3650 days, got 3651d"):
        views.parse_age("3651d")
    with pytest.raises(ValueError, match="…'"):  # a long value is shortened, not echoed whole
        views.parse_age("x" * 500)


def _call(**fields: object) -> WaitingApproval:
    since = NOW - timedelta(minutes=10)
    return WaitingApproval.model_validate(
        {
            "agent_id": uuid4(),
            "agent": "deployer",
            "revision": 4,
            "request_id": "r1",
            "tool": "deploy",
            "call_id": "c1",
            "round": 1,
            "arguments": {"service": "api"},
            "since": since,
            "waited_seconds": 600.0,
            **fields,
        }
    )


def test_an_approval_timeout_reads_as_what_happens_and_when() -> None:
    assert views.approval_timeout(_call()) is None
    since = NOW - timedelta(minutes=10)
    rejects = views.approval_timeout(
        _call(approval_timeout_seconds=4 * 3600, on_timeout="reject", times_out_at=since + timedelta(hours=4))
    )
    assert rejects == views.Timeout("rejected in 3h 50m (limit 4h 0m)", due=False)
    passed = views.approval_timeout(
        _call(approval_timeout_seconds=300, on_timeout="escalate", times_out_at=since + timedelta(minutes=5))
    )
    assert passed == views.Timeout("limit 5m 0s passed 5m 0s ago: escalating at the beat's next check", due=True)
    escalated = views.approval_timeout(
        _call(approval_timeout_seconds=300, on_timeout="escalate", times_out_at=since, escalated=True)
    )
    assert escalated == views.Timeout("escalated after 5m 0s; still waiting for a person", due=True)
    assert views.age(600.4) == "10m 0s" and views.age(-1) == "0s"


def test_edited_arguments_must_be_a_json_object_and_the_error_says_where() -> None:
    assert views.edited_arguments('{\n  "body": "Fixed ✓",\n  "issue": 7\n}') == {"body": "Fixed ✓", "issue": 7}
    refusals = {
        "": "arguments: give the call's arguments as a JSON object (the field is empty)",
        '{"issue": 7,}': "not valid JSON: Expecting property name enclosed in double quotes (line 1, column 13)",
        '{\n"issue": seven}': "arguments: not valid JSON: Expecting value (line 2, column 10)",
        '{"issue": NaN}': "arguments: not valid JSON: NaN is not a JSON value",
        '{"issue": -Infinity}': "arguments: not valid JSON: -Infinity is not a JSON value",
        "[1]": "arguments must be a JSON object",
        '"text"': "got a string",
        "null": "got null",
        "7": "got a number",
        " " + "1" * views.MAX_ARGUMENTS_CHARS: f"arguments: must be at most {views.MAX_ARGUMENTS_CHARS} characters",
    }
    for typed, message in refusals.items():
        with pytest.raises(ValueError) as refused:
            views.edited_arguments(typed)
        assert message in str(refused.value), typed[:40]


def test_an_approvals_edit_reads_as_each_argument_changed() -> None:
    details = {
        "call": {"tool": "github_comment", "arguments": {"repository": "acme/api", "issue": 7, "body": "Fixed"}},
        "edited_arguments": {"repository": "acme/api", "issue": 8, "body": "Fixed in v2.1", "draft": True},
    }
    assert views.argument_changes(details) == [
        views.Change("body", '"Fixed"', '"Fixed in v2.1"'),
        views.Change("draft", "(not given)", "true"),
        views.Change("issue", "7", "8"),
    ]
    assert views.argument_changes({"call": details["call"]}) == []  # approved as the model asked
    assert views.argument_changes({"reason": "x"}) == []
    assert views.argument_changes({"call": "odd", "edited_arguments": {}}) == []


def test_json_for_people_to_read() -> None:
    value = {"body": "ünï <b>", "n": [1, 2]}
    assert views.pretty(value) == '{\n  "body": "ünï <b>",\n  "n": [\n    1,\n    2\n  ]\n}'
    assert views.compact(value) == '{"body": "ünï <b>", "n": [1, 2]}'
    assert (
        views.compact({"t": "x" * 100}, 20) == '{"t": "xxxxxxxxxxxx…' and len(views.compact({"t": "x" * 100}, 20)) == 20
    )
    assert views.text_rows("{}") == 4 and views.text_rows("\n" * 100) == 18 and views.text_rows("\n" * 7) == 9


def test_a_notice_proof_holds_for_its_session_and_notice_only() -> None:
    session = sessions.new_session(_token(Scope.OPERATOR))
    proof = sessions.notice_proof(KEY, session, "r1:slack:dead")
    assert sessions.notice_ok(KEY, session, "r1:slack:dead", proof)
    other = sessions.new_session(_token(Scope.OPERATOR))
    assert not sessions.notice_ok(KEY, other, "r1:slack:dead", proof)
    assert not sessions.notice_ok(KEY, session, "r1:slack:other", proof)
    assert not sessions.notice_ok(b"another key" * 3, session, "r1:slack:dead", proof)
    for missing in (None, "", "é"):
        assert not sessions.notice_ok(KEY, session, "r1:slack:dead", missing)
    assert not sessions.notice_ok(KEY, session, None, proof)


def _headers_app() -> Starlette:
    async def boom(request: Request) -> Response:
        raise RuntimeError("a bug")

    async def fine(request: Request) -> Response:
        return PlainTextResponse("ok", headers={"Cache-Control": "max-age=60"})

    app = Starlette(routes=[Route("/agents/boom", boom), Route("/v1/boom", boom), Route("/static/app.css", fine)])
    app.add_middleware(ConsoleHeaders, sections={"agents"})
    return app


def test_console_answers_carry_the_security_headers_an_internal_error_too(caplog: pytest.LogCaptureFixture) -> None:
    async def get_all(*paths: str) -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=_headers_app(), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://keel.test") as http:
            return [await http.get(path) for path in paths]

    boom, static, api, elsewhere = asyncio.run(get_all("/agents/boom", "/static/app.css", "/v1/boom", "/elsewhere"))
    assert boom.status_code == 500 and boom.json()["incident"] in caplog.text
    assert "a bug" not in boom.text
    for name, value in {**SECURITY_HEADERS, **NOT_CACHED}.items():
        assert boom.headers[name] == value
    assert static.headers["cache-control"] == "max-age=60"  # its own kept; never no-store added
    assert static.headers["x-frame-options"] == "DENY"
    assert api.status_code == 500 and "content-security-policy" not in api.headers  # not the console's
    assert elsewhere.status_code == 404 and "content-security-policy" not in elsewhere.headers
