"""The producer API: create agents, submit requests, approve, reject, cancel, read state and the journal."""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from importlib.metadata import entry_points
from typing import Any
from urllib.parse import quote, unquote
from uuid import UUID

import httpx
from httpx_sse import connect_sse
from pydantic import ValidationError
from sqlalchemy import select, tuple_

from agents.core import journal as journal_mod
from agents.core import transition as core
from agents.core.commands import (
    MAX_ACTOR_CHARS,
    MAX_BIGINT,
    MAX_REASON_CHARS,
    Command,
    JobSpec,
    MessageSpec,
    check_count,
    check_json_text,
    check_text,
)
from agents.core.errors import (
    AgentArchived,
    AgentBusy,
    AgentExists,
    AgentInUse,
    AgentNotFound,
    BadCursor,
    HardDeadlinePassed,
    IllegalTransition,
    InvalidDeadlines,
    InvalidInput,
    InvalidJob,
    KeelError,
    MessageNotDead,
    MessageNotFound,
    Rejected,
    RequestConflict,
    RequestNotFound,
    StaleRevision,
    StoreError,
    UnknownOperation,
    quoted,
)
from agents.core.json_input import check_depth
from agents.core.keys import check_request_id, split_key
from agents.core.outage import Outage
from agents.core.phases import Event, Phase
from agents.core.redaction import register_settings
from agents.jobs import handlers
from agents.outbox.relay import retry_dead
from agents.runtime import tools
from agents.runtime.loop import approval_jobs, cancel_round_txn, pending_approval, rejection_jobs
from models.approvals_sql import WaitingCall, waiting_calls
from models.db import Database
from models.jobs_sql import Due, pending_jobs, request_jobs, unpublish
from models.outbox_sql import request_messages
from models.schemas import (
    AgentPage,
    AgentRow,
    AgentState,
    ApprovalPage,
    DeletedAgent,
    JobView,
    JournalEvent,
    JournalEventPage,
    NewAgent,
    RequestRecord,
    Submission,
    SubmittedRequest,
    WaitingApproval,
)
from models.settings import Settings, check_imports
from models.sql import find_agent, request_agents, request_record
from models.tables import agents, deleted_agents

log = logging.getLogger("keel.client")

AgentRef = UUID | str
Publisher = Callable[[Sequence[Due]], None]


def submit_publisher(settings: Settings) -> Publisher | None:
    """The publisher installed Keel provides (entry point ``keel.publishers``/``celery``: Celery's, from tasks/app.py)
    when ``KEEL_PUBLISH_AT_SUBMIT`` is on: a submit's first job then goes to the broker right after its commit, and
    the dispatcher is only the safety net. None when it is off (or nothing provides one): the dispatcher's next pass
    publishes every job."""
    if not settings.publish_at_submit:
        return None
    for point in entry_points(group="keel.publishers", name="celery"):
        made: Publisher | None = point.load()(settings)
        return made
    log.warning("no keel.publishers entry point is installed: submits leave their jobs to the dispatcher")
    return None


Deadline = datetime | timedelta | None


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or "input"
    return f"{field}: {err['msg']}"


class Client:
    """Talks to Keel's database directly; every change goes through :func:`agents.core.transition.transition`."""

    def __init__(self, db: Database, settings: Settings | None = None, *, publisher: Publisher | None = None) -> None:
        """``publisher`` (e.g. ``tasks.app.publisher()``) sends a submit's first job to the broker at once;
        without it the beat dispatcher picks the job up on its next pass."""
        self.db = db
        self.settings = settings or Settings()
        self.publisher = publisher
        #: Said once when publishing starts failing (Redis away) and once when it works again.
        self.broker = Outage("broker", log)
        self._imported = False
        register_settings(self.settings)  # its secrets are masked in anything this process journals or logs

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> Client:
        """A client on ``settings``' database that publishes a submit's first job at once (``KEEL_PUBLISH_AT_SUBMIT``,
        on by default: :func:`submit_publisher`)."""
        settings = settings or Settings()
        return cls(Database.from_settings(settings), settings, publisher=submit_publisher(settings))

    def close(self) -> None:
        close = getattr(self.publisher, "close", None)
        if close is not None:
            close()
        self.db.dispose()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- reads ------------------------------------------------------------------------------------------------

    def agent_row(self, agent: AgentRef) -> AgentRow:
        """The agent's row by id or name, without its jobs (one query; what the HTTP ingress checks a token's
        prefix against). Raises :class:`AgentNotFound` (with the tombstone of a deleted agent)."""
        return self._row(agent)

    def _row(self, agent: AgentRef) -> AgentRow:
        agent_id = _as_uuid(agent)
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
        agent_id = _as_uuid(agent)
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

    def journal_agent(self, agent: AgentRef) -> UUID:
        """The id of the agent whose journal ``agent`` names: a live one, or a deleted one (see :meth:`_chain_id`)."""
        return self._chain_id(agent)

    def _chain_id(self, agent: AgentRef) -> UUID:
        """The agent whose journal to read: a live agent by id or name (a live one wins over deleted ones of the
        same name), else a deleted one by id, or by name if only one deleted agent had it."""
        try:
            return self._row(agent).id
        except AgentNotFound as exc:
            if exc.deleted is None:
                raise
            if _as_uuid(agent) is None:
                gone = self._tombstones(agent)
                if len(gone) > 1:
                    ids = ", ".join(str(t.id) for t in gone)
                    raise InvalidInput(
                        f"{len(gone)} deleted agents were named {quoted(agent)}: give the id of the one you mean"
                        f" ({ids})"
                    ) from None
            return exc.deleted.id

    def get_state(self, agent: AgentRef) -> AgentState:
        """The agent's current state, by id or name, with its pending jobs."""
        return self._state(self._row(agent))

    def _state(self, row: AgentRow, jobs: tuple[JobView, ...] | None = None) -> AgentState:
        """The state of ``row``: with its live jobs as given (a command's, read in its own transaction), else
        read now; the call waiting for approval is read when the agent waits for one."""
        if jobs is None:
            with core.store_errors():
                jobs = tuple(JobView(**r) for r in pending_jobs(self.db, row.id))
        approval = None
        if row.phase == "waiting_approval":
            pending = pending_approval(self.db, row.id, row.request_id)
            approval = None if pending is None else pending.as_dict()
        return AgentState.of(row, jobs, approval)

    def list_agents(
        self,
        *,
        phases: Sequence[str] = (),
        archived: bool = False,
        limit: int | None = None,
        after: str | None = None,
        name_prefix: str | None = None,
    ) -> AgentPage:
        """Agents newest first: in use, or with ``archived`` the archived ones; only those in ``phases`` if given,
        and only those whose name starts with ``name_prefix`` if given. At most ``limit`` (None: all); ``after`` is
        the ``next`` cursor of the previous page."""
        unknown = sorted(set(phases) - {p.value for p in Phase})
        if unknown:
            raise InvalidInput(f"phase {unknown[0]!r} is not one of {', '.join(p.value for p in Phase)}")
        if limit is not None:
            check_count("limit", limit, low=1, high=MAX_BIGINT - 1)  # one more is read to tell whether more follow
        query = select(agents).order_by(agents.c.created_at.desc(), agents.c.id.desc())
        query = query.where(agents.c.archived_at.is_not(None) if archived else agents.c.archived_at.is_(None))
        if phases:
            query = query.where(agents.c.phase.in_(list(phases)))
        if name_prefix:
            check_text("name_prefix", name_prefix, limit=200)
            query = query.where(agents.c.name.startswith(name_prefix, autoescape=True))
        if after is not None:
            created_at, agent_id = _decode_cursor(after)
            query = query.where(tuple_(agents.c.created_at, agents.c.id) < tuple_(created_at, agent_id))
        if limit is not None:
            query = query.limit(limit + 1)  # one more tells whether there is a next page
        with core.store_errors(), self.db.engine.connect() as conn:
            rows = [AgentRow(**r._mapping) for r in conn.execute(query)]
            conn.commit()  # a read: see models.db.end_read
        more = limit is not None and len(rows) > limit
        rows = rows[:limit] if limit is not None else rows
        return AgentPage(
            agents=tuple(AgentState.of(r) for r in rows),
            next=_encode_cursor(rows[-1].created_at, rows[-1].id) if more else None,
        )

    def request_jobs(self, agent: AgentRef, request_id: str) -> list[JobView]:
        """Every job (step) of the agent's request ``request_id``, finished ones included, oldest first."""
        check_text("request_id", request_id, limit=200)
        agent_id = self._chain_id(agent)
        with core.store_errors():
            return [JobView(**r) for r in request_jobs(self.db, agent_id, request_id)]

    def request_messages(self, agent: AgentRef, request_id: str) -> list[dict[str, Any]]:
        """The outbox messages of the agent's request ``request_id``, in the order they were emitted."""
        check_text("request_id", request_id, limit=200)
        agent_id = self._chain_id(agent)
        with core.store_errors():
            return request_messages(self.db, agent_id, request_id)

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
        """Journal events newest first, a page at a time, for an agent and/or a request: at most ``limit``; ``after``
        is the ``next`` cursor of the previous page (the same filters). Keyset-paginated: a page costs its rows."""
        check_count("limit", limit, low=1, high=MAX_BIGINT - 1)  # one more is read to tell whether more follow
        if request_id is not None:
            check_text("request_id", request_id, limit=200)
        by = "seq" if agent_id is not None else "id"
        before = None if after is None else _decode_journal_cursor(after, by)
        resolved = None if agent_id is None else self._chain_id(agent_id)
        with core.store_errors():
            rows = journal_mod.latest_events(
                self.db, agent_id=resolved, request_id=request_id, limit=limit + 1, before=before
            )
        if len(rows) <= limit:
            return JournalEventPage(events=tuple(rows))
        rows = rows[:limit]
        last = rows[-1].seq if by == "seq" else rows[-1].id
        return JournalEventPage(events=tuple(rows), next=_encode_journal_cursor(by, last))

    def follow_journal(
        self, *, agent_id: AgentRef | None = None, request_id: str | None = None, poll_seconds: float = 0.5
    ) -> Iterator[JournalEvent]:
        """Every journal event (of an agent and/or a request), oldest first, then each new one as it commits:
        read by each agent's chain position, so none is skipped or repeated. Runs until the caller stops.

        The agent is looked up at once: an unknown one raises :class:`AgentNotFound` here, not at the first event."""
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

    def agent_names(self, ids: Iterable[UUID]) -> dict[UUID, str]:
        """The names of these agents (archived ones included; a deleted one as ``NAME (deleted)``)."""
        wanted = list(set(ids))
        if not wanted:
            return {}
        gone = deleted_agents.c
        with core.store_errors(), self.db.engine.connect() as conn:
            names = {
                r.id: f"{r.name} (deleted)"
                for r in conn.execute(select(gone.agent_id.label("id"), gone.name).where(gone.agent_id.in_(wanted)))
            }
            rows = conn.execute(select(agents.c.id, agents.c.name).where(agents.c.id.in_(wanted)))
            found = names | {r.id: r.name for r in rows}
            conn.commit()  # a read: see models.db.end_read
        return found

    def archive(self, agent_id: AgentRef, *, actor: str) -> AgentState:
        """Archive a resting agent: it refuses new requests and ``list_agents`` leaves it out; its row and journal
        stay (``get_state``, ``journal`` and ``keel audit verify`` still see them). Raises ``AgentBusy`` while a
        request is in flight. Archiving an archived agent changes nothing."""
        _check_actor(actor)
        return self._state(core.set_archived(self.db, self._row(agent_id).id, archived=True, actor=actor))

    def unarchive(self, agent_id: AgentRef, *, actor: str) -> AgentState:
        """Put an archived agent back in use."""
        _check_actor(actor)
        return self._state(core.set_archived(self.db, self._row(agent_id).id, archived=False, actor=actor))

    def delete_agent(
        self,
        agent: AgentRef,
        *,
        actor: str,
        expected_revision: int | None = None,
        reason: str | None = None,
    ) -> DeletedAgent:
        """Delete an archived agent at rest (archive it first): its row and schedules go and its name is free for a
        new agent; its journal (ending in an ``operator``/``delete`` event), requests, jobs and outbox messages stay,
        and its request ids stay its own. Afterwards it is :class:`AgentNotFound` (saying when and by whom it was
        deleted), ``journal(agent_id=its id)`` still reads its history and ``keel audit verify`` still checks it.
        Refused (journaled, nothing else changes): a stale ``expected_revision`` (``StaleRevision``), an agent not
        archived or not at rest (``AgentInUse``). Returns the agent's tombstone."""
        _check_actor(actor)
        _check_reason(reason)
        if expected_revision is not None:
            check_count("expected_revision", expected_revision)
        return core.delete_agent(
            self.db, self._row(agent).id, actor=actor, reason=reason, expected_revision=expected_revision
        )

    def retry_outbox(self, key: str, *, actor: str) -> None:
        """An operator's retry of a dead outbox message: back to pending (reconciled with the receiver first if it
        may have arrived), journaled on its agent's chain. Raises ``MessageNotFound`` / ``MessageNotDead``."""
        _check_actor(actor)
        check_text("key", key, limit=600)
        retry_dead(self.db, key, actor=actor)

    # --- commands ---------------------------------------------------------------------------------------------

    def create_agent(
        self,
        name: str,
        *,
        budget_tokens: int | None = None,
        budget_cost: Decimal | float | str | None = None,
        actor: str = "client",
    ) -> AgentState:
        """Create an idle agent at revision 0. Budgets of None mean unlimited."""
        check_text("name", name)
        _check_actor(actor)
        try:
            spec = NewAgent.model_validate({"name": name, "budget_tokens": budget_tokens, "budget_cost": budget_cost})
        except ValidationError as exc:
            raise InvalidInput(f"cannot create agent: {_first_error(exc)}") from None
        row = core.create_agent(
            self.db, spec.name, budget_tokens=spec.budget_tokens, budget_cost=spec.budget_cost, actor=actor
        )
        return AgentState.of(row)

    def submit(
        self,
        agent_id: AgentRef,
        request_id: str,
        input: Any,
        *,
        expected_revision: int | None = None,
        soft_deadline: Deadline = None,
        hard_deadline: Deadline = None,
        actor: str = "client",
        operation: str = "plan",
    ) -> AgentState:
        """Start request ``request_id`` on an idle, done or failed agent; its first job is ``operation``
        (key ``{request}:{operation}:1``), which gets the input as ``payload["input"]``.

        The input is checked against the operation's input model first (``plan``: ``{"prompt": …, "script": […]}``);
        input that does not fit raises :class:`InvalidInput` naming the field and the rule, an operation no handler
        is registered for raises :class:`~agents.core.errors.UnknownOperation`, and nothing is written.

        Idempotent: submitting a request id the agent already had, as it was, returns the current state and changes
        nothing; with a different input, operation or deadlines it raises
        :class:`~agents.core.errors.RequestConflict`. Deadlines are absolute (timezone-aware) or relative to now.
        """
        done = self._submit(
            agent_id,
            request_id,
            input,
            expected_revision=expected_revision,
            soft_deadline=soft_deadline,
            hard_deadline=hard_deadline,
            actor=actor,
            operation=operation,
            with_jobs=True,
        )
        return self._state(done.agent, done.jobs)

    def submit_request(
        self,
        agent_id: AgentRef,
        request_id: str,
        input: Any,
        *,
        expected_revision: int | None = None,
        soft_deadline: Deadline = None,
        hard_deadline: Deadline = None,
        actor: str = "client",
        operation: str = "plan",
    ) -> Submission:
        """:meth:`submit`, returning the request as first submitted (the same record for every retry of it), the
        agent's state now, and whether this call was a retry (``replayed``: it changed nothing)."""
        done = self._submit(
            agent_id,
            request_id,
            input,
            expected_revision=expected_revision,
            soft_deadline=soft_deadline,
            hard_deadline=hard_deadline,
            actor=actor,
            operation=operation,
            with_jobs=True,
        )
        return Submission(
            state=self._state(done.agent, done.jobs), request=self._record(done), replayed=done.suppressed
        )

    def submit_record(
        self,
        agent_id: AgentRef,
        request_id: str,
        input: Any,
        *,
        expected_revision: int | None = None,
        soft_deadline: Deadline = None,
        hard_deadline: Deadline = None,
        actor: str = "client",
        operation: str = "plan",
    ) -> SubmittedRequest:
        """:meth:`submit` for a caller that needs only the request (the HTTP ingress): the request as first
        submitted and whether this call was a retry, without reading the agent's state (one query fewer)."""
        done = self._submit(
            agent_id,
            request_id,
            input,
            expected_revision=expected_revision,
            soft_deadline=soft_deadline,
            hard_deadline=hard_deadline,
            actor=actor,
            operation=operation,
        )
        return SubmittedRequest(request=self._record(done), replayed=done.suppressed)

    def _record(self, done: _Submitted) -> RequestRecord:
        """The request as first submitted: a new one is what this transition wrote (no read needed); a retry's is
        read back, as it was first written."""
        if done.suppressed:
            return self.get_request(done.agent.id, done.request_id)
        row = done.agent
        return RequestRecord(
            request_id=done.request_id,
            agent_id=row.id,
            operation=done.operation,
            input=json.loads(done.input_json),
            soft_deadline=row.soft_deadline,
            hard_deadline=row.hard_deadline,
            submitted_at=row.updated_at,  # the transition's time, which the request row records too
            submitted_by=done.actor,
            revision=row.revision,
        )

    def _submit(
        self,
        agent: AgentRef,
        request_id: str,
        input: Any,
        *,
        expected_revision: int | None,
        soft_deadline: Deadline,
        hard_deadline: Deadline,
        actor: str,
        operation: str,
        with_jobs: bool = False,
    ) -> _Submitted:
        _check_actor(actor)
        # Relative deadlines count from the transition's time on the database's clock, not this host's.
        soft, hard = _deadline("soft_deadline", soft_deadline), _deadline("hard_deadline", hard_deadline)
        input_json = self._input_json(input)
        check_text("operation", operation, limit=128)
        self._import_handlers()
        handlers.registry.check_input(operation, json.loads(input_json))
        # By id, the transition's own locking read finds the agent (and a deleted one's tombstone): no read before it.
        agent_id = _as_uuid(agent)
        command = Command(
            agent_id=agent_id if agent_id is not None else self._row(agent).id,
            event=Event.SUBMIT,
            actor=actor,
            expected_revision=expected_revision,
            request_id=request_id,
            soft_deadline=soft,
            hard_deadline=hard,
            jobs=(JobSpec(operation, "1", payload={"input": json.loads(input_json)}),),
        )
        try:
            # While the broker is down, between retries, the jobs are left to the dispatcher at once.
            publish_due = self.publisher is not None and self.broker.wait() == 0
            done = core.transition(
                self.db, command, input_json=input_json, publish_due=publish_due, with_jobs=with_jobs
            )
        except AgentNotFound as exc:
            raise AgentNotFound(agent, deleted=exc.deleted) from None  # named as the caller named it
        if self.publisher is not None and done.to_publish:
            self._publish(self.publisher, done.to_publish)
        return _Submitted(done.agent, done.suppressed, request_id, operation, input_json, actor, done.pending_jobs)

    def _publish(self, publisher: Publisher, due: Sequence[Due]) -> None:
        try:
            publisher(due)
        except Exception as exc:
            # The submit is committed whatever happens here: its jobs go back to pending, so the dispatcher
            # publishes them on its next pass (rather than after KEEL_ENQUEUE_TIMEOUT_SECONDS), and the caller
            # gets its answer.
            self.broker.failed(exc)
            log.debug("%d jobs left to the dispatcher: publishing failed", len(due))
            try:
                unpublish(self.db, [d.key for d in due])
            except Exception:  # they stay enqueued: re-published after KEEL_ENQUEUE_TIMEOUT_SECONDS
                log.exception("could not hand jobs %s to the dispatcher", ", ".join(d.key for d in due))
        else:
            self.broker.recovered()

    def get_request(self, agent: AgentRef, request_id: str) -> RequestRecord:
        """The agent's request ``request_id`` as it was submitted: operation, input, deadlines, who submitted it and
        when, and the agent's revision after the submit. Raises :class:`~agents.core.errors.RequestNotFound`."""
        check_request_id(request_id)
        agent_id = self._chain_id(agent)
        with core.store_errors(), self.db.autocommit() as plain:
            row = request_record(plain.connection, agent_id, request_id)
        if row is None or row["details"] is None:
            raise RequestNotFound(request_id)
        details = row["details"]
        jobs = details.get("jobs")
        return RequestRecord(
            request_id=row["request_id"],
            agent_id=row["agent_id"],
            operation=split_key(jobs[0])[1] if jobs else "plan",  # its first job's; a submit without one: plan
            input=row["input"],
            soft_deadline=details.get("soft_deadline"),
            hard_deadline=details.get("hard_deadline"),
            submitted_at=row["submitted_at"],
            submitted_by=row["actor"],
            revision=row["revision"],
        )

    def request_agents(self, request_id: str) -> list[UUID]:
        """The agents that have a request ``request_id`` (each agent's ids are its own), first submitted first: for
        a reader who names no agent, to keep those it may see."""
        check_request_id(request_id)
        with core.store_errors(), self.db.autocommit() as plain:
            return request_agents(plain.connection, request_id)

    def approve(
        self,
        agent_id: AgentRef,
        *,
        expected_revision: int,
        actor: str,
        arguments: Mapping[str, Any] | None = None,
    ) -> AgentState:
        """Approve the pending tool call of an agent waiting for approval: the call runs next. With ``arguments``
        the call runs with those instead (a person's edit): they are checked against the tool's input model first
        (:class:`InvalidInput` naming the field, nothing changes); the journal keeps both versions, and the model is
        told what was changed."""
        _check_actor(actor)
        row = self._row(agent_id)
        pending = pending_approval(self.db, row.id, row.request_id) if row.phase == "waiting_approval" else None
        details: dict[str, Any] = {"call": pending.as_dict()} if pending else {}
        outcome = "approved"
        if arguments is not None and pending is not None:
            arguments = self._edited_arguments(pending.tool, arguments)
            if arguments != dict(pending.arguments):
                details["edited_arguments"] = arguments
                outcome = "approved with edited arguments"
        jobs = approval_jobs(pending, arguments) if pending else ()
        messages = pending.decided_messages(row.name, outcome, actor) if pending else ()
        return self._command(
            row.id, Event.APPROVE, expected_revision, actor, None, jobs=jobs, extra=details, messages=messages
        )

    def _edited_arguments(self, tool_name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """A person's edit of a call's arguments, if the tool accepts them (else :class:`InvalidInput`)."""
        if not isinstance(arguments, Mapping):
            raise InvalidInput(f"arguments must be a JSON object, got {type(arguments).__name__}")
        edited = dict(arguments)
        check_depth("arguments", edited)  # the bound parse_json puts on text, before anything recurses into it
        check_json_text("arguments", edited)
        self._import_handlers()
        tool = tools.stored_tool(tool_name)
        if tool is None:
            raise InvalidInput(
                f"tool {tool_name!r} is not known to this process, so edited arguments cannot be checked: list the"
                " module that defines it in KEEL_IMPORTS"
            )
        try:
            tool.validate(edited)
        except InvalidJob as exc:
            raise InvalidInput(f"edited arguments refused: {exc}") from None
        return edited

    def approvals(
        self,
        *,
        tool: str | None = None,
        min_age: timedelta | None = None,
        agent_prefix: str | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> ApprovalPage:
        """Every call waiting for approval across agents, oldest first: only those of ``tool``, waiting at least
        ``min_age``, of agents whose name starts with ``agent_prefix``, if given. At most ``limit``; ``after`` is the
        ``next`` cursor of the previous page."""
        check_count("limit", limit, low=1, high=10_000)
        if tool is not None:
            check_text("tool", tool, limit=200)
        if agent_prefix is not None:
            check_text("agent_prefix", agent_prefix, limit=200)
        if min_age is not None and min_age < timedelta(0):
            raise InvalidInput(f"min_age must not be negative, got {min_age}")
        keyset = None
        if after is not None:
            try:
                keyset = _decode_cursor(after)
            except InvalidInput:
                raise InvalidInput(
                    f"cursor {quoted(after)} is not the 'next' of a page of approvals (from `keel approvals` or the"
                    " API)"
                ) from None
        with core.store_errors():
            calls = waiting_calls(
                self.db, tool=tool, min_age=min_age, agent_prefix=agent_prefix, after=keyset, limit=limit + 1
            )
        more = len(calls) > limit
        calls = calls[:limit]
        return ApprovalPage(
            approvals=tuple(_waiting_approval(c) for c in calls),
            next=_encode_cursor(calls[-1].since, calls[-1].agent_id) if more else None,
        )

    def reject(
        self, agent_id: AgentRef, *, expected_revision: int, actor: str, reason: str | None = None
    ) -> AgentState:
        """Decline the pending tool call; the model is told why and revises its plan."""
        _check_actor(actor)
        _check_reason(reason)
        row = self._row(agent_id)
        pending = pending_approval(self.db, row.id, row.request_id) if row.phase == "waiting_approval" else None
        jobs = rejection_jobs(pending, reason or f"rejected by {actor}") if pending else ()
        details = {"call": pending.as_dict()} if pending else {}
        outcome = "rejected" if reason is None else f"rejected: {reason[:300]}"
        messages = pending.decided_messages(row.name, outcome, actor) if pending else ()
        return self._command(
            row.id,
            Event.REJECT,
            expected_revision,
            actor,
            reason,
            jobs=jobs,
            extra=details,
            effects=cancel_round_txn if pending else None,
            messages=messages,
        )

    def cancel(
        self,
        agent_id: AgentRef,
        *,
        expected_revision: int | None = None,
        actor: str,
        reason: str | None = None,
    ) -> AgentState:
        """Stop the request in flight: any active phase moves to failed."""
        _check_actor(actor)
        _check_reason(reason)
        return self._command(agent_id, Event.CANCEL, expected_revision, actor, reason)

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
        _check_reason(reason)
        details: dict[str, Any] = {} if reason is None else {"reason": reason}
        details.update(extra or {})
        # By id, the transition's own locking read finds the agent (and a deleted one's tombstone): no read before it.
        agent_id = _as_uuid(agent)
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
        once: a submit is checked against the same operations, input models and tools the workers run."""
        if self._imported:
            return
        check_imports(self.settings)
        handlers.load(())
        tools.load_entry_points()
        self._imported = True

    def _input_json(self, value: Any) -> str:
        check_depth("input", value)  # the bound parse_json puts on text, before anything recurses into it
        check_json_text("input", value)  # before json.dumps, which would escape a lone surrogate PostgreSQL refuses
        try:
            text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"input must be JSON-serialisable: {exc}") from None
        if "\\u0000" in text:
            raise InvalidInput("input must not contain NUL characters (PostgreSQL cannot store them)")
        size = len(text.encode())
        if size > self.settings.max_input_bytes:
            raise InvalidInput(f"input is {size} bytes as JSON; the limit is {self.settings.max_input_bytes}")
        return text


@dataclass(frozen=True, slots=True)
class _Submitted:
    """What one submit did, and what it was asked (for the request's record)."""

    agent: AgentRow
    suppressed: bool
    request_id: str
    operation: str
    input_json: str
    actor: str
    #: The agent's live jobs as the submit committed them (None: not asked for).
    jobs: tuple[JobView, ...] | None = None


def _check_actor(actor: str) -> None:
    if isinstance(actor, str) and not actor:
        raise InvalidInput(f"actor must be 1-{MAX_ACTOR_CHARS} characters: every change names who made it")
    check_text("actor", actor, limit=MAX_ACTOR_CHARS)


def _check_reason(reason: str | None) -> None:
    if reason is not None:
        check_text("reason", reason, limit=MAX_REASON_CHARS)


def _waiting_approval(call: WaitingCall) -> WaitingApproval:
    payload = call.payload
    timeout = payload.get("approval_timeout_seconds")
    seconds = float(timeout) if isinstance(timeout, int | float) else None
    since = call.since.astimezone(UTC)
    return WaitingApproval(
        agent_id=call.agent_id,
        agent=call.agent,
        revision=call.revision,
        request_id=call.request_id,
        tool=str(payload.get("tool")),
        call_id=str(payload.get("tool_call_id", payload.get("call_id"))),
        round=int(payload.get("round", 0)),
        arguments=dict(payload.get("arguments") or {}),
        since=since,
        waited_seconds=max(0.0, (call.now - call.since).total_seconds()),
        approval_timeout_seconds=seconds,
        on_timeout=str(payload.get("on_timeout", "reject")) if seconds is not None else None,
        times_out_at=since + timedelta(seconds=seconds) if seconds is not None else None,
        escalated=call.escalated,
    )


def _encode_cursor(created_at: datetime, agent_id: UUID) -> str:
    return base64.urlsafe_b64encode(f"{created_at.isoformat()}|{agent_id}".encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[datetime, UUID]:
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        created_at, agent_id = text.split("|")
        at = datetime.fromisoformat(created_at)
        if at.tzinfo is None:
            raise ValueError("naive time")
        return at, UUID(agent_id)
    except (ValueError, UnicodeDecodeError):
        raise BadCursor(
            f"cursor {quoted(cursor)} is not the 'next' of a page of agents (from `keel agent list` or the API)"
        ) from None


def _encode_journal_cursor(by: str, before: int) -> str:
    return base64.urlsafe_b64encode(f"journal|{by}|{before}".encode()).decode().rstrip("=")


def _decode_journal_cursor(cursor: str, by: str) -> int:
    # A cursor of one agent's chain counts events of that chain (seq); of the whole journal, journal ids.
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        kind, found, number = text.split("|")
        value = int(number)
        if kind != "journal" or found != by or not 1 <= value <= MAX_BIGINT:
            raise ValueError(text)
        return value
    except (ValueError, UnicodeDecodeError):
        scope = "one agent's journal (with --agent)" if by == "seq" else "the journal (without --agent)"
        raise BadCursor(
            f"cursor {quoted(cursor)} is not the 'next' of a page of {scope}, as `keel journal` printed it"
        ) from None


def _as_uuid(agent: AgentRef) -> UUID | None:
    if isinstance(agent, UUID):
        return agent
    try:
        return UUID(agent)
    except ValueError:
        return None


def _deadline(name: str, value: Deadline) -> datetime | timedelta | None:
    if value is None:
        return None
    if isinstance(value, timedelta):
        if value <= timedelta(0):
            raise InvalidInput(f"{name} {value} is not in the future: it has passed already")
        return value
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise InvalidInput(f"{name} must be timezone-aware (got a naive datetime)")
        return value
    raise InvalidInput(f"{name} must be a datetime or a timedelta, got {type(value).__name__}")


# --- over HTTP --------------------------------------------------------------------------------------------------

#: How long a Server-Sent Events stream may stay silent before it is taken for dead and reopened (the API sends a
#: keep-alive comment every 15 s while nothing happens).
_STREAM_SILENCE_SECONDS = 60.0


class AccessDenied(KeelError):
    """The API refused the token: missing, unknown or revoked (401), or without the scope for this (403)."""

    def __init__(self, message: str, *, status: int) -> None:
        self.status = status
        super().__init__(message)


class ApiUnavailable(StoreError):
    """The API could not be reached or kept failing (network errors, 5xx) after every retry."""


class HttpClient:
    """:class:`Client`'s producer and person methods over Keel's HTTP API, with the same signatures, return types
    and errors, so a producer's code runs unchanged: ``HttpClient("https://keel.example", token)``.

    Safe retries: network errors and 5xx answers are retried with backoff (a submit under the same
    ``Idempotency-Key``, its request id, so it never runs twice: a retry of a submit the server applied gets the
    original record back, ``replayed``); a 429 waits its ``Retry-After``. A command whose answer was lost is not
    guessed at: when its retry is refused because the agent moved on (a create: the name is taken), the journal is
    asked whether this token's own command is what moved it, and then its result is returned. Refusals come back
    as Keel's own exceptions, their text the server's ``detail``: 412 → :class:`StaleRevision` (with
    ``current_revision`` and ``current_state``), 409 → :class:`IllegalTransition` (``allowed``) /
    :class:`RequestConflict` (``differs``) / :class:`AgentExists` / …, 428 → :class:`Rejected`, 404 →
    :class:`AgentNotFound`, 422 → :class:`InvalidInput`, 401/403 → :class:`AccessDenied`; an API that stays
    unreachable → :class:`ApiUnavailable`.

    The journal's actor for every command is the token's name (``keel token create NAME``), never the ``actor=``
    a caller passes: it is accepted, so code written for :class:`Client` runs, and ignored.

    Client-only, because the API leaves them to operators with database access (``keel agent …``):
    ``archive``, ``unarchive`` and ``delete_agent``. Client-only because they are the database-side plumbing of
    other methods: ``agent_row`` (what the ingress checks a token's prefix against), ``agent_names`` (names of
    agents by id, across tenants), ``journal_after`` (one poll of ``follow_journal``, which here is a stream of
    Server-Sent Events), ``journal_page`` (one keyset page of ``keel journal``, newest first: over HTTP the
    journal routes page by sequence themselves), ``journal_agent`` (the live or deleted agent a journal read names)
    and ``request_agents`` (every agent with a request id, across tenants: ``GET /v1/requests/{id}`` keeps the
    token's own); ``from_settings`` makes a Client from ``KEEL_*`` database settings. Over HTTP the journal is read
    per agent or per request of an agent (``journal()`` with neither is refused), ``follow_journal`` follows one
    agent, and ``list_agents`` lists what the token sees (``name_prefix`` is the token's own prefix)."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: float = 30.0,
        retries: int = 5,
        backoff_seconds: float = 0.2,
        max_wait_seconds: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not token:
            raise InvalidInput("token must be an API token (keel token create NAME --scope …)")
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.backoff_seconds = backoff_seconds
        self.max_wait_seconds = max_wait_seconds
        self._name: str | None = None
        # A live stream is quiet between events but for the API's keep-alive comments: a longer silence is a
        # connection that died without a word, and the stream is reopened from the last event read.
        self._stream_timeout = httpx.Timeout(timeout, read=max(timeout, _STREAM_SILENCE_SECONDS))
        self._http = httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {token}", "Accept": "application/json"},
            timeout=timeout,
            transport=transport,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> HttpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- plumbing ---------------------------------------------------------------------------------------------

    def _call(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        ambiguous: Callable[[httpx.Response], Any] | None = None,
    ) -> httpx.Response:
        """One API call, retried on network errors, 5xx and 429. ``ambiguous`` decides a refusal that followed an
        attempt whose outcome is unknown (sent, no answer or a 5xx): true if that attempt is what was applied."""
        unknown_outcome = False
        for attempt in range(self.retries + 1):
            try:
                response = self._http.request(method, path, json=json_body, params=params, headers=headers)
            except httpx.TransportError as exc:
                # A connect error never reached the server; any other may have been applied there.
                unknown_outcome = unknown_outcome or not isinstance(exc, httpx.ConnectError)
                if attempt == self.retries:
                    raise ApiUnavailable(f"{method} {path}: {type(exc).__name__}: {exc}") from None
                time.sleep(self._backoff(attempt))
                continue
            if response.status_code == 429 and attempt < self.retries:
                time.sleep(self._retry_after(response, attempt))
                continue
            if response.status_code >= 500 and attempt < self.retries:
                unknown_outcome = True
                time.sleep(self._backoff(attempt))
                continue
            if response.is_success or response.status_code == 304:
                return response
            if unknown_outcome and ambiguous is not None and ambiguous(response):
                return response
            raise self._error(response)
        raise AssertionError("unreachable")  # pragma: no cover

    def _backoff(self, attempt: int) -> float:
        return float(min(self.backoff_seconds * 2**attempt, self.max_wait_seconds))

    def _retry_after(self, response: httpx.Response, attempt: int) -> float:
        """The wait a 429 asks for (whole seconds, as Keel sends it), at most ``max_wait_seconds``."""
        try:
            wait = float(response.headers.get("Retry-After", ""))
        except ValueError:
            return self._backoff(attempt)
        return min(max(wait, 0.0), self.max_wait_seconds)

    def _error(self, response: httpx.Response) -> KeelError:
        try:
            body = response.json()
        except ValueError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        detail = str(body.get("detail") or response.reason_phrase or f"HTTP {response.status_code}")
        kind = str(body.get("type", "")).rsplit("/", 1)[-1]
        segments = response.request.url.path.split("/")
        agent = unquote(segments[3]) if segments[1:3] == ["v1", "agents"] and len(segments) > 3 else None
        return _problem_error(response.status_code, kind, detail, body, agent=agent)

    # --- reads ------------------------------------------------------------------------------------------------

    def get_state(self, agent: AgentRef) -> AgentState:
        return AgentState.model_validate(self._call("GET", f"/v1/agents/{_ref(agent)}").json())

    def list_agents(
        self,
        *,
        phases: Sequence[str] = (),
        archived: bool = False,
        limit: int | None = None,
        after: str | None = None,
        name_prefix: str | None = None,
    ) -> AgentPage:
        """As :meth:`Client.list_agents`; ``limit=None`` pages through every agent the token sees."""
        params: dict[str, Any] = {"phase": list(phases), "archived": archived}
        if name_prefix is not None:
            raise InvalidInput("name_prefix is the token's over HTTP (keel token create --agent-prefix)")
        found: list[AgentState] = []
        cursor = after
        while True:
            page_size = 1000 if limit is None else min(limit - len(found), 1000)
            body = self._call(
                "GET", "/v1/agents", params={**params, "limit": page_size, **({"cursor": cursor} if cursor else {})}
            ).json()
            page = AgentPage.model_validate(body)
            found.extend(page.agents)
            cursor = page.next
            if cursor is None or (limit is not None and len(found) >= limit):
                return AgentPage(agents=tuple(found), next=cursor)

    def get_request(self, agent: AgentRef, request_id: str) -> RequestRecord:
        """As :meth:`Client.get_request`."""
        check_request_id(request_id)
        body = self._call("GET", f"/v1/agents/{_ref(agent)}/requests/{request_id}").json()
        return RequestRecord.model_validate(body)

    def _story(self, agent: AgentRef, request_id: str) -> dict[str, Any]:
        check_request_id(request_id)
        return dict(self._call("GET", f"/v1/agents/{_ref(agent)}/requests/{request_id}/story").json())

    def request_jobs(self, agent: AgentRef, request_id: str) -> list[JobView]:
        return [JobView.model_validate(j) for j in self._story(agent, request_id)["jobs"]]

    def request_messages(self, agent: AgentRef, request_id: str) -> list[dict[str, Any]]:
        return list(self._story(agent, request_id)["outbox"])

    def journal(
        self, *, agent_id: AgentRef | None = None, request_id: str | None = None, limit: int | None = None
    ) -> list[JournalEvent]:
        """An agent's journal (``agent_id``), or one of its requests' events (with ``request_id``), oldest first."""
        journal_mod.request_scope(agent_id, request_id)
        if request_id is not None:
            assert agent_id is not None
            found = [JournalEvent.model_validate(e) for e in self._story(agent_id, request_id)["journal"]]
            return found[:limit] if limit is not None else found
        if agent_id is None:
            raise InvalidInput("over HTTP the journal is read per agent (agent_id) or per request (request_id)")
        events: list[JournalEvent] = []
        after = 0
        while True:
            page_size = 1000 if limit is None else min(limit - len(events), 1000)
            body = self._call(
                "GET", f"/v1/agents/{_ref(agent_id)}/journal", params={"after": after, "limit": page_size}
            ).json()
            events.extend(JournalEvent.model_validate(e) for e in body["events"])
            if body["next"] is None or (limit is not None and len(events) >= limit):
                return events
            after = body["next"]

    def follow_journal(
        self, *, agent_id: AgentRef | None = None, request_id: str | None = None, poll_seconds: float = 0.5
    ) -> Iterator[JournalEvent]:
        """Every journal event of the agent, oldest first, then each new one as it commits (the API's Server-Sent
        Events; a dropped stream resumes from the last event seen, so none is skipped or repeated)."""
        if agent_id is None:
            raise InvalidInput("over HTTP an agent is followed (agent_id)")
        path = f"/v1/agents/{_ref(agent_id)}/events"
        self.get_state(agent_id)  # an unknown agent raises AgentNotFound here, not at the first event

        def follow() -> Iterator[JournalEvent]:
            last = 0
            failures = 0
            while True:
                try:
                    stream = connect_sse(self._http, "GET", path, params={"after": last}, timeout=self._stream_timeout)
                    with stream as source:
                        answer = source.response
                        if answer.status_code == 429 or answer.status_code >= 500:
                            answer.read()
                            failures += 1
                            if failures > self.retries:
                                raise self._error(answer)
                            time.sleep(self._retry_after(answer, failures - 1))
                            continue
                        if answer.status_code != 200:
                            answer.read()
                            raise self._error(answer)
                        for sse in source.iter_sse():
                            if not sse.id:
                                continue
                            event = JournalEvent.model_validate_json(sse.data)  # the whole event: see event_data
                            last = event.seq
                            failures = 0
                            if request_id is None or event.request_id == request_id:
                                yield event
                except httpx.TransportError:
                    failures += 1
                    if failures > self.retries:
                        raise ApiUnavailable(f"GET {path}: the event stream kept failing") from None
                    time.sleep(max(poll_seconds, self._backoff(failures - 1)))

        return follow()

    # --- commands ---------------------------------------------------------------------------------------------

    def create_agent(
        self,
        name: str,
        *,
        budget_tokens: int | None = None,
        budget_cost: Decimal | float | str | None = None,
        actor: str = "client",
    ) -> AgentState:
        """As :meth:`Client.create_agent`; the journal's actor is the token's name (``actor`` is ignored).

        A create whose answer was lost and whose retry finds the name taken returns the agent if this token
        created it (the actor of its first journal event), and raises :class:`AgentExists` otherwise."""
        check_text("name", name)
        body = {"name": name, "budget_tokens": budget_tokens, "budget_cost": _decimal(budget_cost)}

        def applied(response: httpx.Response) -> bool:
            if _kind(response) != "agent-exists":
                return False
            return self._creator(self.get_state(name).id) == self._token_name()

        response = self._call("POST", "/v1/agents", json_body=body, ambiguous=applied)
        if not response.is_success:  # created by the attempt whose answer was lost
            return self.get_state(name)
        return AgentState.model_validate(response.json())

    def submit(
        self,
        agent_id: AgentRef,
        request_id: str,
        input: Any,
        *,
        expected_revision: int | None = None,
        soft_deadline: Deadline = None,
        hard_deadline: Deadline = None,
        actor: str = "client",
        operation: str = "plan",
    ) -> AgentState:
        """As :meth:`Client.submit` (the state is read right after the submit)."""
        return self.submit_request(
            agent_id,
            request_id,
            input,
            expected_revision=expected_revision,
            soft_deadline=soft_deadline,
            hard_deadline=hard_deadline,
            actor=actor,
            operation=operation,
        ).state

    def submit_request(
        self,
        agent_id: AgentRef,
        request_id: str,
        input: Any,
        *,
        expected_revision: int | None = None,
        soft_deadline: Deadline = None,
        hard_deadline: Deadline = None,
        actor: str = "client",
        operation: str = "plan",
    ) -> Submission:
        """As :meth:`Client.submit_request`. ``replayed`` is the API's answer (``Idempotent-Replayed``): it is true
        too when this call's own first attempt was applied and its answer lost, as the retry changed nothing."""
        done = self.submit_record(
            agent_id,
            request_id,
            input,
            expected_revision=expected_revision,
            soft_deadline=soft_deadline,
            hard_deadline=hard_deadline,
            actor=actor,
            operation=operation,
        )
        return Submission(request=done.request, state=self.get_state(done.request.agent_id), replayed=done.replayed)

    def submit_record(
        self,
        agent_id: AgentRef,
        request_id: str,
        input: Any,
        *,
        expected_revision: int | None = None,
        soft_deadline: Deadline = None,
        hard_deadline: Deadline = None,
        actor: str = "client",
        operation: str = "plan",
    ) -> SubmittedRequest:
        """As :meth:`Client.submit_record`: one POST, the request as first submitted (no read of the state)."""
        check_request_id(request_id)
        body: dict[str, Any] = {"input": input, "operation": operation}
        for name, value in (("soft_deadline", soft_deadline), ("hard_deadline", hard_deadline)):
            checked = _deadline(name, value)
            if isinstance(checked, timedelta):
                body[f"{name}_seconds"] = checked.total_seconds()
            elif checked is not None:
                body[name] = checked.isoformat()
        headers = {"Idempotency-Key": request_id}
        if expected_revision is not None:
            headers["If-Match"] = f'"r{expected_revision}"'
        response = self._call("POST", f"/v1/agents/{_ref(agent_id)}/requests", json_body=body, headers=headers)
        return SubmittedRequest(
            request=RequestRecord.model_validate(response.json()),
            replayed=response.headers.get("Idempotent-Replayed") == "true",
        )

    def approve(
        self,
        agent_id: AgentRef,
        *,
        expected_revision: int,
        actor: str = "client",
        arguments: Mapping[str, Any] | None = None,
    ) -> AgentState:
        """As :meth:`Client.approve`; the journal's actor is the token's name."""
        return self._decide(agent_id, "approve", expected_revision, None, arguments=arguments)

    def approvals(
        self,
        *,
        tool: str | None = None,
        min_age: timedelta | None = None,
        agent_prefix: str | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> ApprovalPage:
        """As :meth:`Client.approvals`; a token limited to an agent prefix sees its agents' calls only."""
        params: dict[str, Any] = {"limit": limit}
        if tool is not None:
            params["tool"] = tool
        if min_age is not None:
            params["min_age_seconds"] = min_age.total_seconds()
        if agent_prefix is not None:
            params["agent_prefix"] = agent_prefix
        if after is not None:
            params["cursor"] = after
        return ApprovalPage.model_validate(self._call("GET", "/v1/approvals", params=params).json())

    def reject(
        self, agent_id: AgentRef, *, expected_revision: int, actor: str = "client", reason: str | None = None
    ) -> AgentState:
        return self._decide(agent_id, "reject", expected_revision, reason)

    def cancel(
        self,
        agent_id: AgentRef,
        *,
        expected_revision: int | None = None,
        actor: str = "client",
        reason: str | None = None,
    ) -> AgentState:
        return self._decide(agent_id, "cancel", expected_revision, reason)

    def retry_outbox(self, key: str, *, actor: str = "client") -> None:
        check_text("key", key, limit=600)
        self._call("POST", f"/v1/outbox/{quote(key, safe='')}/retry")

    def _decide(
        self,
        agent: AgentRef,
        act: str,
        expected: int | None,
        reason: str | None,
        *,
        arguments: Mapping[str, Any] | None = None,
    ) -> AgentState:
        headers = {} if expected is None else {"If-Match": f'"r{expected}"'}
        path = f"/v1/agents/{_ref(agent)}/{act}"
        body: dict[str, Any] | None = {"reason": reason}
        if act == "approve":
            body = None if arguments is None else {"arguments": dict(arguments)}

        def applied(response: httpx.Response) -> bool:
            # An earlier attempt may have been applied before its answer was lost; then the transition that moved
            # the agent on is this token's own. With If-Match the retry is a 412, and that transition is the one
            # to ``expected + 1``; without (a cancel) it is a 409, and that transition is the agent's latest, on
            # the request it is on.
            if expected is not None:
                return response.status_code == 412 and self._mine(agent, expected + 1, act)
            if _kind(response) != "illegal-transition":
                return False
            state = self.get_state(agent)
            return self._mine(agent, state.revision, act, request_id=state.request_id)

        response = self._call("POST", path, json_body=body, headers=headers, ambiguous=applied)
        if not response.is_success:  # applied by the attempt whose answer was lost
            return self.get_state(agent)
        return AgentState.model_validate(response.json())

    def _mine(self, agent: AgentRef, revision: int, event: str, *, request_id: str | None = None) -> bool:
        """Whether the transition that brought the agent to ``revision`` is this token's ``event``."""
        found = self._call("GET", f"/v1/agents/{_ref(agent)}/journal", params={"revision": revision}).json()
        return any(
            e["kind"] == "transition"
            and e["event"] == event
            and e["actor"] == self._token_name()
            and (request_id is None or e["request_id"] == request_id)
            for e in found["events"]
        )

    def _token_name(self) -> str:
        """The token's name: the actor the journal records for what it does."""
        if self._name is None:
            self._name = str(self._call("GET", "/v1/tokens/me").json()["name"])
        return self._name

    def _creator(self, agent_id: UUID) -> str:
        """Who created the agent: the actor of its first journal event, read from its event stream (every scope
        may watch an agent; a producer may not read its journal)."""
        path = f"/v1/agents/{agent_id}/events"
        with connect_sse(self._http, "GET", path, params={"after": 0}, timeout=self._stream_timeout) as source:
            if source.response.status_code != 200:
                source.response.read()
                raise self._error(source.response)
            for sse in source.iter_sse():
                if sse.id:
                    return str(json.loads(sse.data)["actor"])
        raise ApiUnavailable(f"GET {path}: the stream ended before the agent's first event")


def _kind(response: httpx.Response) -> str:
    """The slug of a problem answer's ``type`` ("" for any other answer)."""
    try:
        body = response.json()
    except ValueError:
        return ""
    return str(body.get("type", "")).rsplit("/", 1)[-1] if isinstance(body, dict) else ""


def _ref(agent: AgentRef) -> str:
    text = str(agent)
    check_text("agent", text, limit=200)
    return quote(text, safe="")


def _decimal(value: Decimal | float | str | None) -> str | None:
    return None if value is None else str(value)


def _problem_error(
    status: int, kind: str, detail: str, body: Mapping[str, Any], *, agent: str | None = None
) -> KeelError:
    """The Keel exception a problem response stands for, carrying the facts the body gives; its text is the
    server's ``detail``. ``agent``: the agent the request named, for :class:`AgentNotFound`."""
    made: KeelError
    agent_id = _as_uuid(str(body.get("agent_id", ""))) or UUID(int=0)
    if status in (401, 403):
        made = AccessDenied(detail, status=status)
    elif kind == "stale-revision":
        stale = StaleRevision(
            agent_id=agent_id,
            expected=int(body.get("expected_revision") or 0),
            current=int(body.get("current_revision") or 0),
        )
        state = body.get("current_state")
        stale.current_state = None if state is None else AgentState.model_validate(state)  # type: ignore[attr-defined]
        made = stale
    elif kind == "illegal-transition":
        made = IllegalTransition(
            agent_id=agent_id,
            phase=str(body.get("phase")),
            event=str(body.get("event")),
            allowed=list(body.get("allowed") or ()),
        )
    elif kind == "request-conflict":
        made = RequestConflict(
            request_id=str(body.get("request_id")), owner=agent_id, differs=list(body.get("differs") or ())
        )
    elif (cls := _BY_KIND.get(kind) or _BY_STATUS.get(status, KeelError)) is AgentNotFound:
        made = AgentNotFound(agent or "?")
    else:
        made = cls.__new__(cls)
        # The facts each of these errors carries, as far as the answer gives them (None where it does not).
        for name in _FACTS.get(cls, ()):
            value = body.get(name, agent_id if name == "agent_id" else None)
            setattr(made, name, tuple(value) if isinstance(value, list) else value)
    made.args = (detail,)
    return made


_FACTS: dict[type[KeelError], tuple[str, ...]] = {
    RequestNotFound: ("request_id",),
    AgentExists: ("name",),
    AgentArchived: ("agent_id", "name"),
    AgentBusy: ("agent_id", "name", "phase"),
    AgentInUse: ("agent_id", "name", "phase", "archived", "at_rest"),
    HardDeadlinePassed: ("agent_id", "name", "hard_deadline"),
    MessageNotFound: ("key",),
    MessageNotDead: ("key", "status"),
    UnknownOperation: ("operation", "known"),
}


_BY_KIND: dict[str, type[KeelError]] = {
    "agent-not-found": AgentNotFound,
    "request-not-found": RequestNotFound,
    "agent-exists": AgentExists,
    "agent-archived": AgentArchived,
    "agent-busy": AgentBusy,
    "agent-in-use": AgentInUse,
    "hard-deadline-passed": HardDeadlinePassed,
    "invalid-deadlines": InvalidDeadlines,
    "unknown-operation": UnknownOperation,
    "invalid-input": InvalidInput,
    "outbox-message-not-found": MessageNotFound,
    "outbox-message-not-dead": MessageNotDead,
    "precondition-required": Rejected,
    "store-unavailable": ApiUnavailable,
}
_BY_STATUS: dict[int, type[KeelError]] = {
    400: InvalidInput,
    404: AgentNotFound,
    409: Rejected,
    412: StaleRevision,
    413: InvalidInput,
    422: InvalidInput,
    428: Rejected,
    429: ApiUnavailable,
    500: ApiUnavailable,
    502: ApiUnavailable,
    503: ApiUnavailable,
    504: ApiUnavailable,
}
