"""What an operator reads: a worker's and beat's logs at INFO show the jobs, not the relay's half-second
housekeeping; a database that goes away is one line when it goes and one when it is back, not a traceback a tick."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agents.client import Client
from agents.core.commands import Command, MessageSpec
from agents.core.phases import Event
from agents.core.transition import transition
from tests.chaos.conftest import Stack, wait_until
from tests.support.fakes import FakeSlack
from tests.support.keys import scoped
from tests.support.logs import log_lines
from tests.support.proxy import database_behind

pytestmark = pytest.mark.chaos

SLACK_TOKEN = "xoxb-quiet-logs-token-000"


def status(stack: Stack, key: str) -> str | None:
    rows = stack.query("SELECT status FROM jobs WHERE key = %s", key)
    return rows[0][0] if rows else None


@pytest.fixture
def slack() -> Iterator[FakeSlack]:
    fake = FakeSlack(token=SLACK_TOKEN).start()
    assert isinstance(fake, FakeSlack)
    yield fake
    fake.stop()


def test_the_relay_is_quiet_at_info_and_jobs_are_not(stack: Stack, client: Client, slack: FakeSlack) -> None:
    stack.env.update({"KEEL_SLACK_TOKEN": SLACK_TOKEN, "KEEL_SLACK_API_URL": f"{slack.url}/api/"})
    stack.worker("w1", concurrency=1)  # the only worker: it runs the jobs and every relay pass
    stack.beat()
    agent = client.create_agent("talker")
    client.submit(agent.id, "req-1", None, operation="noop")
    first = scoped(agent.id, "req-1:noop:1")
    wait_until("the job to succeed", lambda: status(stack, first) == "succeeded", 60)
    client.submit(agent.id, "req-2", None, operation="block")  # a request in flight, to emit a message from
    message = MessageSpec("slack", "C0Q", "m", {"text": "hi"})
    transition(client.db, Command(agent.id, Event.PROGRESS, "t", messages=(message,)))
    stack.release(scoped(agent.id, "req-2:block:1"))
    wait_until("the relay to deliver", lambda: sum(slack.delivered_keys().values()) == 1, 60)
    # The pass logs what it did after the receiver has the message: wait for that line, not only the delivery.
    wait_until("the relay to say what it did", lambda: "outbox pass:" in stack.log("w1"), 30)
    worker, beat = stack.log("w1"), stack.log("beat")
    at_info = [line["event"] for line in log_lines(worker) if line["level"] == "info"]
    assert f"Task keel.run_job[{first}] received" in at_info, "a job's lines stay at INFO"
    assert any(re.match(rf"Task keel\.run_job\[{re.escape(first)}\] succeeded", event) for event in at_info)
    assert "keel.relay_outbox[" not in worker, "the relay's received/succeeded lines are DEBUG"
    assert "Sending due task relay-outbox" not in beat, "beat's half-second sends are DEBUG"
    # Celery's lines about a job name it as fields too: a search by request finds them.
    celery = [line for line in log_lines(worker) if line["event"].startswith(f"Task keel.run_job[{first}]")]
    assert len(celery) == 2 and all((line["job_key"], line["request_id"]) == (first, "req-1") for line in celery)
    # Every line either process wrote is a JSON line (the log is a file): no banner, no raw warning (Celery's
    # SecurityWarning when it runs as root included).
    for text in (worker, beat):
        raw = [line for line in text.split("\n") if line.strip() and not line.startswith("{")]
        assert not raw, "\n".join(raw[:20])
        assert len(log_lines(text)) == len([line for line in text.split("\n") if line.strip()])


def test_a_database_outage_is_one_line_going_and_one_coming_back(stack: Stack, client: Client) -> None:
    proxy, through = database_behind(stack.db_url)
    try:
        # Worker and beat reach the database through the proxy; the test reaches it directly. The lease outlives
        # the outage, so the lease keeper of the step that runs through it only has to report it.
        stack.env.update({"KEEL_DATABASE_URL": through, "KEEL_JOB_LEASE_SECONDS": "8"})
        stack.worker("w1", concurrency=2)
        stack.beat()
        busy, other = client.create_agent("busy"), client.create_agent("other")
        client.submit(other.id, "req-warm", None, operation="count")
        wait_until(
            "the worker to be warm", lambda: status(stack, scoped(other.id, "req-warm:count:1")) == "succeeded", 60
        )
        client.submit(busy.id, "req-busy", None, operation="block")
        busy_key = scoped(busy.id, "req-busy:block:1")
        started = "SELECT 1 FROM executions WHERE key = %s AND phase = 'start'"
        wait_until("the step to run", lambda: stack.query(started, busy_key), 30)

        proxy.down()
        wait_until("beat to say the database is down", lambda: "database down" in stack.log("beat"), 30)
        wait_until("the worker to say so", lambda: "database down" in stack.log("w1"), 30)
        time.sleep(4)  # the outage goes on: beat ticks every 0.2 s and the lease keeper retries every second
        proxy.up()

        stack.release(busy_key)
        client.submit(other.id, "req-after", None, operation="count")
        wait_until("jobs to run again", lambda: status(stack, scoped(other.id, "req-after:count:1")) == "succeeded", 60)
        wait_until("the step to finish", lambda: client.get_state(busy.id).phase == "done", 60)
        wait_until("beat to say the database is back", lambda: "database back" in stack.log("beat"), 30)

        # A pool process says "back" the next time it reaches the database: one that gets no work after the outage
        # (prefork hands short tasks to whichever process is free first) has nothing to say yet.
        wait_until("the worker to see the outage end", lambda: "database back" in stack.log("w1"), 30)
        beat, worker = stack.log("beat"), stack.log("w1")
        assert "Traceback" not in beat and "Traceback" not in worker
        assert (beat.count("database down"), beat.count("database back")) == (1, 1), beat
        assert re.search(r"database down: OperationalError: .+; retrying with backoff", beat)
        assert 1 <= worker.count("database down") <= 2, "one line per worker process that saw it"
        assert 1 <= worker.count("database back") <= worker.count("database down"), "and one when it ended"
    finally:
        proxy.down()


def test_a_broker_outage_is_one_line_going_and_one_coming_back(
    stack: Stack, client: Client, own_redis: dict[str, Any], tmp_path: Path
) -> None:
    """Redis stopped under a beat and a worker: before, beat wrote a traceback and a "Couldn't apply scheduled task
    relay-outbox" error twice a second (116 tracebacks in 20 s), and a worker whose step finished meanwhile one for
    its failed publish. Celery's own reconnect lines (one per retry) stay."""
    stack.env["KEEL_BROKER_URL"] = own_redis["url"]  # a server of the test's own, to stop and start
    stack.worker("w1", concurrency=1)
    stack.beat()
    agent = client.create_agent("stepper")
    gate = tmp_path / "gate"
    client.submit(agent.id, "req-1", {"gate": str(gate), "steps": 3}, operation="gated")
    gated = scoped(agent.id, "req-1:gated:1")
    started = "SELECT 1 FROM executions WHERE key = %s AND phase = 'start'"
    wait_until("the first step to run", lambda: stack.query(started, gated), 60)

    own_redis["stop"]()
    wait_until("the worker to lose the broker", lambda: "Connection to broker lost" in stack.log("w1"), 30)
    gate.touch()  # the step finishes during the outage: publishing the next one fails, the dispatcher has it
    wait_until("the step to be recorded", lambda: status(stack, gated) == "succeeded", 30)
    wait_until("the worker to say the broker is down", lambda: "broker down" in stack.log("w1"), 30)
    wait_until("beat to say the broker is down", lambda: "broker down" in stack.log("beat"), 30)
    time.sleep(4)  # the outage goes on: beat would send the relay task every half second
    own_redis["start"]()

    wait_until("the request to finish", lambda: client.get_state(agent.id).phase == "done", 90)
    wait_until("beat to say the broker is back", lambda: "broker back" in stack.log("beat"), 30)
    wait_until("the worker to say so", lambda: "broker back" in stack.log("w1"), 30)
    beat, worker = stack.log("beat"), stack.log("w1")
    assert "Traceback" not in beat and "Traceback" not in worker
    assert "Couldn't apply scheduled task" not in beat
    assert (beat.count("broker down"), beat.count("broker back")) == (1, 1), beat
    assert re.search(r"broker down: \w+: .+; retrying with backoff", beat), beat
    assert (worker.count("broker down"), worker.count("broker back")) == (1, 1), worker
    assert "Error on restarting" not in worker and "CPendingDeprecationWarning" not in worker
    # Beat's whole log after its banner: its start, the leader, the outage's two lines, the dispatcher's passes,
    # and the leader's periodic audit verify (hourly; the first at once).
    lines = [line["event"] for line in log_lines(beat)]
    # A tick that tries the away broker can outlast the beat's lease (3 s here): the beat says so, once per
    # lapse, without a traceback (its lease is renewed between ticks, and nobody else is there to take over).
    quiet = (
        r"broker (down|back)|dispatched \d+ jobs|audit verify ok: \d+ events in \d+ agent chains verified"
        r"|this beat's lease lapsed between two ticks \([\d.]+s apart, lease [\d.]+s\); nobody took over"
    )
    others = [line for line in lines if not re.search(quiet, line)]
    assert len(others) <= 2, "\n".join(others)
