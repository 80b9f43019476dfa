"""Hostile input is refused, never crashes, and changes nothing; secrets never reach the journal.

Every text that enters Keel through the client or the ``keel`` command (agent name, request id, input, actor,
reason, details) is checked: a lone surrogate (not encodable as UTF-8, so PostgreSQL cannot store it) or an
oversized reason gets :class:`InvalidInput` naming the field, and no row or journal event is written.
"""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

import tests.support.handlers  # noqa: F401 - registers the leaky handler
from agents.client import Client
from agents.core import journal
from agents.core.commands import Command
from agents.core.errors import InvalidInput, StaleRevision
from agents.core.phases import Event
from agents.core.policies import DEFAULT_RULES
from agents.core.redaction import RedactingFilter, clear_secrets, register_secrets
from agents.jobs.handlers import registry
from agents.jobs.runner import Runner
from models.db import Database
from models.jobs_sql import job_row
from tests.support.audit import clean_env
from tests.support.cli import run_keel
from tests.support.keys import scoped

pytestmark = pytest.mark.integration

LONE = "\ud800"
KEEL = str(Path(sys.executable).parent / "keel")
SCRATCH = tempfile.mkdtemp(prefix="keel-hostile-")


def _footprint(raw: psycopg.Connection[Any]) -> tuple[Any, ...]:
    """Everything a refused command must leave as it was."""
    return (
        raw.execute("SELECT count(*) FROM audit.journal").fetchone(),
        raw.execute("SELECT id, revision, phase, request_id FROM agents ORDER BY id").fetchall(),
        raw.execute("SELECT count(*) FROM requests").fetchone(),
        raw.execute("SELECT count(*) FROM jobs").fetchone(),
    )


Call = Callable[[Client, Any], Any]
CASES: list[tuple[str, Call, str]] = [
    ("cancel reason", lambda c, a: c.cancel(a.id, actor="bob", reason=f"oops {LONE}"), "reason"),
    ("cancel actor", lambda c, a: c.cancel(a.id, actor=f"bob{LONE}"), "actor"),
    ("reject reason", lambda c, a: c.reject(a.id, expected_revision=a.revision, actor="bob", reason=LONE), "reason"),
    ("approve actor", lambda c, a: c.approve(a.id, expected_revision=a.revision, actor=LONE), "actor"),
    ("submit input", lambda c, a: c.submit(a.id, "r2", {"prompt": f"hi {LONE}"}), "input.prompt"),
    ("submit input key", lambda c, a: c.submit(a.id, "r2", {LONE: 1}), "input"),
    ("submit input list", lambda c, a: c.submit(a.id, "r2", ["ok", LONE]), "input[1]"),
    ("submit actor", lambda c, a: c.submit(a.id, "r2", {"prompt": "hi"}, actor=LONE), "actor"),
    ("submit request id", lambda c, a: c.submit(a.id, f"r{LONE}", {"prompt": "hi"}), "request_id"),
    ("agent name", lambda c, a: c.create_agent(f"x{LONE}"), "name"),
    ("creator", lambda c, a: c.create_agent("other", actor=LONE), "actor"),
    ("agent reference", lambda c, a: c.cancel(f"ops{LONE}", actor="bob"), "agent"),
    ("agent lookup", lambda c, a: c.get_state(f"ops{LONE}"), "agent"),
    ("cancel reason 5 MB", lambda c, a: c.cancel(a.id, actor="bob", reason="x" * 5_000_000), "reason"),
    ("cancel reason too long", lambda c, a: c.cancel(a.id, actor="bob", reason="x" * 2001), "reason"),
    ("reject reason too long", lambda c, a: c.reject(a.id, expected_revision=1, actor="b", reason="x" * 2001), "2000"),
    ("NUL reason", lambda c, a: c.cancel(a.id, actor="bob", reason="a\x00b"), "reason"),
]


@pytest.mark.parametrize(("call", "field"), [(c, f) for _, c, f in CASES], ids=[n for n, _, _ in CASES])
def test_bad_text_is_refused_naming_the_field_and_changes_nothing(
    client: Client, raw: psycopg.Connection[Any], call: Call, field: str
) -> None:
    agent = client.create_agent("ops")
    agent = client.submit(agent.id, "r1", {"prompt": "hello"})
    before = _footprint(raw)
    with pytest.raises(InvalidInput) as info:
        call(client, agent)
    message = str(info.value)
    assert field in message, message
    message.encode()  # the message itself is printable: it never echoes the bad character
    assert _footprint(raw) == before


def test_a_reason_at_the_limit_is_accepted_and_the_limit_is_named(client: Client) -> None:
    agent = client.create_agent("ops")
    agent = client.submit(agent.id, "r1", {"prompt": "hello"})
    with pytest.raises(InvalidInput, match="2000"):
        client.cancel(agent.id, actor="bob", reason="x" * 2001)
    client.cancel(agent.id, actor="bob", reason="x" * 2000)
    assert client.journal(agent_id=agent.id)[-1].details["reason"] == "x" * 2000


def test_commands_refuse_unstorable_details(client: Client) -> None:
    agent = client.create_agent("ops")
    with pytest.raises(InvalidInput, match=r"details\.note"):
        Command(agent.id, Event.CANCEL, "bob", details={"note": LONE})
    with pytest.raises(InvalidInput, match="reason"):
        Command(agent.id, Event.CANCEL, "bob", details={"reason": "x" * 2001})
    with pytest.raises(InvalidInput, match="actor"):
        Command(agent.id, Event.CANCEL, f"b{LONE}")


# --- through the keel command ---------------------------------------------------------------------------------------


def keel(db_url: str, *args: str | bytes) -> subprocess.CompletedProcess[str]:
    env = clean_env()
    env["KEEL_DATABASE_URL"] = db_url
    return run_keel(args, env)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("cancel", "ops", "--reason", b"bad \xff byte", "--actor", "bob"), "reason"),  # argv that is not UTF-8
        (("cancel", "ops", "--actor", b"b\xffb"), "actor"),
        (("cancel", "ops", "--reason", "x" * 3000, "--actor", "bob"), "at most 2000"),
        (("submit", "ops", "r2", "--input", '{"prompt": "\\ud800"}'), "input.prompt"),
        (("agent", "create", b"n\xff"), "name"),
    ],
)
def test_the_command_line_refuses_bad_text_in_one_line(
    client: Client, db_url: str, raw: psycopg.Connection[Any], args: tuple[str | bytes, ...], field: str
) -> None:
    agent = client.create_agent("ops")
    client.submit(agent.id, "r1", {"prompt": "hello"})
    before = _footprint(raw)
    result = keel(db_url, *args)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("keel: error:") and field in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert _footprint(raw) == before


# --- secrets never reach the journal --------------------------------------------------------------------------------


@pytest.fixture
def configured_token(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    token = "opaque-configured-token-0451"  # no known shape: only registration can catch it
    monkeypatch.setenv("KEEL_GITHUB_TOKEN", token)
    register_secrets(token)
    yield token
    clear_secrets()


def test_a_handler_exception_is_journaled_and_logged_redacted(
    client: Client, db: Database, raw: psycopg.Connection[Any], configured_token: str
) -> None:
    agent = client.create_agent("leaker")
    client.submit(agent.id, "r1", None, operation="leaky")
    key = scoped(agent.id, "r1:leaky:1")
    root = logging.getLogger()
    stream = io.StringIO()
    stream_handler = logging.StreamHandler(stream)
    stream_handler.addFilter(RedactingFilter())  # what install_log_redaction() puts on a keel process's handlers
    root.addHandler(stream_handler)
    old_level = root.level
    root.setLevel(logging.INFO)
    try:
        Runner(db, registry, worker="t", lease=timedelta(seconds=30), rules=DEFAULT_RULES).run(key)
    finally:
        root.removeHandler(stream_handler)
        root.setLevel(old_level)
    stored = raw.execute("SELECT details::text FROM audit.journal ORDER BY id").fetchall()
    text = json.dumps([row[0] for row in stored])
    assert configured_token not in text and "xoxb-12345" not in text, text
    failed = client.journal(agent_id=agent.id)[-1]
    assert "token=*** and Authorization: ***" in failed.details["error"], failed.details
    logged = stream.getvalue()
    assert key in logged and configured_token not in logged and "xoxb-12345" not in logged, logged
    assert journal.verify(db).ok
    assert job_row(db, key)["status"] == "pending"  # type: ignore[index]  # unknown: retried


def test_secrets_in_a_reason_or_a_rejection_are_journaled_redacted(
    client: Client, raw: psycopg.Connection[Any]
) -> None:
    agent = client.create_agent("ops")
    agent = client.submit(agent.id, "r1", {"prompt": "hello"})
    with pytest.raises(StaleRevision):
        client.cancel(agent.id, expected_revision=0, actor="bob", reason="use ghp_0123456789abcdefABCDEF0123456789")
    client.cancel(agent.id, actor="bob", reason="pasted xoxp-1111-2222-3333-abcdefabcdef by mistake")
    text = json.dumps([r[0] for r in raw.execute("SELECT details::text FROM audit.journal").fetchall()])
    assert "ghp_0123" not in text and "xoxp-1111" not in text
    events = client.journal(agent_id=agent.id)
    assert events[-2].kind == "rejected" and events[-2].details["reason"] == "use ***"
    assert events[-1].details["reason"] == "pasted *** by mistake"
