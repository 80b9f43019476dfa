"""500 messages to 20 destinations through ambiguous failures, rate limits and a relay SIGKILLed twice, with Keel's
key planted at the receiver by someone else ahead of a third of them: every key arrives exactly once (by Keel), in
order per destination, with one confirmation each. And two relays whose clocks
are five minutes apart either side of the database's: the same, on the database's clock."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator

import pytest

from agents.client import Client
from agents.core.commands import Command, MessageSpec
from agents.core.phases import Event
from agents.core.transition import transition
from tests.chaos.conftest import ROUTES, Stack, skewed, wait_until
from tests.support.fakes import FakeGitHub, FakeSlack
from tests.support.keys import scoped

pytestmark = pytest.mark.chaos


@pytest.fixture(params=ROUTES)
def database_route(request: pytest.FixtureRequest) -> str:
    """Every scenario here also runs with the processes behind a PgBouncer in transaction mode."""
    return str(request.param)


SLACK_TOKEN = "xoxb-chaos-slack-token-000"
GITHUB_TOKEN = "ghp_chaosGithubToken000"


def bucket(key: str) -> int:
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % 100


def fault(destination: str, key: str, attempt: int) -> str | None:
    """Deterministic per key: 20% of first attempts end ambiguously; some hit rate limits or plain 500s."""
    if attempt > 1:
        return None
    share = bucket(key)
    if share < 10:
        return "apply_then_timeout"
    if share < 20:
        return "apply_then_drop"
    if share < 24:
        return "429" if ":slack:" in key else "403_secondary"
    if share < 27:
        return "500"
    return None


@pytest.fixture
def fakes() -> Iterator[tuple[FakeSlack, FakeGitHub]]:
    slack = FakeSlack(token=SLACK_TOKEN, faults=fault, timeout_delay=1.5, retry_after=0.5).start()
    github = FakeGitHub(token=GITHUB_TOKEN, faults=fault, timeout_delay=1.5, retry_after=0.5).start()
    assert isinstance(slack, FakeSlack) and isinstance(github, FakeGitHub)
    yield slack, github
    slack.stop()
    github.stop()


Emit = Callable[[int], None]


def twenty_lines(
    stack: Stack, client: Client, fakes: tuple[FakeSlack, FakeGitHub]
) -> tuple[dict[str, list[str]], Emit]:
    """Relays pointed at the fakes, 20 destinations (10 Slack channels, 10 GitHub issues) each with an agent in
    flight, and ``emit(batch)``, which emits 5 messages to every destination; the expected keys per destination."""
    slack, github = fakes
    stack.env.update(
        {
            "KEEL_SLACK_TOKEN": SLACK_TOKEN,
            "KEEL_SLACK_API_URL": f"{slack.url}/api/",
            "KEEL_GITHUB_TOKEN": GITHUB_TOKEN,
            "KEEL_GITHUB_API_URL": github.url,
            "KEEL_HTTP_TIMEOUT_SECONDS": "1",
            "KEEL_OUTBOX_LEASE_SECONDS": "3",
            "KEEL_OUTBOX_INTERVAL_SECONDS": "0.2",
            "KEEL_OUTBOX_CONCURRENCY": "20",
            "KEEL_OUTBOX_BACKOFF_SECONDS": "0.2",
            "KEEL_OUTBOX_BACKOFF_MAX_SECONDS": "1",
            "KEEL_OUTBOX_PASS_SECONDS": "3",
        }
    )
    destinations = [f"C{n:02d}" for n in range(10)] + [f"acme/repo{n}#{n + 1}" for n in range(10)]
    expected: dict[str, list[str]] = {d: [] for d in destinations}
    agents = []
    for n, destination in enumerate(destinations):
        agent = client.create_agent(f"notifier-{n}")
        client.submit(agent.id, f"req-{n}", None, operation="noop")
        agents.append((agent.id, destination, f"req-{n}"))

    def emit(batch: int) -> None:
        for agent_id, destination, request_id in agents:
            channel = "github" if "/" in destination else "slack"
            field = "body" if channel == "github" else "text"
            specs = tuple(
                MessageSpec(channel, destination, f"m{batch * 5 + i:02d}", {field: f"update {batch * 5 + i}"})
                for i in range(5)
            )
            keys = [scoped(agent_id, f"{request_id}:{channel}:{s.target}") for s in specs]
            for key in keys:
                if bucket(key) % 3 == 0:  # someone else posts Keel's key first (a third: ambiguous sends among them)
                    if channel == "github":
                        github.plant(destination, key)
                    else:
                        slack.plant(destination, key)
            transition(client.db, Command(agent_id, Event.PROGRESS, "notifier", messages=specs))
            expected[destination] += keys

    return expected, emit


def test_five_hundred_messages_survive_faults_and_two_relay_kills(
    stack: Stack, client: Client, fakes: tuple[FakeSlack, FakeGitHub]
) -> None:
    slack, github = fakes
    expected, emit = twenty_lines(stack, client, fakes)
    destinations = list(expected)

    stack.worker("relay-1", concurrency=2, queues="keel.outbox")
    stack.beat()
    emit(0)
    emit(1)

    def delivered() -> int:
        return sum(slack.delivered_keys().values()) + sum(github.delivered_keys().values())

    wait_until("a third to be delivered", lambda: delivered() >= 150, 120)
    stack.kill("relay-1")
    emit(2)
    emit(3)
    stack.worker("relay-2", concurrency=2, queues="keel.outbox")
    wait_until("two thirds to be delivered", lambda: delivered() >= 330, 120)
    stack.kill("relay-2")
    emit(4)
    stack.worker("relay-3", concurrency=2, queues="keel.outbox")
    wait_until(
        "every message to be sent",
        lambda: stack.query("SELECT count(*) FROM outbox WHERE status = 'sent'") == [(500,)],
        180,
    )

    counts = slack.delivered_keys() + github.delivered_keys()
    assert len(counts) == 500 and set(counts.values()) == {1}, [k for k, n in counts.items() if n > 1][:5]
    for destination in destinations:
        fake = github if "/" in destination else slack
        assert fake.order(destination) == expected[destination], f"out of order at {destination}"
    per_key = stack.query("SELECT count(*), count(DISTINCT key) FROM delivery_log")
    assert per_key == [(500, 500)], "one confirmation per key"
    reconciled = stack.query("SELECT count(*) FROM delivery_log WHERE how = 'reconciled'")[0][0]
    assert reconciled > 0, "the ambiguous failures were settled by asking the receivers"
    logs = "".join(stack.log(name) for name in ("relay-1", "relay-2", "relay-3"))
    assert "is not Keel's" in logs, "no planted key was read and reported"
    assert stack.query("SELECT count(*) FROM outbox WHERE status = 'dead'") == [(0,)]


def test_two_relays_with_clocks_five_minutes_off_either_way_deliver_once_in_order(
    stack: Stack, client: Client, fakes: tuple[FakeSlack, FakeGitHub]
) -> None:
    slack, github = fakes
    expected, emit = twenty_lines(stack, client, fakes)
    destinations = list(expected)

    # Beat runs on a third clock: relay passes carry no expiry stamped on beat's clock, so neither relay drops them.
    stack.beat()
    stack.worker("relay-fast", concurrency=2, queues="keel.outbox", **skewed(stack, "+5m"))
    stack.worker("relay-slow", concurrency=2, queues="keel.outbox", **skewed(stack, "-5m"))
    for batch in range(4):
        emit(batch)
    wait_until(
        "every message to be sent",
        lambda: stack.query("SELECT count(*) FROM outbox WHERE status = 'sent'") == [(400,)],
        180,
    )

    counts = slack.delivered_keys() + github.delivered_keys()
    assert len(counts) == 400 and set(counts.values()) == {1}, [k for k, n in counts.items() if n > 1][:5]
    for destination in destinations:
        fake = github if "/" in destination else slack
        assert fake.order(destination) == expected[destination], f"out of order at {destination}"
    assert stack.query("SELECT count(*), count(DISTINCT key) FROM delivery_log") == [(400, 400)]
    assert stack.query("SELECT count(*) FROM outbox WHERE status = 'dead'") == [(0,)]
    # Both relays did send: neither sat idle because of its clock.
    for name in ("relay-fast", "relay-slow"):
        assert re.search(r"outbox pass: .*sent=[1-9]", stack.log(name)), f"{name} sent nothing"
    late = stack.query(
        "SELECT count(*) FROM outbox WHERE sent_at > now() + interval '1 minute' OR sent_at < created_at"
        " OR updated_at > now() + interval '1 minute'"
    )
    assert late == [(0,)], "stored times are not the database's"
