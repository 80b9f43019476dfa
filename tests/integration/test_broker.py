"""KEEL_BROKER_PREFIX: Keel's Celery keeps to its own keys and channels, so deployments (and test runs) share a
Redis database without seeing each other — and the tests delete only what they created."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

import tests.support.handlers  # noqa: F401 - registers the `count` handler these tests submit to
from agents.client import Client
from models.db import Database
from tasks.app import make_app, publisher
from tests.conftest import TEST_REDIS_DB
from tests.support.broker import Broker, own_prefix

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
            assert first is not None and first.headers["id"] == "theirs:count:1"
            first.ack()
            assert conn.default_channel.basic_get("keel.jobs") is None
        with ours.connection_for_read() as conn:
            mine = conn.default_channel.basic_get("keel.jobs")
            assert mine is not None and mine.headers["id"] == "ours:count:1"
            mine.ack()
        ours.close()
        theirs.close()
