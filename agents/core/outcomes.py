"""A job's outcome as a transition writes it: finished or due again, under the job's fencing token, and the spend
of staged outcomes that a sweep took out of their jobs."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime
from typing import Any

import psycopg

from agents.core import approval_notices
from agents.core.commands import LOW, Command, JobOutcome, Usage
from agents.core.errors import FencedOff, InvalidInput
from agents.core.phases import RESTING, Phase
from agents.core.redaction import redact
from models.jobs_sql import charge_void_attempt_txn, finish_params, finish_txn, retry_txn
from models.schemas import AgentRow

log = logging.getLogger("keel.core")


def charge_staged_txn(
    cur: psycopg.Cursor[Any], after: AgentRow, staged: Mapping[str, Any]
) -> tuple[AgentRow, dict[str, Any] | None]:
    """Charge the spend of the staged outcomes a sweep took out of their jobs (their workers died, or will find
    themselves fenced off): no attempt will record them now, and what they spent was spent. Charged to the agent, and
    recorded on each job as the spend of a void attempt; once, as the outcome left its job in the same transaction.
    Returns the agent's row as charged and what the event says of it (None: nothing to charge)."""
    keys: list[str] = []
    tokens, cost = 0, Usage().cost
    for key, usage in staged.items():
        try:
            spend = Usage.from_json(usage)
        except (AttributeError, TypeError, ValueError, ArithmeticError, InvalidInput):
            log.warning("job %s: its staged outcome's usage cannot be read (%.200r): not charged", key, usage)
            continue
        if not spend:
            continue
        charge_void_attempt_txn(cur, key, spend.tokens, spend.cost)
        keys.append(key)
        tokens, cost = tokens + spend.tokens, cost + spend.cost
    if not keys:
        return after, None
    charged = replace(after, spent_tokens=after.spent_tokens + tokens, spent_cost=after.spent_cost + cost)
    return charged, {"jobs": keys, "tokens": tokens, "cost": str(cost)}


def outcome_goes_with_the_row(
    before: AgentRow, after: AgentRow, command: Command, has_effects: bool, live_jobs: int
) -> bool:
    """Whether a job's final outcome can be written by the statement that writes the event and the row (one round
    trip less): when nothing else this transition writes comes between them — no effects, jobs, messages (nor the
    notices of an undecided approval's end), no sweep of live jobs at rest, no demotion."""
    outcome = command.outcome
    if outcome is None or outcome.leaves_job_live or has_effects or command.jobs or command.messages:
        return False
    if approval_notices.ends_undecided(before, after, command):
        return False
    coming_to_rest = Phase(after.phase) in RESTING and Phase(before.phase) not in RESTING
    if coming_to_rest and live_jobs > 0:
        return False
    return not (after.priority == LOW and before.priority != LOW)


def outcome_finish_params(outcome: JobOutcome, at: datetime) -> tuple[Any, ...]:
    """The final outcome of a job, as written (its error redacted), at ``at``, the database's clock."""
    return finish_params(
        outcome.key,
        outcome.fencing_token,
        status=outcome.status,
        now=at,
        result=None if outcome.result is None else dict(outcome.result),
        tokens=outcome.usage.tokens,
        cost=outcome.usage.cost,
        error=None if outcome.error is None else redact(outcome.error),
        error_class=outcome.error_class,
        failed_tokens=outcome.failed_usage.tokens,
        failed_cost=outcome.failed_usage.cost,
        error_attempts=None if outcome.error_attempts is None else dict(outcome.error_attempts),
    )


def write_outcome_txn(cur: psycopg.Cursor[Any], outcome: JobOutcome, at: datetime, queue: str | None) -> None:
    """Write a job's outcome under its fencing token; raises :class:`~agents.core.errors.FencedOff` if the claim
    is no longer the writer's. A retry is due ``retry_delay`` after ``at``, the database's clock."""
    if outcome.status == "pending":
        assert outcome.retry_delay is not None
        written = retry_txn(
            cur,
            outcome.key,
            outcome.fencing_token,
            run_at=at + outcome.retry_delay,
            now=at,
            error=redact(outcome.error or ""),
            error_class=outcome.error_class or "unknown",
            error_attempts=dict(outcome.error_attempts or {}),
            failed_tokens=outcome.failed_usage.tokens,
            failed_cost=outcome.failed_usage.cost,
            queue=queue,  # a retry of an agent past its soft deadline goes to the low-priority queue
        )
    else:
        written = finish_txn(cur, outcome_finish_params(outcome, at))
    if not written:
        raise FencedOff(outcome.key)
