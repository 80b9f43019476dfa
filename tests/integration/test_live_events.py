"""Live journal events: each committed journal event pushed as it commits, announced from inside its transaction
(nothing that rolled back), read from the journal (no gaps, no repeats), resumable after any seq, surviving the loss
of the listener's connection."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, TypeVar
from uuid import UUID

import psycopg
import pytest

from agents.client import Client
from agents.core import journal
from agents.core.commands import Command
from agents.core.errors import IllegalTransition
from agents.core.phases import Event
from agents.core.transition import transition
from agents.ingress.events import (
    JournalListener,
    agent_events,
    parse_last_event_id,
    sse_events,
)
from models.clock import rfc3339
from models.db import Database
from models.schemas import JournalEvent
from models.sql import JOURNAL_CHANNEL, lock_agent_txn
from models.urls import libpq_url
from tests.support.audit import TEST_KEYS

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

T = TypeVar("T")
#: Guards against a hang only: every event a test waits for is already committed or about to be.
HANG = 60.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def listener(db: Database) -> AsyncIterator[JournalListener]:
    # The safety re-read is pushed out of reach: an event that arrives did so because it was announced (or because
    # the listener reconnected), not because a timer happened to fire.
    async with JournalListener(db, safety_interval=3600, backoff=(0.05, 0.5)) as running:
        yield running


async def _next(stream: AsyncIterator[T]) -> T:
    async with asyncio.timeout(HANG):
        return await anext(stream)


async def _take(stream: AsyncIterator[T], count: int) -> list[T]:
    return [await _next(stream) for _ in range(count)]


def _progress(db: Database, agent_id: UUID, times: int = 1) -> None:
    for _ in range(times):
        transition(db, Command(agent_id, Event.PROGRESS, "worker"))


def _agent(client: Client, name: str = "watched") -> UUID:
    """An agent with a request in flight (journal: created, submit)."""
    agent = client.create_agent(name)
    client.submit(agent.id, f"{name}-req", {"prompt": "hi"})
    return agent.id


def _seqs(events: list[JournalEvent]) -> list[int]:
    return [e.seq for e in events]


async def test_a_subscriber_gets_the_journal_then_each_committed_event_once_in_order(
    client: Client, listener: JournalListener
) -> None:
    agent_id = _agent(client)
    async with contextlib.aclosing(agent_events(listener, agent_id)) as stream:
        history = await _take(stream, 2)
        assert [(e.seq, e.kind, e.event) for e in history] == [(1, "created", "create"), (2, "transition", "submit")]
        for seq in range(3, 8):
            _progress(client.db, agent_id)
            event = await _next(stream)
            assert (event.seq, event.kind, event.event, event.revision) == (seq, "transition", "progress", seq - 1)
        _progress(client.db, agent_id, 3)  # several commits before the stream looks again
        assert _seqs(await _take(stream, 3)) == [8, 9, 10]
        # A rejected command is journaled (committed) too: the stream carries it.
        with pytest.raises(IllegalTransition):
            client.approve(agent_id, expected_revision=9, actor="bob")
        rejected = await _next(stream)
        assert (rejected.seq, rejected.kind, rejected.event, rejected.actor) == (11, "rejected", "approve", "bob")
    assert _seqs(client.journal(agent_id=agent_id)) == list(range(1, 12))


async def test_events_of_other_agents_are_not_streamed(client: Client, listener: JournalListener) -> None:
    watched, other = _agent(client, "watched"), _agent(client, "other")
    async with contextlib.aclosing(agent_events(listener, watched, after_seq=2)) as stream:
        _progress(client.db, other, 3)
        _progress(client.db, watched)
        event = await _next(stream)
        assert (event.agent_id, event.seq) == (watched, 3)


class Phantom(Exception):
    """Raised to roll a transaction back after its journal event (and its announcement) were written."""


@contextlib.contextmanager
def _journal_listener(db_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        conn.execute(f"LISTEN {JOURNAL_CHANNEL}")
        yield conn


async def test_an_append_that_rolls_back_announces_nothing_and_streams_nothing(
    client: Client, listener: JournalListener, db_url: str
) -> None:
    agent_id = _agent(client)
    async with contextlib.aclosing(agent_events(listener, agent_id)) as stream:
        assert _seqs(await _take(stream, 2)) == [1, 2]
        with _journal_listener(db_url) as heard:
            # The real append path (the statement that inserts the event and sends its notification), then a
            # failure before the commit.
            with pytest.raises(Phantom), client.db.transaction() as cur:
                locked = lock_agent_txn(cur, agent_id)
                assert locked is not None
                journal.append_side_event_txn(
                    cur, locked.row, keys=TEST_KEYS, kind="suppressed", event="phantom", actor="ghost",
                    decision="phantom", details={}, at=locked.at,
                )  # fmt: skip
                raise Phantom
            _progress(client.db, agent_id, 2)
            payloads = [n.payload for n in heard.notifies(timeout=HANG, stop_after=2)]
        assert payloads == [f"{agent_id}:3", f"{agent_id}:4"]
        streamed = await _take(stream, 2)
        assert [(e.seq, e.event, e.actor) for e in streamed] == [(3, "progress", "worker"), (4, "progress", "worker")]
    assert "phantom" not in [e.event for e in client.journal(agent_id=agent_id)]


async def test_reconnecting_with_last_event_id_gets_exactly_the_missed_events_then_live_ones(
    client: Client, listener: JournalListener
) -> None:
    agent_id = _agent(client)
    async with contextlib.aclosing(sse_events(listener, agent_id)) as first:
        seen = await _take(first, 2)
    last_event_id = seen[-1].id  # the client drops the connection here
    assert last_event_id == "2"
    _progress(client.db, agent_id, 10)
    after = parse_last_event_id(last_event_id, head=client.journal(agent_id=agent_id)[-1].seq)
    async with contextlib.aclosing(sse_events(listener, agent_id, after)) as resumed:
        missed = await _take(resumed, 10)
        assert [m.id for m in missed] == [str(seq) for seq in range(3, 13)]
        _progress(client.db, agent_id)
        live = await _next(resumed)
        assert live.id == "13"
        _progress(client.db, agent_id)
        assert (await _next(resumed)).id == "14"  # nothing repeated in between


async def test_an_sse_message_carries_the_change_and_its_journal_seq(client: Client, listener: JournalListener) -> None:
    agent_id = _agent(client)
    async with contextlib.aclosing(sse_events(listener, agent_id, after_seq=1)) as stream:
        message = await _next(stream)
    submit = client.journal(agent_id=agent_id)[1]
    assert (message.id, message.event) == ("2", "transition")
    # The whole journal event (so a client can rebuild it, hash chain included), plus `phase` for the new phase.
    assert message.data == {
        **submit.model_dump(mode="json"),
        "phase": "planning",
        "at": rfc3339(submit.at),
    }
    assert (message.data["revision"], message.data["from_phase"], message.data["event"]) == (1, "idle", "submit")


async def test_a_burst_of_commits_while_the_client_is_slow_still_arrives_whole(client: Client, db: Database) -> None:
    agent_id = _agent(client)
    # Small pages: the burst is read back in several journal reads, however the notifications coalesced.
    async with JournalListener(db, safety_interval=3600, read_batch=7) as small_pages:
        async with contextlib.aclosing(agent_events(small_pages, agent_id)) as stream:
            assert _seqs(await _take(stream, 2)) == [1, 2]
            _progress(client.db, agent_id, 60)  # sixty notifications while the stream is not being read
            got = await _take(stream, 60)
            assert _seqs(got) == list(range(3, 63))
            _progress(client.db, agent_id)
            assert (await _next(stream)).seq == 63


def _wait_gone(raw: psycopg.Connection[Any], pid: int) -> None:
    deadline = time.monotonic() + HANG
    while raw.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone() is not None:
        assert time.monotonic() < deadline, f"backend {pid} did not exit"
        time.sleep(0.02)


async def test_the_stream_goes_on_when_the_listeners_connection_is_killed(
    client: Client, listener: JournalListener, raw: psycopg.Connection[Any]
) -> None:
    agent_id = _agent(client)
    old_pid = await listener.wait_listening()
    async with contextlib.aclosing(agent_events(listener, agent_id)) as stream:
        assert _seqs(await _take(stream, 2)) == [1, 2]
        _progress(client.db, agent_id)
        assert (await _next(stream)).seq == 3  # announced: the stream now waits for the next wake-up
        raw.execute("SELECT pg_terminate_backend(%s)", (old_pid,))
        _wait_gone(raw, old_pid)
        # Committed while nobody listens: their notifications reach no one. They arrive because the listener
        # reconnects and every stream re-reads the journal.
        _progress(client.db, agent_id, 3)
        assert _seqs(await _take(stream, 3)) == [4, 5, 6]
        assert listener.backend_pid not in (None, old_pid)
        _progress(client.db, agent_id)  # announced on the new connection
        assert (await _next(stream)).seq == 7


async def test_a_journal_read_that_fails_does_not_end_the_stream(
    client: Client, db_url: str, raw: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    agent_id = _agent(client)
    reader = Database(db_url, pool_size=2, statement_timeout_ms=200)  # a read blocked by the lock below fails fast
    try:
        async with JournalListener(reader, safety_interval=3600, backoff=(0.05, 0.2)) as listener:
            old_pid = await listener.wait_listening()
            async with contextlib.aclosing(agent_events(listener, agent_id)) as stream:
                assert _seqs(await _take(stream, 2)) == [1, 2]
                with psycopg.connect(libpq_url(db_url)) as locker:
                    locker.execute("LOCK TABLE audit.journal IN ACCESS EXCLUSIVE MODE")  # the journal unreadable
                    raw.execute("SELECT pg_terminate_backend(%s)", (old_pid,))  # the reconnect wakes the stream
                    pending = asyncio.ensure_future(_next(stream))
                    async with asyncio.timeout(HANG):
                        while "journal read failed" not in caplog.text:
                            await asyncio.sleep(0.02)
                    assert not pending.done()
                    locker.rollback()
                _progress(client.db, agent_id)
                assert (await pending).seq == 3
    finally:
        reader.dispose()


async def test_a_deleted_agents_stream_ends_with_its_delete_event(client: Client, listener: JournalListener) -> None:
    agent = client.create_agent("doomed")
    async with contextlib.aclosing(agent_events(listener, agent.id)) as stream:
        assert (await _next(stream)).kind == "created"
        client.archive(agent.id, actor="ops")
        client.delete_agent(agent.id, actor="ops")
        async with asyncio.timeout(HANG):
            rest = [e async for e in stream]
    assert [(e.kind, e.event) for e in rest] == [("operator", "archive"), ("operator", "delete")]


async def test_stopping_the_listener_ends_every_stream(client: Client, db: Database) -> None:
    agent_id = _agent(client)
    listener = JournalListener(db, safety_interval=3600)
    await listener.start()
    async with contextlib.aclosing(agent_events(listener, agent_id)) as stream:
        assert _seqs(await _take(stream, 2)) == [1, 2]
        waiting = asyncio.ensure_future(_next(stream))
        await listener.stop()
        with pytest.raises(StopAsyncIteration):
            await waiting
    with pytest.raises(RuntimeError, match="not running"), listener.subscribe(agent_id):
        pass
