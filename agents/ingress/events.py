"""Live journal events: each committed journal event of an agent, pushed as it commits (Server-Sent Events). A
``pg_notify`` after commit only wakes subscribers; the events are always read from the journal, so a lost or late
notification delays an event but never drops or repeats one. How:
docs/explanation/ingress-and-audit.md#live-journal-events."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Callable, Iterator
from types import TracebackType
from typing import Any, Protocol
from uuid import UUID

import psycopg
from fastapi.sse import ServerSentEvent

from agents.core import journal
from agents.core.errors import InvalidInput, StoreError, quoted
from agents.core.transition import store_errors
from models.clock import rfc3339
from models.db import Database
from models.schemas import JournalEvent
from models.sql import JOURNAL_CHANNEL

log = logging.getLogger("keel.ingress.events")

#: Seconds between two reads of the journal heads of every agent a stream follows, by one query for the whole
#: process: a stream whose agent moved past what it read is woken (a safety net: notifications are never the only
#: way an event reaches a stream).
SAFETY_INTERVAL = 15.0
#: Agent names the listener keeps, for the wake-ups of scoped subscribers of every agent (names never change).
NAMES_KEPT = 10_000
#: Seconds of silence after which the listener checks that its connection is still alive, and how long it gives the
#: check: a peer that vanished without closing the connection sends neither notifications nor an error.
PING_INTERVAL = 15.0
PING_TIMEOUT = 10.0
#: Reconnection backoff of the listener (seconds): doubling from the first to the last. A stream whose journal read
#: failed retries on the same schedule (or sooner, when the listener reconnects).
BACKOFF = (0.1, 10.0)
#: The listening connection's ``application_name`` (what ``pg_stat_activity`` shows for it).
APPLICATION_NAME = "keel-journal-listener"
#: The largest journal sequence number (a bigint).
MAX_SEQ = 2**63 - 1

_DIGITS = re.compile(r"[0-9]+")
#: Subscribe under this id to be woken by every agent's journal events (the console's list of agents).
ANY_AGENT = UUID(int=0)


class InvalidEventId(InvalidInput):
    """Last-Event-ID is not a journal sequence number of this agent."""

    def __init__(self, value: str, reason: str) -> None:
        self.value = value
        super().__init__(f"Last-Event-ID {quoted(value)} {reason}")


def parse_last_event_id(value: str | None, *, head: int | None = None) -> int:
    """The journal sequence number a client last received (``Last-Event-ID``): the stream resumes after it. Absent or
    empty: 0, the whole journal from its first event. With ``head`` (the agent's last journal seq) a value past it is
    refused too: a client cannot have seen an event that does not exist. Raises :class:`InvalidEventId`."""
    if value is None or value == "":
        return 0
    if not _DIGITS.fullmatch(value):
        raise InvalidEventId(value, "is not a journal sequence number (a non-negative integer)")
    seq = int(value)
    if seq > MAX_SEQ:
        raise InvalidEventId(value, f"is larger than any journal sequence number (at most {MAX_SEQ})")
    if head is not None and seq > head:
        raise InvalidEventId(value, f"is past the agent's last journal event ({head})")
    return seq


#: Whether an agent of this name is within a subscriber's reach (the token's scope: ``auth.sees_named``).
Sees = Callable[[str], bool]


class Subscription:
    """One stream's interest in one agent. Its wake-up is a single flag, not a queue: any number of notifications
    that arrive while the stream is busy coalesce into one re-read, so a slow client costs no memory."""

    def __init__(self, agent_id: UUID, seen: int, sees: Sees | None = None) -> None:
        self.agent_id = agent_id
        #: The last seq the stream read: a notification at or below it needs no re-read.
        self.seen = seen
        #: For a subscriber of every agent (:data:`ANY_AGENT`): only the agents it sees wake it.
        self.sees = sees
        self._wake = asyncio.Event()

    def wake(self, seq: int | None = None) -> None:
        if seq is None or seq > self.seen:
            self._wake.set()

    def clear(self) -> None:
        self._wake.clear()

    async def wait(self, timeout: float | None = None, *, or_: asyncio.Event | None = None) -> bool:
        """Until woken (or ``or_`` is set), or ``timeout`` seconds at most: whether it was woken."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                if or_ is None:
                    await self._wake.wait()
                else:
                    waits = {asyncio.ensure_future(self._wake.wait()), asyncio.ensure_future(or_.wait())}
                    try:
                        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        for pending in waits:
                            pending.cancel()
        return self._wake.is_set()


class JournalListener:
    """The process's one ``LISTEN`` connection, fanning journal notifications out to subscribers by agent id.

    ``await start()`` when the application starts (it returns at once; the connection is made in the background and
    remade whenever it is lost), ``await stop()`` when it stops: that closes the connection and ends every stream.
    Also an async context manager doing both."""

    def __init__(
        self,
        db: Database,
        *,
        safety_interval: float = SAFETY_INTERVAL,
        ping_interval: float = PING_INTERVAL,
        ping_timeout: float = PING_TIMEOUT,
        backoff: tuple[float, float] = BACKOFF,
        read_batch: int = journal.FOLLOW_BATCH,
        names: Callable[[list[UUID]], dict[UUID, str]] | None = None,
    ) -> None:
        self.db = db
        #: Agents' names by id (``Client.agent_names``), for subscribers of every agent that see only some.
        self.names = names
        self.safety_interval = safety_interval
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self.backoff = backoff
        self.read_batch = read_batch
        #: The PostgreSQL backend pid of the listening connection while it listens, else None.
        self.backend_pid: int | None = None
        self._subscribers: dict[UUID, set[Subscription]] = {}
        self._task: asyncio.Task[None] | None = None
        self._safety: asyncio.Task[None] | None = None
        self._known: dict[UUID, str] = {}
        self._unnamed: set[UUID] = set()
        self._naming: asyncio.Task[None] | None = None
        self._listening = asyncio.Event()
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    async def start(self) -> None:
        """Start listening (in the background)."""
        if self._task is not None:
            return
        self._stopped = False
        self._task = asyncio.create_task(self._run(), name="keel-journal-listener")
        self._safety = asyncio.create_task(self._reread_heads(), name="keel-journal-heads")

    async def stop(self) -> None:
        """Close the connection and end every stream (each returns after the events it already read)."""
        self._stopped = True
        tasks, self._task, self._safety, self._naming = (self._task, self._safety, self._naming), None, None, None
        for task in tasks:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._wake_all()

    def end_streams(self) -> None:
        """End every stream now, and any opened later, after the events it already read (the connection stays until
        :meth:`stop`): the server is shutting down, and a live stream never ends by itself."""
        self._stopped = True
        self._wake_all()

    async def __aenter__(self) -> JournalListener:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def wait_listening(self) -> int:
        """Until the connection listens; its backend pid."""
        while True:
            await self._listening.wait()
            if self.backend_pid is not None:
                return self.backend_pid

    @contextlib.contextmanager
    def subscribe(self, agent_id: UUID, after_seq: int = 0, *, sees: Sees | None = None) -> Iterator[Subscription]:
        """Wake-ups for ``agent_id``'s journal events past ``after_seq``, for as long as the block runs. Subscribe
        before reading the journal, so that nothing committing meanwhile goes unannounced. Under :data:`ANY_AGENT`
        with ``sees``: wake-ups for the events of the agents whose name it accepts, no others."""
        if self._task is None:
            raise RuntimeError("the journal listener is not running: await its start() when the application starts")
        if sees is not None and self.names is None:
            raise RuntimeError("the journal listener was given no names to scope its subscribers with")
        sub = Subscription(agent_id, after_seq, sees)
        self._subscribers.setdefault(agent_id, set()).add(sub)
        try:
            yield sub
        finally:
            subs = self._subscribers.get(agent_id)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subscribers[agent_id]

    def _wake_all(self) -> None:
        for subs in self._subscribers.values():
            for sub in subs:
                sub.wake()

    def _dispatch(self, payload: str) -> None:
        agent_text, _, seq_text = payload.partition(":")
        try:
            agent_id, seq = UUID(agent_text), int(seq_text)
        except ValueError:
            log.warning("ignoring a notification on %s that Keel did not send: %s", JOURNAL_CHANNEL, quoted(payload))
            return
        for sub in self._subscribers.get(agent_id, ()):
            sub.wake(seq)
        self._wake_any(agent_id)

    def _wake_any(self, agent_id: UUID) -> None:
        """Wake the subscribers of every agent that see ``agent_id``; its name is looked up once per process."""
        name = self._known.get(agent_id)
        scoped = False
        for sub in self._subscribers.get(ANY_AGENT, ()):
            if sub.sees is None:
                sub.wake()
            elif name is not None:
                if sub.sees(name):
                    sub.wake()
            else:
                scoped = True
        if scoped:
            self._unnamed.add(agent_id)
            if self._naming is None or self._naming.done():
                self._naming = asyncio.create_task(self._name_unnamed(), name="keel-journal-names")

    async def _name_unnamed(self) -> None:
        assert self.names is not None
        while self._unnamed:
            ids, self._unnamed = list(self._unnamed), set()
            try:
                names = await asyncio.to_thread(self.names, ids)
            except Exception as exc:  # no wake-up: better a list not redrawn than one woken by another tenant
                log.warning("live events: could not look up the names of %d agents: %s", len(ids), exc)
                continue
            for agent_id, name in names.items():
                if len(self._known) >= NAMES_KEPT:
                    del self._known[next(iter(self._known))]
                self._known[agent_id] = name
                self._wake_any(agent_id)

    async def _reread_heads(self) -> None:
        """Every safety interval, one read of the journal heads of the agents streams follow; wake those behind."""
        while True:
            await asyncio.sleep(self.safety_interval)
            followed = [agent_id for agent_id in self._subscribers if agent_id != ANY_AGENT]
            if not followed:
                continue
            try:
                heads = await asyncio.to_thread(_heads, self.db, followed)
            except StoreError as exc:
                log.warning("live events: could not read the journal heads of %d agents: %s", len(followed), exc)
                continue
            for agent_id in followed:
                for sub in list(self._subscribers.get(agent_id, ())):
                    sub.wake(heads.get(agent_id))  # no head: deleted since; its stream reads to the delete event

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                # The direct URL: behind a transaction pooler a LISTEN would stay on whichever server connection
                # ran it, and its notifications would never reach this client.
                async with await psycopg.AsyncConnection.connect(
                    self.db.direct_libpq_url,
                    autocommit=True,
                    application_name=APPLICATION_NAME,
                    **self.db.keepalives.options(self.db.direct_url),
                ) as conn:
                    await conn.execute(f"LISTEN {JOURNAL_CHANNEL}")
                    failures = 0
                    self.backend_pid = conn.info.backend_pid
                    self._listening.set()
                    log.info("listening for journal events (backend pid %d)", self.backend_pid)
                    # Whatever committed while nobody listened is in the journal: every stream re-reads it.
                    self._wake_all()
                    await self._receive(conn)
            except (psycopg.Error, OSError, TimeoutError) as exc:
                failures += 1
                text = str(exc).strip()
                reason = text.splitlines()[0] if text else type(exc).__name__
                log.warning(
                    "journal listener: connection lost or refused (%s); reconnecting in %.1fs",
                    reason,
                    _delay(self.backoff, failures),
                )
            except Exception:  # a bug must not end live events for the whole process: log it, reconnect
                failures += 1
                log.exception("journal listener failed; reconnecting in %.1fs", _delay(self.backoff, failures))
            finally:
                self._listening.clear()
                self.backend_pid = None
            await asyncio.sleep(_delay(self.backoff, failures))

    async def _receive(self, conn: psycopg.AsyncConnection[Any]) -> None:
        while True:
            async for notify in conn.notifies(timeout=self.ping_interval):
                self._dispatch(notify.payload)
            async with asyncio.timeout(self.ping_timeout):
                await conn.execute("SELECT 1")


def _delay(backoff: tuple[float, float], failures: int) -> float:
    first, last = backoff
    return float(min(last, first * 2 ** min(max(0, failures - 1), 30)))


def _heads(db: Database, agent_ids: list[UUID]) -> dict[UUID, int]:
    with store_errors():
        return journal.journal_heads(db, agent_ids)


def _ends_chain(event: JournalEvent) -> bool:
    # A deleted agent's chain ends with its delete event: nothing can follow it.
    return event.kind == "operator" and event.event == "delete"


async def _read(listener: JournalListener, agent_id: UUID, after_seq: int) -> list[JournalEvent]:
    def read() -> list[JournalEvent]:
        with store_errors():
            return journal.agent_events_after(listener.db, agent_id, after_seq, limit=listener.read_batch)

    return await asyncio.to_thread(read)


class Guard(Protocol):
    """What a stream asks whether it may go on (its token's liveness: :class:`agents.ingress.streams.Hold`)."""

    #: Set once the stream must end (its token was found revoked).
    ended: asyncio.Event

    async def allowed(self) -> bool:
        """Whether the stream may go on, asked now; may raise :class:`StoreError`."""
        ...


async def agent_events(
    listener: JournalListener, agent_id: UUID, after_seq: int = 0, *, guard: Guard | None = None
) -> AsyncIterator[JournalEvent]:
    """Every journal event of ``agent_id`` with ``seq > after_seq``, in seq order, each once: those already committed,
    then each as it commits. Ends when the listener stops, after the agent's delete event, or once ``guard`` ends it or
    refuses (asked after each read that found events, so no event committed after a token's revocation is yielded). A
    failed read is retried, and the stream goes on from the last event it yielded
    (docs/explanation/ingress-and-audit.md#live-journal-events)."""
    ended = None if guard is None else guard.ended
    with listener.subscribe(agent_id, after_seq) as sub:
        failures = 0
        while not listener.stopped and not (ended is not None and ended.is_set()):
            sub.clear()  # before the read: a wake-up that arrives during it asks for another
            try:
                batch = await _read(listener, agent_id, sub.seen)
                # After the read: what it found committed before this check, hence before any revocation it missed.
                if batch and guard is not None and not await guard.allowed():
                    return
            except StoreError as exc:
                failures += 1
                # Once per outage and stream: a thousand streams retrying must not be a thousand lines a second.
                level = logging.WARNING if failures == 1 else logging.DEBUG
                log.log(level, "live events of agent %s: journal read failed (%s); retrying", agent_id, exc)
                await sub.wait(min(_delay(listener.backoff, failures), listener.safety_interval), or_=ended)
                continue
            failures = 0
            for event in batch:
                sub.seen = event.seq
                yield event
                if _ends_chain(event):
                    return
            if len(batch) < listener.read_batch:
                await sub.wait(or_=ended)


def event_data(event: JournalEvent) -> dict[str, Any]:
    """The ``data`` of an event's SSE message: the change it records (``phase``: the phase it moved to), and the
    rest of the journal event (``seq``, ``kind``, ``to_phase``, ``hash`` …), so a client rebuilds it whole."""
    return event.model_dump(mode="json") | {"phase": event.to_phase, "at": rfc3339(event.at)}


def to_sse(event: JournalEvent) -> ServerSentEvent:
    """One journal event as a Server-Sent Event: id = its journal seq, event = its kind (``transition``,
    ``rejected``, ``suppressed``, ``created``, ``operator``), data = :func:`event_data` as JSON."""
    return ServerSentEvent(id=str(event.seq), event=event.kind, data=event_data(event))


async def sse_events(
    listener: JournalListener, agent_id: UUID, after_seq: int = 0, *, guard: Guard | None = None
) -> AsyncIterator[ServerSentEvent]:
    """:func:`agent_events` as Server-Sent Events, for a FastAPI path operation with
    ``response_class=EventSourceResponse`` to yield from (FastAPI adds keep-alive pings while it is quiet)."""
    async for event in agent_events(listener, agent_id, after_seq, guard=guard):
        yield to_sse(event)
