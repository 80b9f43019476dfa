"""The live event streams one API process holds open (the API's and the console's): how many each token may hold and the
process in all (:meth:`Streams.admit`, a 429 past either), and whether each token is still live, asked for all streams
together. Why idle streams cost one small query per interval:
docs/explanation/ingress-and-audit.md#open-streams-and-revoked-tokens."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from uuid import UUID

from agents.core.errors import StoreError
from agents.ingress.problems import TOO_MANY_STREAMS, Problem
from agents.ingress.tokens import ApiToken, live_token_ids
from models.db import Database

log = logging.getLogger("keel.ingress.streams")

#: Seconds at most between two checks that the tokens of open streams are still live: a revoked token's open streams
#: end within this time, or at their next event if that comes first.
TOKEN_RECHECK_INTERVAL = 5.0
#: The Retry-After of a refused stream (seconds): streams end when their clients leave, at no time known before.
RETRY_AFTER = 5


@dataclass
class _Holder:
    """One token's open streams: how many, and the event set once the token is found revoked."""

    count: int = 0
    ended: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _Round:
    """One question to the database: which of ``ids`` are live. Whoever joins it before it is asked shares it."""

    ids: set[UUID] = field(default_factory=set)
    answer: asyncio.Future[set[UUID]] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Hold:
    """One open stream's place. ``ended`` is set once its token is found revoked; :meth:`allowed` asks afresh."""

    def __init__(self, streams: Streams, token_id: UUID, ended: asyncio.Event) -> None:
        self.streams = streams
        self.token_id = token_id
        self.ended = ended

    async def allowed(self) -> bool:
        """Whether the token is live, asked of the database after this call began (together with every other
        stream asking meanwhile). Raises :class:`StoreError` if the database cannot be asked."""
        return self.token_id in await self.streams.ask({self.token_id})


class Streams:
    """The process's open streams and their tokens' liveness (docs/explanation/ingress-and-audit.md). ``await
    start()`` when the application starts, ``await stop()`` when it stops."""

    def __init__(
        self, db: Database, *, per_token: int, per_process: int, recheck: float = TOKEN_RECHECK_INTERVAL
    ) -> None:
        self.db = db
        self.per_token = per_token
        self.per_process = per_process
        self.recheck = recheck
        self.open = 0
        self._holders: dict[UUID, _Holder] = {}
        self._next: _Round | None = None
        self._asking: asyncio.Task[None] | None = None
        self._sweeping: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._sweeping is None:
            self._sweeping = asyncio.create_task(self._sweep(), name="keel-stream-tokens")

    async def stop(self) -> None:
        for task in (self._sweeping, self._asking):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._sweeping = self._asking = None

    @contextlib.contextmanager
    def admit(self, token: ApiToken) -> Iterator[Hold]:
        """A place for one stream of ``token`` for as long as the block runs; a 429 :class:`Problem` when the token
        or the process holds as many as it may."""
        holder = self._holders.get(token.id)
        if holder is not None and holder.count >= self.per_token:
            raise Problem(
                TOO_MANY_STREAMS,
                f"token {token.name!r} has {holder.count} live event streams open, as many as one token may"
                f" (KEEL_API_MAX_STREAMS_PER_TOKEN): close one, or retry after {RETRY_AFTER} s",
                headers={"Retry-After": str(RETRY_AFTER)},
            )
        if self.open >= self.per_process:
            raise Problem(
                TOO_MANY_STREAMS,
                f"this API process serves {self.open} live event streams, as many as it may"
                f" (KEEL_API_MAX_STREAMS_PER_PROCESS): retry after {RETRY_AFTER} s",
                headers={"Retry-After": str(RETRY_AFTER)},
            )
        if holder is None:
            holder = self._holders[token.id] = _Holder()
        holder.count += 1
        self.open += 1
        try:
            yield Hold(self, token.id, holder.ended)
        finally:
            self.open -= 1
            holder.count -= 1
            if holder.count == 0 and self._holders.get(token.id) is holder:
                del self._holders[token.id]

    async def ask(self, ids: set[UUID]) -> set[UUID]:
        """Which of ``ids`` are live, asked of the database after this call began: joins the next question (at most
        one is in flight; those who arrive meanwhile share the one after it). Ends the streams of those revoked."""
        if self._next is None:
            self._next = _Round()
        round_ = self._next
        round_.ids |= ids
        if self._asking is None or self._asking.done():
            self._asking = asyncio.create_task(self._ask_rounds(), name="keel-stream-token-check")
        return await asyncio.shield(round_.answer)

    async def _ask_rounds(self) -> None:
        while (round_ := self._next) is not None:
            self._next = None
            try:
                live = await asyncio.to_thread(live_token_ids, self.db, round_.ids)
            except Exception as exc:  # StoreError mostly; whoever asked decides what it means
                round_.answer.set_exception(exc)
                round_.answer.exception()  # retrieved: a round nobody waits for any more must not log it
                continue
            round_.answer.set_result(live)
            for token_id in round_.ids - live:
                holder = self._holders.get(token_id)
                if holder is not None:
                    holder.ended.set()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.recheck)
            if not self._holders:
                continue
            try:
                await self.ask(set(self._holders))
            except StoreError as exc:  # the streams go on; the next round asks again
                log.warning("could not check the tokens of open event streams: %s", exc)
            except Exception:
                log.exception("checking the tokens of open event streams failed")
