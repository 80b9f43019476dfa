"""KEEL_BROKER_PREFIX: Keel's Celery keeps to its own keys and channels, so deployments (and test runs) share a
Redis database without seeing each other — and the tests delete only what they created."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

import tests.support.handlers  # noqa: F401 - registers the `count` handler these tests submit to
from agents.client import Client, submit_publisher
from models.db import Database
from models.embedded import free_port, redis_status
from models.settings import Settings
from tasks.app import make_app, publisher
from tests.conftest import TEST_REDIS_DB
from tests.support.broker import Broker, own_prefix
from tests.support.keys import scoped

pytestmark = pytest.mark.integration


@pytest.fixture
def developer_keys(redis_server_url: str) -> Iterator[dict[int, str]]:
    """A key of "someone else's" in every database of the test server, outside any test prefix."""
    name = f"developer:{uuid.uuid4().hex[:12]}"
    clients = {n: redis.Redis.from_url(f"{redis_server_url}/{n}") for n in range(16)}
    try:
        for number, client in clients.items():
            client.set(name, f"precious {number}")
        yield {number: name for number in clients}
    finally:
        for client in clients.values():
            client.delete(name)  # exactly the keys this test made
            client.close()


def _values(redis_server_url: str, keys: dict[int, str]) -> dict[int, bytes | None]:
    found = {}
    for number, name in keys.items():
        with redis.Redis.from_url(f"{redis_server_url}/{number}") as client:
            found[number] = client.get(name)
    return found


def _app(owned: Broker, db: Database) -> Celery:
    return make_app(owned.settings(database_url=db.url))


def test_a_test_broker_lifecycle_deletes_only_its_own_keys(
    redis_server_url: str, developer_keys: dict[int, str], db: Database, client: Client
) -> None:
    """What the ``broker`` fixture does around every test: the keys Keel made under the test's prefix (queues,
    bindings, a control broadcast) are gone afterwards; every other key, in database 0 or 1-15, is still there —
    including one written while the test ran (the old fixture FLUSHDB'd the whole database at the end)."""
    url = f"{redis_server_url}/{TEST_REDIS_DB}"
    expected = {number: f"precious {number}".encode() for number in developer_keys}
    late = f"developer-late:{uuid.uuid4().hex[:12]}"
    try:
        with own_prefix(url) as owned:
            celery = _app(owned, db)
            agent = client.create_agent("a")
            Client(db, publisher=publisher(celery)).submit(agent.id, "req-1", None, operation="count")
            celery.control.revoke("nothing:such:1")  # a broadcast on the prefixed pidbox channel
            celery.close()
            made = owned.keys()
            assert owned.key("keel.jobs") in made and owned.key("_kombu.binding.keel.jobs") in made, made
            with redis.Redis.from_url(url) as someone:
                someone.set(late, "written during the test")
        assert owned.keys() == [], "the test's keys outlived it"
        assert _values(redis_server_url, developer_keys) == expected, "a key outside the test's prefix was lost"
        with redis.Redis.from_url(url) as someone:
            assert someone.get(late) == b"written during the test"
    finally:
        with redis.Redis.from_url(url) as someone:
            someone.delete(late)


def test_two_prefixes_on_one_database_see_neither_messages_nor_broadcasts(
    broker: Broker, db: Database, client: Client
) -> None:
    """Two deployments on the same Redis database: a job published by one is not in the other's queue, and a
    revoke broadcast by one is not heard by the other's workers. (Each side's own message comes after the other's,
    so had the other's leaked through, it would have been received first.)"""
    with own_prefix(broker.url) as neighbour:
        ours, theirs = _app(broker, db), _app(neighbour, db)
        heard: list[dict[str, Any]] = []
        with theirs.connection_for_write() as conn:
            node = theirs.control.mailbox.Node("w@neighbour", channel=conn.default_channel)
            node.listen(callback=lambda body, message: heard.append(body))
            # kombu subscribes once it starts draining: probe until the neighbour hears its own broadcasts.
            while not heard:
                theirs.control.revoke("probe")
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.1)
            ours.control.revoke("ours:job:1")
            theirs.control.revoke("theirs:job:1")
            while heard[-1]["arguments"]["task_id"] != "theirs:job:1":
                conn.drain_events(timeout=10)
            assert {body["arguments"]["task_id"] for body in heard} == {"probe", "theirs:job:1"}

        agent = client.create_agent("a")
        Client(db, publisher=publisher(ours)).submit(agent.id, "ours", None, operation="count")
        other = client.create_agent("b")
        Client(db, publisher=publisher(theirs)).submit(other.id, "theirs", None, operation="count")
        with theirs.connection_for_read() as conn:
            first = conn.default_channel.basic_get("keel.jobs")
            assert first is not None and first.headers["id"] == scoped(other.id, "theirs:count:1")
            first.ack()
            assert conn.default_channel.basic_get("keel.jobs") is None
        with ours.connection_for_read() as conn:
            mine = conn.default_channel.basic_get("keel.jobs")
            assert mine is not None and mine.headers["id"] == scoped(agent.id, "ours:count:1")
            mine.ack()
        ours.close()
        theirs.close()


def _queued(broker: Broker, queue: str = "keel.jobs") -> list[str]:
    """The task ids of the messages waiting in ``queue`` (read, not taken)."""
    with broker.redis() as plain:
        return [json.loads(raw)["headers"]["id"] for raw in plain.lrange(broker.key(queue), 0, -1)]


def _status(db: Database, key: str) -> str:
    with db.autocommit() as cur:
        row = cur.execute("SELECT status FROM jobs WHERE key = %s", (key,)).fetchone()
    assert row is not None, key
    return str(row[0])


def test_a_client_from_settings_publishes_a_submits_first_job_at_once(
    broker: Broker, db: Database, client: Client
) -> None:
    """KEEL_PUBLISH_AT_SUBMIT (on by default): the first job is on the broker, under its key, when submit returns —
    no dispatcher pass in between."""
    agent = client.create_agent("at-once")
    with Client.from_settings(broker.settings(database_url=db.url)) as producer:
        assert producer.publisher is not None
        producer.submit(agent.id, "req-at-once", None, operation="count")
    assert _queued(broker) == [scoped(agent.id, "req-at-once:count:1")]
    assert _status(db, scoped(agent.id, "req-at-once:count:1")) == "enqueued"


def test_with_publish_at_submit_off_a_submit_leaves_its_job_to_the_dispatcher(
    broker: Broker, db: Database, client: Client
) -> None:
    agent = client.create_agent("later")
    with Client.from_settings(broker.settings(database_url=db.url, publish_at_submit=False)) as producer:
        assert producer.publisher is None
        producer.submit(agent.id, "req-later", None, operation="count")
    assert _queued(broker) == []
    assert _status(db, scoped(agent.id, "req-later:count:1")) == "pending"


def test_a_submit_while_the_broker_is_unreachable_is_kept_and_left_to_the_dispatcher(
    db: Database, client: Client
) -> None:
    """Publishing at submit is bounded: with nothing listening on the broker's port, the submit still commits and
    its job goes back to pending, for the dispatcher's next pass."""
    agent = client.create_agent("no-broker")
    settings = Settings(database_url=db.url, broker_url=f"redis://127.0.0.1:{free_port()}/0")
    with Client.from_settings(settings) as producer:
        state = producer.submit(agent.id, "req-no-broker", None, operation="count")
    assert state.phase == "planning"
    assert _status(db, scoped(agent.id, "req-no-broker:count:1")) == "pending"


def test_the_embedded_default_publishes_at_submit_only_when_its_redis_runs(tmp_path: Path, db: Database) -> None:
    """With no KEEL_BROKER_URL and the home's Redis not started, a submit does not start a server: the beat does,
    and its dispatcher publishes the job."""
    settings = Settings(database_url=db.url, home=tmp_path)
    assert submit_publisher(settings) is None
    assert not redis_status(tmp_path).running
