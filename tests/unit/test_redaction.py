"""One redaction for everything Keel writes down: known secrets and credential shapes become ``***``."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import SecretStr

from agents.core.redaction import (
    RedactingFilter,
    clear_secrets,
    install_log_redaction,
    redact,
    redact_value,
    register_secrets,
    register_settings,
    secrets_of,
)
from models.settings import Settings


@pytest.fixture(autouse=True)
def _no_registered_secrets() -> Iterator[None]:
    clear_secrets()
    yield
    clear_secrets()


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("slack said invalid_auth for xoxb-1234567890-0987654321-AbCdEfGhIjKlMnOp", "xoxb-1234567890"),
        ("user token xoxp-11111-22222-33333-abcdef", "xoxp-11111"),
        ("app token xoxa-2-abcdef123456", "xoxa-2"),
        ("refresh xoxr-abcdef-123456", "xoxr-"),
        ("config token xoxe-1-abcdefghijkl", "xoxe-1"),
        ("gh token ghp_0123456789abcdefghijABCDEFGHIJ012345", "ghp_0123456789"),
        ("oauth gho_0123456789abcdefghijABCDEFGHIJ012345", "gho_0123456789"),
        ("fine-grained github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz", "github_pat_11ABC"),
        ("openai key sk-proj-AbCdEfGhIjKlMnOpQrStUvWx0123", "sk-proj-AbCd"),
        ("openai key sk-AbCdEfGhIjKlMnOpQrStUvWx0123", "sk-AbCdEf"),
        ("header Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.abc-_=", "eyJhbGci"),
        ("Authorization: Basic dXNlcjpwYXNzd29yZA==", "dXNlcjpw"),
        ("headers={'Authorization': 'token abcdef123456'}", "abcdef123456"),
        ('{"authorization": "opaque-credential-value"}', "opaque-credential"),
        ("could not connect to postgresql://keel:s3cr3t-pw@db:5432/keel", "s3cr3t-pw"),
        ("broker redis://:hunter2hunter2@redis:6379/0 is down", "hunter2hunter2"),
        ("aws AKIAIOSFODNN7EXAMPLE leaked", "AKIAIOSFODNN7EXAMPLE"),
        ("api token keel_q4Zr8Xb2v-L0_mW9s3TtYkPq1aBcDeFgHiJkLmNoPqR was refused", "keel_q4Zr8Xb2v"),
    ],
)
def test_each_token_shape_is_masked(text: str, secret: str) -> None:
    cleaned = redact(text)
    assert secret not in cleaned and "***" in cleaned, cleaned


_PIECES = [
    "xoxb-12-ab",
    "XOXB-12",
    "xapp-1-A",
    "github_pat_1A_b",
    "ghp_abc",
    "GHS_abc",
    "gh_x",
    "sk-",
    "SK-" + "a" * 16,
    "sk-" + "A_b-" * 5,
    "AKIA" + "A1" * 8,
    "asia" + "B2" * 8,
    "keel_" + "k" * 32,
    "KEEL_" + "x" * 40,
    "Bearer ",
    "bearer\tabc.def",
    "Authorization: ",
    "proxy-authorization=",
    "'authorization': '",
    "https://",
    "u:p@h",
    "redis://:pw@host",
    "://",
    ":",
    "@",
    "/",
    " ",
    "-",
    "_",
    "a",
    "Z",
    "0",
    "é",
    "\n",
    '"',
    "'",
    "=",
    "\u017f",  # long s: case-folds to s
    "\u212a",
    "\u0131",  # dotless i
    "\u0130",  # dotted capital I
    "beaRer\u212a",
]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=12).map("".join))
def test_the_fragment_prefilter_never_changes_what_is_masked(text: str) -> None:
    """A text with none of the shapes' fragments is returned as it is, without running the shapes: the same text
    the shapes alone would give, for texts made of every shape's pieces."""
    from agents.core.redaction import _SHAPES

    reference = text
    for pattern, replacement in _SHAPES:
        reference = pattern.sub(replacement, reference)
    assert redact(text) == reference


@pytest.mark.parametrize(
    "text",
    [
        "agent ops-bot is planning (revision 3)",
        "job req-1:tool:kb_lookup:1.call_0_0 failed: TimeoutError",
        "task-manager and risk-assessment are words, not keys",
        "postgresql://postgres@127.0.0.1:5432/keel has no password",
        "http://127.0.0.1:8080/v1/chat/completions",
        "Authorization failed for alice",
        "the migrations ship as keel_migrations; see keel_api_tokens_guard()",
    ],
)
def test_ordinary_text_is_left_alone(text: str) -> None:
    assert redact(text) == text


def test_registered_secrets_are_masked_whatever_their_shape() -> None:
    register_secrets("plain-looking-token-value", None, "", "short")  # too short to mask by value
    assert redact("got plain-looking-token-value back; short stays") == "got *** back; short stays"


def test_settings_register_their_tokens_and_url_passwords() -> None:
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        slack_token=SecretStr("opaque-slack-value-1"),
        github_token=SecretStr("opaque-github-value-2"),
        llm_api_key=SecretStr("opaque-llm-value-3"),
        database_url="postgresql://keel:db%2Fpass%40word@db:5432/keel",
        broker_url="redis://:broker-pass-4@redis:6379/0",
        migration_database_url="postgresql://postgres:migration-pass-5@db:5432/keel",
        db_app_password=SecretStr("app-role-pass-6"),
        db_auditor_password=SecretStr("auditor-role-pass-7"),
    )
    assert set(secrets_of(settings)) >= {
        "opaque-slack-value-1",
        "opaque-github-value-2",
        "opaque-llm-value-3",
        "db/pass@word",
        "broker-pass-4",
        "migration-pass-5",
        "app-role-pass-6",
        "auditor-role-pass-7",
    }
    register_settings(settings)
    text = "a b opaque-slack-value-1 opaque-github-value-2 opaque-llm-value-3 'db/pass@word' broker-pass-4"
    assert redact(text) == "a b *** *** *** '***' ***"


def test_nested_values_are_redacted_and_other_types_kept() -> None:
    value = {"error": "Bearer abcdef123", "n": 3, "calls": [{"ghp_key0123456789abcdef": ("xoxb-1-2-3",)}]}
    assert redact_value(value) == {"error": "Bearer ***", "n": 3, "calls": [{"***": ["***"]}]}


def test_the_log_filter_redacts_messages_arguments_and_tracebacks() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("keel.test.redaction")
    logger.propagate = False
    logger.addHandler(handler)
    install_log_redaction([logger])
    install_log_redaction([logger])  # idempotent
    assert sum(isinstance(f, RedactingFilter) for f in handler.filters) == 1
    try:
        logger.warning("call failed with %s", "Bearer abcdef123456")
        try:
            raise RuntimeError("upstream echoed xoxb-123-456-abcdefabcdef")
        except RuntimeError:
            logger.exception("job %s failed", "req-1:plan:1")
    finally:
        logger.removeHandler(handler)
    out = stream.getvalue()
    assert "abcdef123456" not in out and "xoxb-123" not in out, out
    assert "Bearer ***" in out and "RuntimeError: upstream echoed ***" in out and "req-1:plan:1" in out


#: Texts that made the URL-password pattern rescan the rest of the text from every position (13 s for 40 KB of
#: "a-"): a log line quotes what an unauthenticated client sent (uvicorn's access line: the path).
HOSTILE = ["a-", "xoxb-", "a://b:", " ", "authorization: "]


def _seconds_to_redact(text: str) -> float:
    """CPU seconds of this thread (best of five): the scan's own work, not the time spent waiting for a core while
    other tests run beside this one."""
    best = float("inf")
    for _ in range(5):
        started = time.thread_time()
        redact(text)
        best = min(best, time.thread_time() - started)
    return best


@pytest.mark.parametrize("unit", HOSTILE)
def test_redaction_time_grows_linearly_with_a_hostile_value(unit: str) -> None:
    small = _seconds_to_redact(unit * (20_000 // len(unit)))
    assert small < 1.0, f"20 KB of {unit!r} took {small:.2f} s to redact"  # linear: a few ms; quadratic: seconds
    large = _seconds_to_redact(unit * (200_000 // len(unit)))
    assert large < 2.0, f"200 KB of {unit!r} took {large:.2f} s to redact"
    # Ten times the text, about ten times the time (a quadratic scan: a hundred times).
    assert large < 40 * max(small, 0.001), (small, large)


def test_url_passwords_are_still_masked_after_long_runs_of_scheme_characters() -> None:
    text = "a-" * 5_000 + " postgresql://u:pw-secret-1@h/db and redis://:pw-secret-2@r:6379/0 x_https://u:pw-3@h"
    cleaned = redact(text)
    assert "postgresql://u:***@h/db" in cleaned and "redis://:***@r:6379/0" in cleaned
    assert "https://u:***@h" in cleaned and "pw-" not in cleaned


def test_the_otlp_collectors_credentials_are_secrets() -> None:
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        otlp_endpoint="https://otel:pass-word-5@collector:4318/?api_key=QUERY-secret%2B6&tenant=t",
    )
    environ = {
        "OTEL_EXPORTER_OTLP_HEADERS": "x-api-key=HDR-secret-7%3D%3D, authorization=Bearer%20hdr-token-8",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "x-honeycomb-team=trace-hdr-secret-9",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://c/v1/traces?key=env-query-secret-10",
    }
    assert set(secrets_of(settings, environ)) >= {
        "pass-word-5",
        "QUERY-secret%2B6",
        "QUERY-secret+6",
        "HDR-secret-7==",
        "Bearer hdr-token-8",
        "trace-hdr-secret-9",
        "env-query-secret-10",
    }
    register_settings(settings, environ)
    # An exception that quotes the exporter's headers, logged or stored as a job's last error.
    text = "export failed: headers={'x-api-key': 'HDR-secret-7==', 'x-honeycomb-team': 'trace-hdr-secret-9'}"
    assert redact(text) == "export failed: headers={'x-api-key': '***', 'x-honeycomb-team': '***'}"
    assert "secret" not in redact("url https://c/v1/traces?key=env-query-secret-10 and QUERY-secret+6")


def test_the_signing_key_the_session_key_and_the_s3_secret_are_secrets() -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    pem = (
        Ed25519PrivateKey.generate()
        .private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        .decode()
    )
    body = next(line for line in pem.splitlines() if not line.startswith("-----"))
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        audit_signing_key=SecretStr(pem),
        console_session_key=SecretStr("console-session-key-0123456789abcdef"),
    )
    found = set(secrets_of(settings, {"AWS_SECRET_ACCESS_KEY": "aws-secret-value-0123456789"}))
    assert {pem, body, "console-session-key-0123456789abcdef", "aws-secret-value-0123456789"} <= found
