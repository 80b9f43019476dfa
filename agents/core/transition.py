"""The single writer of agent state: ``transition()`` is the only code that changes an agent row, in one transaction
that locks the row, decides the command (:func:`agents.core.commands.decide`), writes the row, the command's effects and
exactly one journal event, and commits, all or nothing; a rejected command is journaled in a transaction of its own.
What it writes, in which order and why: docs/explanation/journal-and-transitions.md."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import psycopg

from agents.core import approval_notices, journal
from agents.core.commands import (
    LOW,
    Accept,
    Command,
    MessageSpec,
    Reject,
    Suppress,
    as_given,
    decide,
    differences,
)
from agents.core.errors import FencedOff, InvalidInput, LostUpdate, RequestConflict, StoreError
from agents.core.keys import current_request_key, make_key, step_message_key
from agents.core.lifecycle import create_agent as create_agent
from agents.core.lifecycle import delete_agent as delete_agent
from agents.core.lifecycle import missing_agent
from agents.core.lifecycle import set_archived as set_archived
from agents.core.observe import current, current_traceparent, link, observe
from agents.core.outcomes import (
    charge_staged_txn,
    outcome_finish_params,
    outcome_goes_with_the_row,
    write_outcome_txn,
)
from agents.core.phases import RESTING, Event, Phase
from agents.core.queues import LOW_QUEUE, new_jobs
from agents.core.store import store_errors as store_errors
from models.audit_keys import AuditKeys
from models.clock import rfc3339
from models.db import Database
from models.jobs_sql import (
    Due,
    cancel_agent_jobs_txn,
    demote_agent_jobs_txn,
    holds,
    insert_jobs_txn,
    live_jobs_txn,
)
from models.outbox_sql import NewMessage, insert_messages_txn
from models.schemas import AgentRow, JobView
from models.sql import (
    RequestClaim,
    lock_agent_txn,
    request_as_submitted_txn,
    update_agent_and_commit_txn,
)

#: Where an effect that cancelled jobs returns the usage of the staged outcomes it took out of them (by job key, as
#: :class:`models.jobs_sql.Swept` has it): the transition charges that spend, once, and journals what it charged.
STAGED_SPEND = "staged_spend"

#: Writes a transition's effects (jobs, outbox messages, …) with the caller's cursor, inside the transition's
#: transaction, once the command is decided and before the event and the row are written. Gets the row before and
#: after; what it returns is journaled, except under :data:`STAGED_SPEND`.
EffectsTxn = Callable[[psycopg.Cursor[Any], AgentRow, AgentRow], Mapping[str, Any] | None]


@dataclass(frozen=True, slots=True)
class Transitioned:
    """The result of an accepted (or suppressed) command."""

    agent: AgentRow
    journal_seq: int
    suppressed: bool = False
    #: Jobs this transition inserted as ``enqueued``: the caller publishes them now (``publish_due=True``).
    to_publish: tuple[Due, ...] = ()
    #: With ``with_jobs=True``: the agent's live jobs as this transaction committed them (what the state view lists
    #: and a read right after the commit gives); None otherwise.
    pending_jobs: tuple[JobView, ...] | None = None


def now() -> datetime:
    """This host's clock: for what a person reads (log lines, relative deadlines a caller gives). Nothing that
    decides or orders anything compares it with a stored time: that is the database's clock (invariant 10)."""
    return datetime.now(UTC)


def transition(
    db: Database,
    command: Command,
    *,
    input_json: str = "null",
    effects: EffectsTxn | None = None,
    publish_due: bool = False,
    with_jobs: bool = False,
) -> Transitioned:
    """Apply ``command`` to its agent: the only way an agent's state changes. Raises ``StaleRevision``,
    ``IllegalTransition`` or ``RequestConflict`` (each journaled as ``rejected``) or ``AgentNotFound``; a submit of a
    request id the agent already had changes nothing (journaled as ``suppressed``). ``input_json`` is a submit's input,
    ``effects`` run in the transaction, ``with_jobs`` returns the agent's live jobs as committed. What else it writes:
    docs/explanation/journal-and-transitions.md#what-one-transition-writes-in-one-transaction."""
    with observe(
        "transition", command.event.value, request_id=command.request_id, agent_id=command.agent_id, actor=command.actor
    ) as op:
        done = _transition(
            db, command, input_json=input_json, effects=effects, publish_due=publish_due, with_jobs=with_jobs
        )
        op.outcome = "suppressed" if done.suppressed else "applied"
        return done


def _transition(
    db: Database,
    command: Command,
    *,
    input_json: str,
    effects: EffectsTxn | None,
    publish_due: bool,
    with_jobs: bool,
) -> Transitioned:
    keys = journal.signing_keys(db)
    with store_errors():
        with db.transaction() as cur:
            claim = None
            if command.event is Event.SUBMIT:  # (a join never makes a submit: Command refuses its request id)
                assert command.request_id is not None
                # Recorded with the lock unless the agent is on it already; the request's trace is the submit's.
                claim = RequestClaim(command.request_id, input_json, command.actor, current_traceparent())
            locked = lock_agent_txn(cur, command.agent_id, claim=claim)
            if locked is None:
                raise missing_agent(cur, command.agent_id)
            # The database's clock, read after the lock: along a chain time never goes back, and every host agrees.
            row, live_jobs, at = locked.row, locked.live_jobs, locked.at
            command = _joined(command, row, live_jobs)
            _name_observed(command)
            # Not claimed: this agent had a request of that id already (ids are each agent's own).
            seen = claim is not None and not locked.claimed
            decision = decide(row, command, at, request_seen=seen)
            if isinstance(decision, Suppress) and command.event is Event.SUBMIT:
                # A retry repeats the request as it was; one that asks for something else is not a retry.
                assert command.request_id is not None
                submitted = request_as_submitted_txn(cur, row.id, command.request_id, input_json)
                differs = [] if submitted is None else differences(submitted, command, input_json)
                if differs:
                    conflict = RequestConflict(
                        request_id=command.request_id, owner=row.id, owner_name=row.name, differs=differs
                    )
                    decision = Reject(conflict, "request_conflict")
            if isinstance(decision, Suppress):
                link = journal.append_side_event_txn(
                    cur,
                    row,
                    keys=keys,
                    kind="suppressed",
                    event=command.event.value,
                    actor=command.actor,
                    request_id=command.request_id,
                    decision=decision.reason,
                    details=dict(command.details),
                    at=at,
                )
                jobs = _views(live_jobs_txn(cur, row.id)) if with_jobs else None
                after = replace(row, journal_seq=link.seq, journal_head=link.hash)
                return Transitioned(after, link.seq, True, pending_jobs=jobs)
            if isinstance(decision, Accept):
                after, to_publish, known = _apply_txn(
                    cur,
                    keys,
                    row,
                    decision.after,
                    command,
                    at,
                    effects,
                    publish_due,
                    live_jobs,
                    locked.request_traceparent,
                    with_jobs=with_jobs,
                )
                jobs = None if known is None else _views(known)
                return Transitioned(after, after.journal_seq, to_publish=to_publish, pending_jobs=jobs)
            if command.outcome is not None and not holds(cur, command.outcome.key, command.outcome.fencing_token):
                # The worker lost its job before the agent moved on: that is the story, not the rejection.
                raise FencedOff(command.outcome.key)
            # Rejected: leave this transaction (it wrote at most the request claim, which must not stay).
            cur.connection.rollback()
        assert isinstance(decision, Reject)
        try:
            _journal_rejection(db, keys, command, decision, row)
        except StoreError as exc:  # the caller still learns why its command was refused
            raise decision.error from exc
    raise decision.error


def _apply_txn(
    cur: psycopg.Cursor[Any],
    keys: AuditKeys,
    before: AgentRow,
    after: AgentRow,
    command: Command,
    at: datetime,
    effects: EffectsTxn | None,
    publish_due: bool,
    live_jobs: int,
    request_traceparent: str | None,
    *,
    with_jobs: bool = False,
) -> tuple[AgentRow, tuple[Due, ...], list[dict[str, Any]] | None]:
    """Write the accepted transition and commit it; returns the row as stored, the jobs to publish, and (with
    ``with_jobs``) the agent's live jobs as committed: known from this transaction's own effects, or read just before
    the commit, in its round trip."""
    # The event's hash covers what the effects did, so they run first; the row, last, carries the new chain head.
    details: dict[str, Any] = dict(command.details)
    if command.event is Event.SUBMIT:
        details["soft_deadline"] = None if after.soft_deadline is None else rfc3339(after.soft_deadline)
        details["hard_deadline"] = None if after.hard_deadline is None else rfc3339(after.hard_deadline)
        # As the producer gave them (a relative deadline as such): a retry of the request must give the same.
        details["as_given"] = {name: as_given(getattr(command, name)) for name in ("soft_deadline", "hard_deadline")}
    if command.spend:
        details["spend"] = {"tokens": command.spend.tokens, "cost": str(command.spend.cost)}
    finish: tuple[Any, ...] | None = None
    if command.outcome is not None:
        if not command.outcome.leaves_job_live:
            live_jobs -= 1
        if outcome_goes_with_the_row(before, after, command, effects is not None, live_jobs):
            # Written by the row's statement, under the fencing token.
            finish = outcome_finish_params(command.outcome, at)
        else:
            write_outcome_txn(cur, command.outcome, at, LOW_QUEUE if after.priority == LOW else None)
        details["job_status"] = command.outcome.status
    staged: dict[str, Any] = {}  # spend of staged outcomes that this transition's cancels took out of their jobs
    if effects is not None:
        summary = dict(effects(cur, before, after) or {})
        staged.update(summary.pop(STAGED_SPEND, None) or {})
        if summary:
            details["effects"] = summary
    to_publish: tuple[Due, ...] = ()
    inserted: list[dict[str, Any]] = []
    # What a job's outcome schedules and emits is keyed from that job's own key.
    step = command.outcome.key if command.outcome is not None else None
    messages = [(message_key(after, m, step), m) for m in command.messages]
    if approval_notices.ends_undecided(before, after, command):
        # Whoever was told the call waits is told it waits no more, however the wait ended (a cancel, a deadline, a
        # failure): every way out is this transition, so no caller can forget it.
        ended = approval_notices.ended_notices_txn(cur, before, command)
        messages += [(message_key(after, m, None), m) for m in ended]
    # The jobs and messages this transition causes continue the request's trace.
    traceparent = _request_trace(before, after, request_traceparent) if command.jobs or messages else None
    if command.jobs:
        rows = new_jobs(after, command.jobs, at, publish_due=publish_due, traceparent=traceparent, step=step)
        inserted, suppressed = insert_jobs_txn(cur, rows, at)
        fresh = [job["key"] for job in inserted]
        details["jobs"] = fresh
        if suppressed:
            details["jobs_suppressed"] = suppressed
        new_keys = set(fresh)
        to_publish = tuple(Due(r.key, r.queue, False) for r in rows if r.key in new_keys and r.status == "enqueued")
    if messages:
        details.update(_emit_messages_txn(cur, after, messages, traceparent))
    # The agent's live jobs, when this transaction's own writes tell them (no one else can insert or finish one under
    # the row's lock); otherwise they are read at the commit. Why: docs/explanation/journal-and-transitions.md.
    known: list[dict[str, Any]] | None = None
    if live_jobs == 0 and effects is None and len(inserted) <= 1:
        known = inserted
    # Coming to rest cancels the agent's live jobs (an empty sweep costs a statement: skip it when there are none).
    if Phase(after.phase) in RESTING and Phase(before.phase) not in RESTING:
        if live_jobs > 0 or effects or command.jobs:
            swept = cancel_agent_jobs_txn(cur, after.id, at, f"agent {after.phase}: {command.reason}")
            if swept.keys:
                details["jobs_cancelled"] = swept.keys
            staged.update(swept.staged)
        known = []
    if staged:
        after, charged = charge_staged_txn(cur, after, staged)
        if charged:
            details["staged_spend_charged"] = charged
    if after.priority == LOW and before.priority != LOW:
        demoted = demote_agent_jobs_txn(cur, after.id, LOW_QUEUE, at)
        if demoted:
            details["jobs_demoted"] = demoted
            known = None
    event = journal.new_event(
        before,
        keys=keys,
        kind="transition",
        event=command.event.value,
        actor=command.actor,
        request_id=after.request_id,
        from_phase=before.phase,
        to_phase=after.phase,
        revision=after.revision,
        decision=command.reason,
        details=details,
        at=at,
    )
    # The row and the commit in one round trip (with the live jobs read between them when they must be read).
    stored, read = update_agent_and_commit_txn(
        cur,
        before,
        replace(after, journal_seq=event.seq, journal_head=event.hash),
        event,
        live_jobs_of=after.id if with_jobs and known is None else None,
        finish=finish,
    )
    if stored is None:
        # Nothing was committed. Which refusal it was: the outcome's claim lost (the usual story), or the row moved.
        if (
            command.outcome is not None
            and finish is not None
            and not holds(cur, command.outcome.key, command.outcome.fencing_token)
        ):
            raise FencedOff(command.outcome.key)
        raise LostUpdate(f"agent {before.id} is no longer at revision {before.revision}")
    if not with_jobs:
        return stored, to_publish, None
    return stored, to_publish, known if known is not None else read


def _views(jobs: list[dict[str, Any]]) -> tuple[JobView, ...]:
    return tuple(JobView(**job) for job in jobs)


def _request_trace(before: AgentRow, after: AgentRow, stored: str | None) -> str | None:
    """The trace context the jobs and messages a transition inserts carry, so one request is one trace: the
    transition's own when it runs in the request's trace or starts it, else the request's stored one, linked to the
    transition's span (docs/explanation/journal-and-transitions.md#traces)."""
    current = current_traceparent()
    if stored is None or after.request_id is None or after.request_id != before.request_id:
        return current
    if current is not None and _trace_id(current) == _trace_id(stored):
        return current
    if current is not None:
        link(stored)
    return stored


def _trace_id(traceparent: str) -> str:
    """The trace id field of a W3C ``traceparent`` (``00-<trace id>-<span id>-<flags>``)."""
    return traceparent.split("-")[1] if traceparent.count("-") >= 2 else traceparent


def _name_observed(command: Command) -> None:
    """A joined step's command becomes the event it joins into: name the observed transition after that one."""
    op = current()
    if op is not None and op.kind == "transition" and op.name != command.event.value:
        op.name = command.event.value
        op.add()


def _joined(command: Command, row: AgentRow, live_jobs: int) -> Command:
    if command.join is None or row.phase != Phase.EXECUTING.value:
        return command
    finishing = command.outcome is not None and not command.outcome.leaves_job_live
    if live_jobs - (1 if finishing else 0) > 0:
        return command
    return replace(command, event=command.join.event, jobs=command.jobs + command.join.jobs, join=None)


def message_key(agent: AgentRow, message: MessageSpec, emitted_by: str | None) -> str:
    """The outbox key of ``message``, emitted by the outcome of the step ``emitted_by`` (None: by no step): keyed
    from the step it is about (its own ``step``, else the emitting one's), or from the request if there is none. A
    step cannot key its messages from another step's key: two steps could then suppress each other's messages."""
    if emitted_by is not None and message.step not in (None, emitted_by):
        raise InvalidInput(
            f"step {emitted_by} emitted a message naming step {message.step}: a step's messages are keyed by that step"
        )
    step = message.step or emitted_by
    if step is not None:
        return step_message_key(step, message.channel, message.target)
    request = current_request_key(agent.id, agent.request_id, agent.request_key)
    return make_key(request, message.channel, message.target)


def _emit_messages_txn(
    cur: psycopg.Cursor[Any], agent: AgentRow, messages: list[tuple[str, MessageSpec]], traceparent: str | None
) -> dict[str, Any]:
    """Put the transition's messages (each with its key) in the outbox, in order; a key already there is a
    suppressed duplicate."""
    if agent.request_id is None:
        raise InvalidInput("messages need a request in flight: their keys start with its key")
    rows = [
        NewMessage(key, agent.id, agent.request_id, m.channel, m.destination, dict(m.payload), traceparent)
        for key, m in messages
    ]
    inserted, suppressed = insert_messages_txn(cur, rows)
    summary: dict[str, Any] = {"messages": inserted}
    if suppressed:
        summary["messages_suppressed"] = suppressed
    return summary


def record_side_event(
    db: Database,
    agent_id: UUID,
    *,
    kind: str,
    event: str,
    actor: str,
    decision: str,
    details: Mapping[str, Any],
    effects: Callable[[psycopg.Cursor[Any]], None] | None = None,
) -> None:
    """Journal something that happened to an agent without changing its state (a suppressed duplicate delivery,
    a fenced-off outcome), in a transaction of its own, with optional effects on other tables."""
    keys = journal.signing_keys(db)
    with store_errors(), db.transaction() as cur:
        locked = lock_agent_txn(cur, agent_id)
        if locked is None:
            raise missing_agent(cur, agent_id)
        if effects is not None:
            effects(cur)
        journal.append_side_event_txn(
            cur,
            locked.row,
            keys=keys,
            kind=kind,
            event=event,
            actor=actor,
            decision=decision,
            details=details,
            at=locked.at,
        )


def _journal_rejection(db: Database, keys: AuditKeys, command: Command, decision: Reject, judged: AgentRow) -> None:
    """Record a rejected command in its own transaction, leaving the agent's state as it is. Other writers may
    have moved the agent in between: the event records the state the command was judged against too."""
    details: dict[str, Any] = {
        "error": str(decision.error),
        "judged_revision": judged.revision,
        "judged_phase": judged.phase,
        **command.details,
    }
    if command.expected_revision is not None:
        details["expected_revision"] = command.expected_revision
    if isinstance(decision.error, RequestConflict) and decision.error.differs:
        details["differs"] = list(decision.error.differs)
    with db.transaction() as cur:
        locked = lock_agent_txn(cur, command.agent_id)
        if locked is None:  # pragma: no cover - deleted meanwhile: its chain is closed, and it refused the command
            return
        journal.append_side_event_txn(
            cur,
            locked.row,
            keys=keys,
            kind="rejected",
            event=command.event.value,
            actor=command.actor,
            request_id=command.request_id,
            decision=decision.decision,
            details=details,
            at=locked.at,
        )
