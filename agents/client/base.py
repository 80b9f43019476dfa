"""What every part of the direct client builds on: its database, settings and publisher, finding an agent by id or
name (a deleted one too), reading its state, and running a command through the single ``transition()``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any, Self
from uuid import UUID

from sqlalchemy import select

from agents.client.checks import AgentRef, as_uuid, check_reason
from agents.core import transition as core
from agents.core.commands import Command, JobSpec, MessageSpec, check_count, check_text
from agents.core.errors import AgentNotFound, InvalidInput, quoted
from agents.core.outage import Outage
from agents.core.phases import Event
from agents.core.redaction import register_settings
from agents.jobs import handlers
from agents.runtime import tools
from agents.runtime.loop import pending_approval
from models.db import Database
from models.jobs_sql import Due, pending_jobs
from models.schemas import AgentRow, AgentState, DeletedAgent, JobView
from models.settings import Settings, check_imports
from models.sql import find_agent
from models.tables import deleted_agents

log = logging.getLogger("keel.client")

#: Sends jobs to the broker right after the submit that made them commits.
Publisher = Callable[[Sequence[Due]], None]


def submit_publisher(settings: Settings) -> Publisher | None:
    """The publisher of the ``keel.publishers`` entry point ``celery`` when ``KEEL_PUBLISH_AT_SUBMIT`` is on, else
    None (the dispatcher publishes every job). See docs/explanation/clients.md#publishing-at-submit."""
    if not settings.publish_at_submit:
        return None
    for point in entry_points(group="keel.publishers", name="celery"):
        made: Publisher | None = point.load()(settings)
        return made
    log.warning("no keel.publishers entry point is installed: submits leave their jobs to the dispatcher")
    return None


class ClientBase:
    """The direct client's state and plumbing; :class:`~agents.client.Client` adds the methods."""

    def __init__(self, db: Database, settings: Settings | None = None, *, publisher: Publisher | None = None) -> None:
        """Without a ``publisher`` (e.g. ``tasks.app.publisher()``) the dispatcher publishes a submit's jobs."""
        self.db = db
        self.settings = settings or Settings()
        self.publisher = publisher
        #: Says once when publishing starts failing (Redis away) and once when it works again.
        self.broker = Outage("broker", log)
        self._imported = False
        register_settings(self.settings)  # its secrets are masked in anything this process journals or logs

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> Self:
        """A client on ``settings``' database, publishing at submit as ``KEEL_PUBLISH_AT_SUBMIT`` says."""
        settings = settings or Settings()
        return cls(Database.from_settings(settings), settings, publisher=submit_publisher(settings))

    def close(self) -> None:
        close = getattr(self.publisher, "close", None)
        if close is not None:
            close()
        self.db.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- finding an agent -------------------------------------------------------------------------------------

    def _row(self, agent: AgentRef) -> AgentRow:
        agent_id = as_uuid(agent)
        if agent_id is None:
            check_text("agent", agent, limit=200)
        with core.store_errors():
            found = find_agent(self.db, agent_id=agent_id, name=None if agent_id is not None else str(agent))
        if found is None:
            gone = self._tombstones(agent)
            raise AgentNotFound(agent, deleted=gone[0] if gone else None)
        return found

    def _tombstones(self, agent: AgentRef) -> list[DeletedAgent]:
        """The deleted agents with this id, or this name (most recently deleted first)."""
        agent_id = as_uuid(agent)
        query = select(deleted_agents.c.agent_id.label("id"), *(c for c in deleted_agents.c if c.name != "agent_id"))
        if agent_id is not None:
            query = query.where(deleted_agents.c.agent_id == agent_id)
        else:
            query = query.where(deleted_agents.c.name == agent)
        query = query.order_by(deleted_agents.c.deleted_at.desc())
        with core.store_errors(), self.db.engine.connect() as conn:
            found = [DeletedAgent(**r._mapping) for r in conn.execute(query)]
            conn.commit()  # a read: ended as models.db.end_read does, keeping the connection's prepared statements
        return found

    def _chain_id(self, agent: AgentRef) -> UUID:
        """The agent whose journal to read: a live one by id or name, else a deleted one
        (docs/explanation/clients.md#archived-and-deleted-agents)."""
        try:
            return self._row(agent).id
        except AgentNotFound as exc:
            if exc.deleted is None:
                raise
            if as_uuid(agent) is None:
                gone = self._tombstones(agent)
                if len(gone) > 1:
                    ids = ", ".join(str(t.id) for t in gone)
                    raise InvalidInput(
                        f"{len(gone)} deleted agents were named {quoted(agent)}: give the id of the one you mean"
                        f" ({ids})"
                    ) from None
            return exc.deleted.id

    def _state(self, row: AgentRow, jobs: tuple[JobView, ...] | None = None) -> AgentState:
        """The state of ``row`` with ``jobs`` as its live jobs (None: read them now), and the call waiting for
        approval if there is one."""
        if jobs is None:
            with core.store_errors():
                jobs = tuple(JobView(**r) for r in pending_jobs(self.db, row.id))
        approval = None
        if row.phase == "waiting_approval":
            pending = pending_approval(self.db, row.id, row.request_id)
            approval = None if pending is None else pending.as_dict()
        return AgentState.of(row, jobs, approval)

    # --- running a command ------------------------------------------------------------------------------------

    def _command(
        self,
        agent: AgentRef,
        event: Event,
        expected_revision: int | None,
        actor: str,
        reason: str | None,
        *,
        jobs: tuple[JobSpec, ...] = (),
        extra: dict[str, Any] | None = None,
        effects: core.EffectsTxn | None = None,
        messages: tuple[MessageSpec, ...] = (),
    ) -> AgentState:
        if expected_revision is not None:
            check_count("expected_revision", expected_revision)
        check_reason(reason)
        details: dict[str, Any] = {} if reason is None else {"reason": reason}
        details.update(extra or {})
        # By id, the transition's own locking read finds the agent (and a deleted one's tombstone): no read before it.
        agent_id = as_uuid(agent)
        command = Command(
            agent_id=agent_id if agent_id is not None else self._row(agent).id,
            event=event,
            actor=actor,
            expected_revision=expected_revision,
            details=details,
            jobs=jobs,
            messages=messages,
        )
        try:
            done = core.transition(self.db, command, effects=effects, with_jobs=True)
        except AgentNotFound as exc:
            raise AgentNotFound(agent, deleted=exc.deleted) from None  # named as the caller named it
        return self._state(done.agent, done.pending_jobs)

    def _import_handlers(self) -> None:
        """Import what the workers import (``KEEL_IMPORTS``, the ``keel.handlers`` and ``keel.tools`` entry points),
        once, so input is checked against the operations and tools the workers run."""
        if self._imported:
            return
        check_imports(self.settings)
        handlers.load(())
        tools.load_entry_points()
        self._imported = True
