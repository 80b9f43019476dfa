"""Deadline enforcement: past the soft deadline an agent's jobs drop to the low-priority queue; past the hard one
the request is stopped (phase failed, live jobs cancelled, running ones fenced off). Journaled like any transition,
judged on the database's clock, one agent at a time: one whose move fails is logged and journaled, and the pass goes
on."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime
from uuid import UUID

from agents.core import transition as core
from agents.core.commands import LOW, Command, MessageSpec
from agents.core.errors import InvalidInput, Rejected, StaleRevision
from agents.core.phases import ACTIVE, Event
from models.clock import database_now
from models.db import Database, end_read
from models.deadlines_sql import START, PastDeadline, agents_past_deadline, last_event, seen_again

log = logging.getLogger("keel.deadlines")

#: The journal decision of a deadline move that failed (kind "rejected": the agent's state did not change).
ENFORCEMENT_FAILED = "deadline_enforcement_failed"
#: Longest error text journaled for a failed move: the journal is append-only and kept forever.
ERROR_TEXT_LIMIT = 500


@dataclass
class EnforceReport:
    demoted: list[UUID] = field(default_factory=list)
    stopped: list[UUID] = field(default_factory=list)
    failed: list[UUID] = field(default_factory=list)  # the move raised; logged and journaled on the agent


#: How many due agents one query of a pass takes (``KEEL_DEADLINE_BATCH`` in the beat).
DEFAULT_BATCH = 200
#: How many times a move that lost to the agent's own progress (the same request, a newer revision) is retried.
STALE_RETRIES = 3


def enforce(
    db: Database,
    at: datetime | None = None,
    *,
    actor: str = "deadline-enforcer",
    notify_slack_channel: str | None = None,
    batch: int = DEFAULT_BATCH,
) -> EnforceReport:
    """Apply both deadlines to every active agent that has passed one, as of the database's clock when the pass
    starts (``at`` overrides it, for tests): hard deadlines first (oldest first), then soft ones, ``batch`` agents
    per query, each batch read on from where the last one ended — an agent whose move failed is not read again in
    the same pass, and the pass ends. Safe to run from several places at once: each move is a transition under the
    agent's lock, and one that lost a race is simply rejected. A stop is announced on ``notify_slack_channel``
    through the outbox, in the same transaction; a channel that cannot be used never prevents the stop."""
    if batch < 1:
        raise InvalidInput(f"batch must be at least 1, got {batch}")
    report = EnforceReport()
    notice, notice_problem = _notice_template(notify_slack_channel)
    phases = [p.value for p in ACTIVE]
    if at is None:
        with db.connection() as conn, conn.cursor() as cur:
            at = database_now(cur)
            end_read(conn)
    for hard in (True, False):
        after = START
        while True:
            found = agents_past_deadline(db, phases, hard=hard, at=at, after=after, limit=batch)
            for past in found:
                _move(db, past, actor, notice, notice_problem, report)
            if len(found) < batch:
                break
            after = (found[-1].deadline, found[-1].id)
    return report


def _move(
    db: Database,
    past: PastDeadline,
    actor: str,
    notice: str | None,
    notice_problem: str | None,
    report: EnforceReport,
) -> None:
    # The move carries the revision the agent was seen at; an agent that only made progress on the same request is
    # read again and the move retried, up to STALE_RETRIES times (docs/explanation/storage-and-jobs.md#deadlines).
    done = report.stopped if past.hard else report.demoted
    for attempt in range(STALE_RETRIES + 1):
        command = _command(past, actor, notice, notice_problem)
        try:
            core.transition(db, command)
            done.append(past.id)
            return
        except StaleRevision as exc:
            stale: Rejected = exc
        except Rejected as exc:  # the agent moved on since we looked; the rejection is journaled
            log.info("deadline move on %s not applied: %s", past.id, exc)
            return
        except Exception as exc:  # one agent's failure must not leave the others past their deadlines
            _failed(db, command, exc, report)
            return
        try:
            again = seen_again(db, past, [p.value for p in ACTIVE]) if attempt < STALE_RETRIES else None
        except Exception as exc:
            _failed(db, command, exc, report)
            return
        if again is None or again.revision == past.revision:
            log.info("deadline move on %s not applied: %s", past.id, stale)
            return
        past = again  # the same request, still past the same deadline: moved on by its own progress


def _failed(db: Database, command: Command, exc: Exception, report: EnforceReport) -> None:
    log.exception("deadline move on %s failed; the pass goes on", command.agent_id)
    report.failed.append(command.agent_id)
    _journal_failure(db, command, exc)


def _command(past: PastDeadline, actor: str, notice: str | None, notice_problem: str | None) -> Command:
    if past.hard:
        return _stop(past.id, actor, notice, notice_problem, past.revision)
    return Command(
        past.id, Event.PROGRESS, actor, expected_revision=past.revision, reason="soft_deadline_passed", priority=LOW
    )


def _notice_template(channel: str | None) -> tuple[str | None, str | None]:
    """The channel to announce stops on, or why it cannot be used (validated settings refuse such a channel at
    start-up; this guards callers that pass one of their own)."""
    if not channel:
        return None, None
    try:
        MessageSpec("slack", channel, "hard-deadline", {"text": "check"})
    except InvalidInput as exc:
        log.error("deadline notices are not sent: %s", exc)
        return None, str(exc)
    return channel, None


def _stop(agent_id: UUID, actor: str, channel: str | None, notice_problem: str | None, revision: int) -> Command:
    notice: tuple[MessageSpec, ...] = ()
    if channel:
        text = f"Keel stopped agent {agent_id}: its request passed its hard deadline. Pending work was cancelled."
        notice = (MessageSpec("slack", channel, "hard-deadline", {"text": text}),)
    details = {"notice_not_sent": notice_problem} if notice_problem else {}
    return Command(
        agent_id,
        Event.FAIL,
        actor,
        expected_revision=revision,
        reason="hard_deadline_passed",
        messages=notice,
        details=details,
    )


def _journal_failure(db: Database, command: Command, exc: Exception) -> None:
    """Put the failed move on the agent's record, once per distinct error: a failure that repeats every pass
    is logged every pass but journaled only when it first appears (the journal is append-only)."""
    error = " ".join(f"{type(exc).__name__}: {exc}".split())[:ERROR_TEXT_LIMIT]
    details = {"error": error, "move": command.reason}
    try:
        last = last_event(db, command.agent_id)
        if last is not None and (last["kind"], last["decision"], last["details"]) == (
            "rejected",
            ENFORCEMENT_FAILED,
            details,
        ):
            return
        core.record_side_event(
            db,
            command.agent_id,
            kind="rejected",
            event=command.event.value,
            actor=command.actor,
            decision=ENFORCEMENT_FAILED,
            details=details,
        )
    except Exception:  # the database itself may be what failed; the log has it, the next pass tries again
        log.exception("could not journal the failed deadline move on %s", command.agent_id)
