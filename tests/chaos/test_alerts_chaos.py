"""Two real beats evaluate the alerts; the leading one is SIGKILLed in the middle of an episode and comes back. The
fake Slack still receives the episode's "firing" post exactly once and its "resolved" post exactly once."""

from __future__ import annotations

import time
from collections.abc import Iterator

import psutil
import pytest

from agents.client import Client
from agents.core.commands import Command, MessageSpec
from agents.core.phases import Event
from agents.core.transition import transition
from tests.chaos.conftest import Stack, wait_until
from tests.support.fakes import FakeSlack
from tests.support.keys import scoped

pytestmark = pytest.mark.chaos

SLACK_TOKEN = "xoxb-chaos-alerts-token-000"
ALERTS = "CALERTS"
REFUSED = "CREFUSED"


@pytest.fixture
def slack() -> Iterator[FakeSlack]:
    fake = FakeSlack(token=SLACK_TOKEN, refusing={REFUSED})
    fake.start()
    yield fake
    fake.stop()


def alert_posts(slack: FakeSlack) -> dict[str, int]:
    return {key: n for key, n in slack.delivered_keys().items() if key.startswith("alert:")}


def leading_beat(stack: Stack) -> str:
    """The name (in ``stack``) of the beat whose term is the latest."""
    rows = stack.query("SELECT leader FROM beat_terms ORDER BY id DESC LIMIT 1")
    assert rows, "no beat has led yet"
    pid = int(str(rows[0][0]).rsplit(":", 1)[1])
    for name, proc in stack.procs.items():
        family = {proc.pid} | {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        if pid in family:
            return name
    raise AssertionError(f"the leader (pid {pid}) is none of this test's beats")


def test_two_beats_and_a_killed_leader_post_an_episode_once_and_resolve_it_once(
    stack: Stack, client: Client, slack: FakeSlack
) -> None:
    stack.env.update(
        {
            "KEEL_SLACK_TOKEN": SLACK_TOKEN,
            "KEEL_SLACK_API_URL": f"{slack.url}/api/",
            "KEEL_HTTP_TIMEOUT_SECONDS": "1",
            "KEEL_OUTBOX_LEASE_SECONDS": "3",
            "KEEL_OUTBOX_INTERVAL_SECONDS": "0.2",
            "KEEL_OUTBOX_BACKOFF_SECONDS": "0.2",
            "KEEL_OUTBOX_BACKOFF_MAX_SECONDS": "1",
            "KEEL_ALERT_SLACK_CHANNEL": ALERTS,
            "KEEL_ALERT_INTERVAL_SECONDS": "0.3",
            "KEEL_ALERT_RESOLVE_AFTER_SECONDS": "2",
            "KEEL_AUDIT_VERIFY_INTERVAL_SECONDS": "0",
            "KEEL_KPI_REPORT_AT": "off",
        }
    )
    stack.worker("relay", concurrency=2, queues="keel.outbox")
    stack.beat("beat-1")
    stack.beat("beat-2")

    # A real dead letter: a Slack message the receiver refuses for good.
    agent = client.create_agent("notifier")
    client.submit(agent.id, "req-1", None, operation="noop")
    spec = MessageSpec("slack", REFUSED, "m1", {"text": "hello"})
    transition(client.db, Command(agent.id, Event.PROGRESS, "worker", messages=(spec,)))
    letter = scoped(agent.id, "req-1:slack:m1")
    wait_until(
        "the message to go dead",
        lambda: stack.query("SELECT status FROM outbox WHERE key = %s", letter) == [("dead",)],
        60,
    )
    wait_until("the firing post", lambda: any(k.endswith(":firing") for k in alert_posts(slack)), 60)

    # Mid-episode: the leader dies without a word; the other beat takes over, the dead one comes back.
    killed = leading_beat(stack)
    terms_before = stack.query("SELECT count(*) FROM beat_terms")[0][0]
    stack.kill(killed)
    wait_until(
        "the other beat to lead", lambda: stack.query("SELECT count(*) FROM beat_terms")[0][0] > terms_before, 60
    )
    time.sleep(1.5)  # several evaluations by the new leader while the episode is still firing
    stack.beat(f"{killed}-again")

    slack.refusing.clear()
    client.retry_outbox(letter, actor="ops")  # the operator's fix: delivered, nothing is dead
    wait_until("the resolved post", lambda: any(k.endswith(":resolved") for k in alert_posts(slack)), 60)
    time.sleep(2)  # more evaluations by whichever beat leads: nothing more may be posted

    posts = alert_posts(slack)
    assert sorted(k.rsplit(":", 1)[1] for k in posts) == ["firing", "resolved"], posts
    assert set(posts.values()) == {1}, posts
    firing = next(k for k in posts if k.endswith(":firing"))
    assert firing.startswith("alert:dead_letters:")
    assert firing.removesuffix(":firing") + ":resolved" in posts
    episodes = stack.query("SELECT name, resolved_at IS NOT NULL FROM alert_episodes")
    assert episodes == [("dead_letters", True)]
    assert stack.query("SELECT count(*) FROM delivery_log WHERE starts_with(key, 'alert:')") == [(2,)]
