"""The direct client's journal reads: all at once, a page at a time, or followed as events commit."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from uuid import UUID

from agents.client.base import ClientBase
from agents.client.checks import AgentRef
from agents.client.cursors import decode_journal_cursor, encode_journal_cursor
from agents.core import journal as journal_mod
from agents.core import transition as core
from agents.core.commands import MAX_BIGINT, check_count, check_text
from models.schemas import JournalEvent, JournalEventPage


class JournalMixin(ClientBase):
    def journal_agent(self, agent: AgentRef) -> UUID:
        """The id of the agent whose journal ``agent`` names: a live one, or a deleted one."""
        return self._chain_id(agent)

    def journal(
        self, *, agent_id: AgentRef | None = None, request_id: str | None = None, limit: int | None = None
    ) -> list[JournalEvent]:
        """Journal events, oldest first, for an agent and/or a request."""
        if limit is not None:
            check_count("limit", limit, low=1)
        if request_id is not None:
            check_text("request_id", request_id, limit=200)
        resolved = None if agent_id is None else self._chain_id(agent_id)
        with core.store_errors():
            return journal_mod.events(self.db, agent_id=resolved, request_id=request_id, limit=limit)

    def journal_page(
        self,
        *,
        agent_id: AgentRef | None = None,
        request_id: str | None = None,
        limit: int = 50,
        after: str | None = None,
    ) -> JournalEventPage:
        """Journal events newest first, at most ``limit``, for an agent and/or a request; ``after`` is the previous
        page's ``next`` (with the same filters). Keyset-paginated: a page costs its rows."""
        check_count("limit", limit, low=1, high=MAX_BIGINT - 1)  # one more is read to tell whether more follow
        if request_id is not None:
            check_text("request_id", request_id, limit=200)
        by = "seq" if agent_id is not None else "id"
        before = None if after is None else decode_journal_cursor(after, by)
        resolved = None if agent_id is None else self._chain_id(agent_id)
        with core.store_errors():
            rows = journal_mod.latest_events(
                self.db, agent_id=resolved, request_id=request_id, limit=limit + 1, before=before
            )
        if len(rows) <= limit:
            return JournalEventPage(events=tuple(rows))
        rows = rows[:limit]
        last = rows[-1].seq if by == "seq" else rows[-1].id
        return JournalEventPage(events=tuple(rows), next=encode_journal_cursor(by, last))

    def follow_journal(
        self, *, agent_id: AgentRef | None = None, request_id: str | None = None, poll_seconds: float = 0.5
    ) -> Iterator[JournalEvent]:
        """Every journal event of an agent and/or a request, oldest first, then each new one as it commits, none
        skipped or repeated, until the caller stops. An unknown agent raises :class:`AgentNotFound` at once."""
        resolved = None if agent_id is None else self._chain_id(agent_id)
        if request_id is not None:
            check_text("request_id", request_id, limit=200)
        journal_mod.request_scope(resolved, request_id)

        def follow() -> Iterator[JournalEvent]:
            seen: dict[UUID, int] = {}
            while True:
                batch = self.journal_after(seen, agent_id=resolved, request_id=request_id)
                for event in batch:
                    seen[event.agent_id] = event.seq
                    if request_id is None or event.request_id == request_id:
                        yield event
                if len(batch) < journal_mod.FOLLOW_BATCH:
                    time.sleep(poll_seconds)

        return follow()

    def journal_after(
        self, seen: Mapping[UUID, int], *, agent_id: AgentRef | None = None, request_id: str | None = None
    ) -> list[JournalEvent]:
        """One read of :meth:`follow_journal`: the events committed past ``seen`` (agent id -> last seq read)."""
        resolved = None if agent_id is None else self._chain_id(agent_id)
        with core.store_errors():
            return journal_mod.events_after(self.db, seen, agent_id=resolved, request_id=request_id)
