"""What the outbox tests share: fake Slack and GitHub servers with known tokens, relays pointed at them (closed after
each test), and helpers to emit messages through a transition and drain the outbox."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg

from agents.client import Client
from agents.core.commands import Command, MessageSpec
from agents.core.phases import Event
from agents.core.transition import transition
from agents.jobs.handlers import registry
from agents.outbox.relay import Backoff, Relay
from agents.outbox.senders import GitHubSender, SlackSender
from models.db import Database
from tests.support.fakes import FakeGitHub, FakeSlack

# The jobs here are never run: the client only needs to know the operation.
registry.declare("noop")

SLACK_TOKEN = "xoxb-test-5ecret-slack-token"
GITHUB_TOKEN = "ghp_test5ecretGithubToken"

#: The relays a test made: closed when it ends (see :func:`close_relays`).
OPEN: list[Relay] = []


def fake_slack() -> Iterator[FakeSlack]:
    """A fixture's body: a fake Slack that knows :data:`SLACK_TOKEN`, running for the test."""
    fake = FakeSlack(token=SLACK_TOKEN, timeout_delay=1.5, retry_after=1.0)
    fake.start()
    yield fake
    fake.stop()


def fake_github() -> Iterator[FakeGitHub]:
    """A fixture's body: a fake GitHub that knows :data:`GITHUB_TOKEN`, running for the test."""
    fake = FakeGitHub(token=GITHUB_TOKEN, timeout_delay=1.5, retry_after=1.0)
    fake.start()
    yield fake
    fake.stop()


def close_relays() -> Iterator[None]:
    """An autouse fixture's body: close every relay the test made."""
    yield
    while OPEN:
        OPEN.pop().close()


def relay(db: Database, slack: FakeSlack, github: FakeGitHub, **kw: Any) -> Relay:
    made = Relay(
        db,
        {
            "slack": SlackSender(SLACK_TOKEN, f"{slack.url}/api/", timeout=1.0),
            "github": GitHubSender(GITHUB_TOKEN, github.url, timeout=1.0),
        },
        lease=kw.pop("lease", timedelta(seconds=10)),
        concurrency=kw.pop("concurrency", 8),
        backoff=Backoff(0.05, 0.2, kw.pop("max_attempts", 6), kw.pop("max_rate_limited", 200)),
        pass_seconds=10,
        secrets=(SLACK_TOKEN, GITHUB_TOKEN),
        **kw,
    )
    OPEN.append(made)
    return made


def emit(client: Client, agent: str, *messages: MessageSpec) -> None:
    state = client.get_state(agent)
    if state.phase == "idle":
        client.submit(agent, f"req-{agent}", None, operation="noop")
    transition(client.db, Command(client.get_state(agent).id, Event.PROGRESS, "worker", messages=messages))


def slack_msg(channel: str, target: str, text: str = "hello") -> MessageSpec:
    return MessageSpec("slack", channel, target, {"text": text})


def gh_msg(issue: str, target: str, body: str = "hello") -> MessageSpec:
    return MessageSpec("github", issue, target, {"body": body})


def drain(r: Relay, rounds: int = 40, pause: float = 0.1) -> None:
    for _ in range(rounds):
        r.run_pass()
        with psycopg.connect(r.db.libpq_url) as conn:
            row = conn.execute("SELECT count(*) FROM outbox WHERE status IN ('pending', 'sending')").fetchone()
        if row == (0,):
            return
        time.sleep(pause)
    raise AssertionError("the outbox did not drain")


def sql(db: Database, statement: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(db.libpq_url, autocommit=True) as conn:
        cur = conn.execute(statement, params)
        return cur.fetchall() if cur.description else []


def chatter(github: FakeGitHub, issue: str, n: int) -> None:
    """``n`` comments of people talking on ``issue`` after the message was created (none carries a key)."""
    for i in range(n):
        github.comments.setdefault(issue, []).append(
            {
                "id": i,
                "body": f"chatter {i}",
                "html_url": "x",
                "created_at": "2099-01-01T00:00:00Z",
                "updated_at": "2099-01-01T00:00:00Z",
            }
        )


def outbox_keys(db: Database) -> list[str]:
    """Every outbox message's key, in the order they were emitted."""
    with psycopg.connect(db.libpq_url) as conn:
        return [r[0] for r in conn.execute("SELECT key FROM outbox ORDER BY seq").fetchall()]


def one_pass(db: Database, senders: dict[str, Any] | None = None, *, backoff: Backoff | None = None) -> None:
    """One relay pass with these senders (none: every channel unconfigured, so its messages go dead), then closed."""
    made = Relay(
        db,
        senders or {},
        lease=timedelta(seconds=10),
        concurrency=2,
        backoff=backoff or Backoff(0.05, 0.2, 3, 10),
        pass_seconds=5,
    )
    try:
        made.run_pass()
    finally:
        made.close()
