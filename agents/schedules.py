"""Recurring schedules: every N seconds, or a cron expression, submit a request to an agent.

``ensure_schedule`` is idempotent: registering the same schedule on every restart changes nothing. Each fire is a
submit whose request id is made from the schedule name and the fire time, so a fire that is attempted twice
(two dispatchers, a crash between submit and bookkeeping) is a suppressed duplicate, not a second run.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from croniter import croniter

from agents import core
from agents.commands import Command, JobSpec
from agents.errors import InvalidInput, KeelError, Rejected
from agents.keys import check_request_id
from agents.phases import Event
from models.db import Database

log = logging.getLogger("keel.schedules")


@dataclass(frozen=True, slots=True)
class Schedule:
    name: str
    agent_id: UUID
    every_seconds: int | None
    cron: str | None
    operation: str
    input: Any
    next_fire_at: datetime


def next_fire(*, every_seconds: int | None, cron: str | None, after: datetime) -> datetime:
    """The first fire time strictly after ``after``."""
    if every_seconds is not None:
        return after + timedelta(seconds=every_seconds)
    assert cron is not None
    fire: datetime = croniter(cron, after).get_next(datetime)
    return fire


def fire_request_id(name: str, fire_at: datetime) -> str:
    """The request id of one fire: deterministic from the schedule's name and the fire time."""
    return check_request_id(f"{name}.{fire_at:%Y%m%dT%H%M%SZ}")


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
    a changed definition is updated in place (never a second schedule) and its next fire recomputed."""
    check_request_id(name)
    if len(name) > 100:
        raise InvalidInput(f"schedule name is {len(name)} characters; at most 100 (fire request ids add 17)")
    if (every is None) == (cron is None):
        raise InvalidInput("a schedule needs exactly one of every= or cron=")
    every_seconds = None if every is None else int(every.total_seconds())
    if every_seconds is not None and every_seconds < 1:
        raise InvalidInput("every= must be at least one second")
    if cron is not None and not croniter.is_valid(cron):
        raise InvalidInput(f"cron expression {cron!r} is not valid")
    JobSpec(operation, "1")  # validates the operation name
    at = now or core.now()
    first = next_fire(every_seconds=every_seconds, cron=cron, after=at)
    input_json = json.dumps(input, sort_keys=True)
    with core.store_errors(), db.transaction() as cur:
        cur.execute(
            "INSERT INTO schedules (name, agent_id, every_seconds, cron, operation, input, next_fire_at)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s)"
            " ON CONFLICT (name) DO UPDATE SET agent_id = EXCLUDED.agent_id, every_seconds = EXCLUDED.every_seconds,"
            " cron = EXCLUDED.cron, operation = EXCLUDED.operation, input = EXCLUDED.input,"
            " next_fire_at = EXCLUDED.next_fire_at, updated_at = now()"
            " WHERE (schedules.agent_id, schedules.every_seconds, schedules.cron, schedules.operation, schedules.input)"
            " IS DISTINCT FROM (EXCLUDED.agent_id, EXCLUDED.every_seconds, EXCLUDED.cron, EXCLUDED.operation,"
            " EXCLUDED.input)"
            " RETURNING xmax = 0",
            (name, agent_id, every_seconds, cron, operation, input_json, first),
        )
        changed = cur.fetchone() is not None
        cur.execute(
            "SELECT name, agent_id, every_seconds, cron, operation, input, next_fire_at FROM schedules WHERE name = %s",
            (name,),
        )
        row = cur.fetchone()
    assert row is not None
    return Schedule(*row), changed


def fire_due(db: Database, now: datetime, *, actor: str = "scheduler") -> list[str]:
    """Fire every schedule whose time has come (once, even if several fires were missed) and move it on.
    Returns the request ids submitted. Rows another dispatcher holds are skipped. The fires' jobs are left
    pending for the dispatcher's next pass."""
    fired: list[str] = []
    with core.store_errors(), db.transaction() as cur:
        cur.execute(
            "SELECT name, agent_id, every_seconds, cron, operation, input, next_fire_at FROM schedules"
            " WHERE enabled AND next_fire_at <= %s ORDER BY next_fire_at FOR UPDATE SKIP LOCKED",
            (now,),
        )
        due = [Schedule(*row) for row in cur.fetchall()]
        for schedule in due:
            request_id = fire_request_id(schedule.name, schedule.next_fire_at)
            try:
                outcome = _submit(db, schedule, request_id, actor)
            except KeelError as exc:  # one bad schedule must not stop the others
                log.warning("schedule %s: fire %s failed: %s", schedule.name, request_id, exc)
                outcome = f"failed ({exc})"
            if outcome == "submitted":
                fired.append(request_id)
            following = next_fire(every_seconds=schedule.every_seconds, cron=schedule.cron, after=now)
            cur.execute(
                "UPDATE schedules SET next_fire_at = %s, last_fire_at = %s, last_outcome = %s, updated_at = %s"
                " WHERE name = %s",
                (following, schedule.next_fire_at, f"{request_id}: {outcome}", now, schedule.name),
            )
    return fired


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
