"""Recurring schedules: every N seconds, or a cron expression, submit a request to an agent. Registering is
idempotent, and each fire's request id is made from the schedule and the fire time, so a fire attempted twice is a
suppressed duplicate. Times are the database's, in UTC (docs/explanation/storage-and-jobs.md#schedules)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import psycopg
from croniter import croniter

from agents.core import transition as core
from agents.core.commands import Command, JobSpec
from agents.core.errors import InvalidInput, KeelError, Rejected, StoreError
from agents.core.keys import check_request_id
from agents.core.outage import is_outage, statement_failed
from agents.core.phases import Event
from agents.jobs import handlers
from models.clock import database_now, utc
from models.db import Database
from models.schedules_sql import (
    START,
    ScheduleRow,
    agent_archived_txn,
    disable_broken_txn,
    lock_due_schedules_txn,
    record_fire_txn,
    upsert_schedule_txn,
)

log = logging.getLogger("keel.schedules")

#: The longest interval (``schedules.every_seconds`` is an integer column).
MAX_EVERY_SECONDS = 2**31 - 1


@dataclass(frozen=True, slots=True)
class Schedule:
    name: str
    agent_id: UUID
    every_seconds: int | None
    cron: str | None
    operation: str
    input: Any
    next_fire_at: datetime  # UTC

    @classmethod
    def from_row(cls, row: ScheduleRow) -> Schedule:
        return cls(
            name=row.name,
            agent_id=row.agent_id,
            every_seconds=row.every_seconds,
            cron=row.cron,
            operation=row.operation,
            input=row.input,
            next_fire_at=utc(row.next_fire_at),
        )


def next_fire(*, every_seconds: int | None, cron: str | None, after: datetime) -> datetime:
    """The first fire time strictly after ``after``, in UTC. Intervals are exact elapsed seconds; cron fields
    name UTC times."""
    after = utc(after)  # aware arithmetic in a zone with DST is wall-clock arithmetic: never do it there
    if every_seconds is not None:
        return after + timedelta(seconds=every_seconds)
    assert cron is not None
    fire: datetime = croniter(cron, after).get_next(datetime)
    return fire.astimezone(UTC)


def fire_request_id(name: str, fire_at: datetime) -> str:
    """The request id of one fire: deterministic from the schedule's name and the fire time, named in UTC."""
    return check_request_id(f"{name}.{utc(fire_at):%Y%m%dT%H%M%SZ}")


def ensure_schedule(
    db: Database,
    name: str,
    agent_id: UUID,
    *,
    every: timedelta | None = None,
    cron: str | None = None,
    input: Any = None,
    operation: str = "plan",
    now: datetime | None = None,
) -> tuple[Schedule, bool]:
    """Register schedule ``name``; returns it and whether anything changed. Same definition → no change at all;
    a changed definition is updated in place (never a second schedule) and its next fire recomputed from the
    database's clock (``now`` overrides it, for tests)."""
    check_request_id(name)
    if len(name) > 100:
        raise InvalidInput(f"schedule name is {len(name)} characters; at most 100 (fire request ids add 17)")
    if (every is None) == (cron is None):
        raise InvalidInput("a schedule needs exactly one of every= or cron=")
    every_seconds = None if every is None else int(every.total_seconds())
    if every_seconds is not None and not 1 <= every_seconds <= MAX_EVERY_SECONDS:
        raise InvalidInput(f"every= must be from one second to {MAX_EVERY_SECONDS} seconds (68 years), got {every}")
    if cron is not None and not croniter.is_valid(cron):
        raise InvalidInput(f"cron expression {cron!r} is not valid")
    JobSpec(operation, "1")  # validates the operation name
    if handlers.registry.knows(operation):  # (a producer may schedule an operation only its workers have)
        handlers.registry.check_input(operation, input)
    if now is not None and now.tzinfo is None:
        raise InvalidInput("now= must be timezone-aware")
    input_json = json.dumps(input, sort_keys=True)
    with core.store_errors(), db.transaction() as cur:
        at = database_now(cur) if now is None else utc(now)
        row, changed = upsert_schedule_txn(
            cur,
            name=name,
            agent_id=agent_id,
            every_seconds=every_seconds,
            cron=cron,
            operation=operation,
            input_json=input_json,
            first_fire_at=next_fire(every_seconds=every_seconds, cron=cron, after=at),
        )
    return Schedule.from_row(row), changed


#: How many due schedules one transaction of a pass locks and fires (``KEEL_SCHEDULE_BATCH`` in the beat).
DEFAULT_BATCH = 100


def fire_due(
    db: Database, at: datetime | None = None, *, actor: str = "scheduler", batch: int = DEFAULT_BATCH
) -> list[str]:
    """Fire every schedule whose time has come on the database's clock when the pass starts (``at`` overrides it,
    for tests) — once, even if several fires were missed — and move it on. Returns the request ids submitted.
    Schedules are taken ``batch`` at a time, oldest fire first, each batch in a transaction of its own (its locks
    held only while it fires); rows another dispatcher holds are skipped. A fired schedule moves past the pass's
    time, so no batch takes it again. The fires' jobs are left pending for the dispatcher's next pass."""
    if batch < 1:
        raise InvalidInput(f"batch must be at least 1, got {batch}")
    fired: list[str] = []
    now = None if at is None else utc(at)
    after = START
    while True:
        with core.store_errors(), db.transaction() as cur:
            if now is None:
                now = database_now(cur)
            due = lock_due_schedules_txn(cur, now, limit=batch, after=after)
            for schedule in map(Schedule.from_row, due):
                fired.extend(_fire_one_txn(cur, db, schedule, now, actor))
        if len(due) < batch:
            return fired
        after = (due[-1].next_fire_at, due[-1].name)


def _fire_one_txn(cur: Any, db: Database, schedule: Schedule, now: datetime, actor: str) -> list[str]:
    """:func:`_fire_txn` inside a savepoint: a schedule that breaks in a way nobody foresaw (a bug: not an error
    of Keel's, nor of the database's) is recorded failed and moved on, and the others of its batch still fire —
    instead of its exception rolling the whole batch back, on every pass, with it first in line."""
    try:
        with cur.connection.transaction():
            return _fire_txn(cur, db, schedule, now, actor)
    except Exception as exc:
        if isinstance(exc, (psycopg.Error, StoreError)):
            raise  # the database's: the pass reports it, and every fire of the batch stays due
        try:
            request_id = fire_request_id(schedule.name, schedule.next_fire_at)
        except KeelError:
            request_id = schedule.name
        names = (schedule.name, request_id)
        outcome = f"{request_id}: failed (internal error: {type(exc).__name__}: {exc})"[:1000]
        try:
            following = _following(schedule, now)
        except Exception:
            # Its own times cannot be worked out: turned off (its last outcome says why), rather than
            # fired again and again under a new name each time.
            log.exception("schedule %s: fire %s broke and its next fire cannot be worked out; disabled", *names)
            disable_broken_txn(cur, schedule.name, outcome=f"{outcome}; disabled")
            return []
        log.exception("schedule %s: fire %s broke; recorded failed and moved on", *names)
        record_fire_txn(cur, schedule.name, fired_at=schedule.next_fire_at, next_fire_at=following, outcome=outcome)
        return []


def _fire_txn(cur: Any, db: Database, schedule: Schedule, now: datetime, actor: str) -> list[str]:
    """Fire one locked schedule and move it on; the request id submitted, if it was."""
    request_id = fire_request_id(schedule.name, schedule.next_fire_at)
    following = _following(schedule, now)  # before the submit: nothing after it may break but the database
    try:
        if agent_archived_txn(cur, schedule.agent_id):  # moved on, nothing journaled: it is out of use
            outcome = "skipped (the agent is archived)"
        else:
            outcome = _submit(db, schedule, request_id, actor)
    except StoreError as exc:
        if not (is_outage(exc) or statement_failed(exc)):
            log.warning("schedule %s: fire %s failed: %s", schedule.name, request_id, exc)
            outcome = f"failed ({exc})"
        else:
            # The database did not get to answer (away, a statement timeout waiting for the agent's lock, a
            # deadlock): the fire stays due and the next pass tries it again, under the same request id.
            log.warning("schedule %s: fire %s not made, tried again next pass: %s", schedule.name, request_id, exc)
            return []
    except KeelError as exc:  # one bad schedule must not stop the others
        log.warning("schedule %s: fire %s failed: %s", schedule.name, request_id, exc)
        outcome = f"failed ({exc})"
    record_fire_txn(
        cur,
        schedule.name,
        fired_at=schedule.next_fire_at,
        next_fire_at=following,
        outcome=f"{request_id}: {outcome}",
    )
    return [request_id] if outcome == "submitted" else []


def _following(schedule: Schedule, now: datetime) -> datetime:
    """The schedule's first fire after ``now``, on its own grid: an interval schedule stays anchored to its fire
    times (a late pass does not shift every later fire, and so every later fire's name)."""
    if schedule.every_seconds is None:
        return next_fire(every_seconds=None, cron=schedule.cron, after=now)
    missed = (now - schedule.next_fire_at) // timedelta(seconds=schedule.every_seconds)
    return schedule.next_fire_at + (missed + 1) * timedelta(seconds=schedule.every_seconds)


def _submit(db: Database, schedule: Schedule, request_id: str, actor: str) -> str:
    command = Command(
        schedule.agent_id,
        Event.SUBMIT,
        actor,
        request_id=request_id,
        jobs=(JobSpec(schedule.operation, "1", payload={"input": schedule.input}),),
        details={"schedule": schedule.name},
    )
    try:
        result = core.transition(db, command, input_json=json.dumps(schedule.input))
    except Rejected as exc:
        log.info("schedule %s: fire %s skipped: %s", schedule.name, request_id, exc)
        return f"skipped ({exc})"
    return "duplicate" if result.suppressed else "submitted"
