"""Running one job: claim it, check the agent may spend, run its handler under a renewed lease, write the outcome.

The claim makes a job run once per key: a delivery that finds the job running under a live lease, or finished,
is suppressed (counted on the job, journaled on the agent). The outcome is written through ``transition()`` and
only while this worker's fencing token is still the job's; a worker that lost its lease writes nothing.
This module knows nothing of Celery: ``tasks/jobs.py`` calls :meth:`Runner.run` with the task id.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg

from agents import core
from agents.commands import Command, Usage
from agents.errors import HardDeadlinePassed, IllegalTransition, InvalidJob, JobError, KeelError
from agents.handlers import JobContext, JobResult, Registry
from agents.phases import RESTING, Event, Phase
from agents.policies import ErrorClass, GiveUp, RetryRule, decide_retry, over_budget, past
from models.db import Database
from models.jobs_sql import ClaimedJob, Due, FencedOff, claim, count_suppressed_txn, extend_lease, finish_txn, retry_txn
from models.schemas import AgentRow
from models.sql import read_agent

log = logging.getLogger("keel.runner")


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """What happened to one delivery of a job."""

    key: str
    status: str  # succeeded, retrying, dead, failed, cancelled, suppressed, fenced, missing
    detail: str = ""
    to_publish: tuple[Due, ...] = ()


@dataclass(frozen=True, slots=True)
class _Failure:
    error_class: ErrorClass
    message: str
    usage: Usage
    retry_after: float | None


class Runner:
    def __init__(
        self,
        db: Database,
        registry: Registry,
        *,
        worker: str,
        lease: timedelta,
        rules: dict[ErrorClass, RetryRule],
        publish_due: bool = False,
    ) -> None:
        self.db = db
        self.registry = registry
        self.worker = worker
        self.lease = lease
        self.rules = rules
        self.publish_due = publish_due  # the caller publishes next jobs right after commit

    @property
    def actor(self) -> str:
        return f"worker:{self.worker}"

    def run(self, key: str) -> RunOutcome:
        claimed = claim(self.db, key, self.worker, self.lease, core.now())
        if claimed is None:
            log.warning("job %s: no such job; message dropped", key)
            return RunOutcome(key, "missing")
        if not isinstance(claimed, ClaimedJob):
            reason = "duplicate_delivery" if claimed.status != "pending" else "not_due_yet"
            core.record_side_event(
                self.db,
                claimed.agent_id,
                kind="suppressed",
                event="run_job",
                actor=self.actor,
                decision=reason,
                details={"job": key, "status": claimed.status},
                effects=lambda cur: count_suppressed_txn(cur, key),
            )
            return RunOutcome(key, "suppressed", f"{reason}: job is {claimed.status}")
        job = claimed
        agent = read_agent(self.db, job.agent_id)
        assert agent is not None, "jobs reference their agent"
        stop = self._preflight(job, agent)
        if stop is not None:
            return stop
        failure, result = self._execute(job)
        if failure is None:
            assert result is not None
            return self._succeed(job, result)
        return self._fail(job, failure)

    # --- before the handler -----------------------------------------------------------------------------------

    def _preflight(self, job: ClaimedJob, agent: AgentRow) -> RunOutcome | None:
        now = core.now()
        if Phase(agent.phase) in RESTING:
            with self.db.transaction() as cur:
                finish_txn(
                    cur, job.key, job.fencing_token, status="cancelled", now=now, error=f"agent is {agent.phase}"
                )
            return RunOutcome(job.key, "cancelled", f"agent is {agent.phase}")
        if past(agent.hard_deadline, now):
            return self._stop_agent(job, "hard_deadline_passed", "cancelled", None)
        if over_budget(
            spent_tokens=agent.spent_tokens,
            spent_cost=agent.spent_cost,
            budget_tokens=agent.budget_tokens,
            budget_cost=agent.budget_cost,
        ):
            return self._stop_agent(job, "budget_exhausted", "failed", ErrorClass.BUDGET)
        return None

    def _stop_agent(self, job: ClaimedJob, reason: str, status: str, error_class: ErrorClass | None) -> RunOutcome:
        def finish(cur: psycopg.Cursor[Any], before: AgentRow, after: AgentRow) -> dict[str, Any]:
            finish_txn(
                cur,
                job.key,
                job.fencing_token,
                status=status,
                now=after.updated_at,
                error=f"not started: {reason}",
                error_class=None if error_class is None else error_class.value,
            )
            return {"job": job.key, "job_status": status}

        command = Command(job.agent_id, Event.FAIL, self.actor, reason=reason, details={"job": job.key})
        try:
            core.transition(self.db, command, effects=finish)
        except (IllegalTransition, FencedOff) as exc:
            return self._fenced(job, f"agent moved on before {reason} could be applied: {exc}")
        return RunOutcome(job.key, status, reason)

    # --- the handler ------------------------------------------------------------------------------------------

    def _execute(self, job: ClaimedJob) -> tuple[_Failure | None, JobResult | None]:
        handler = self.registry.get(job.operation)
        if handler is None:
            known = ", ".join(self.registry.operations()) or "none"
            error = InvalidJob(f"no handler is registered for operation {job.operation!r} (registered: {known})")
            return self._classify(error), None
        context = JobContext(
            key=job.key,
            agent_id=job.agent_id,
            request_id=job.request_id,
            operation=job.operation,
            target=job.target,
            payload=job.payload,
            attempt=job.attempts,
            fencing_token=job.fencing_token,
            db=self.db,
        )
        with self._heartbeat(job, context.lost):
            try:
                result = handler(context)
            except Exception as exc:  # every failure is classified, none crashes the worker
                log.info("job %s failed: %r", job.key, exc)
                return self._classify(exc), None
        if not isinstance(result, JobResult):
            return self._classify(InvalidJob(f"handler returned {type(result).__name__}, not JobResult")), None
        return None, result

    @staticmethod
    def _classify(exc: BaseException) -> _Failure:
        if isinstance(exc, JobError):
            usage = exc.usage if isinstance(exc.usage, Usage) else Usage()
            return _Failure(ErrorClass(exc.error_class), str(exc), usage, exc.retry_after)
        return _Failure(ErrorClass.UNKNOWN, f"{type(exc).__name__}: {exc}", Usage(), None)

    @contextmanager
    def _heartbeat(self, job: ClaimedJob, lost: threading.Event) -> Iterator[None]:
        """Renew the lease every third of its length while the handler runs; flag ``lost`` if it was taken."""
        done = threading.Event()
        interval = self.lease.total_seconds() / 3

        def beat() -> None:
            while not done.wait(interval):
                try:
                    if not extend_lease(self.db, job.key, job.fencing_token, core.now() + self.lease):
                        lost.set()
                        return
                except psycopg.Error:
                    log.warning("job %s: lease renewal failed; will retry", job.key, exc_info=True)

        thread = threading.Thread(target=beat, name=f"lease:{job.key}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    # --- outcomes ---------------------------------------------------------------------------------------------

    def _succeed(self, job: ClaimedJob, result: JobResult) -> RunOutcome:
        def finish(cur: psycopg.Cursor[Any], before: AgentRow, after: AgentRow) -> dict[str, Any]:
            finish_txn(
                cur,
                job.key,
                job.fencing_token,
                status="succeeded",
                now=after.updated_at,
                result=dict(result.output),
                tokens=result.usage.tokens,
                cost=result.usage.cost,
            )
            return {"job": job.key, "job_status": "succeeded"}

        command = Command(
            job.agent_id,
            result.event or Event.PROGRESS,
            self.actor,
            spend=result.usage,
            jobs=result.jobs,
            details={"job": job.key, "attempt": job.attempts},
        )
        try:
            done = core.transition(self.db, command, effects=finish, publish_due=self.publish_due)
        except FencedOff:
            return self._fenced(job, "the job's lease was taken over before its outcome was written")
        except HardDeadlinePassed:
            return self._stop_agent(job, "hard_deadline_passed", "cancelled", None)
        except IllegalTransition as exc:
            agent = read_agent(self.db, job.agent_id)
            if agent is not None and Phase(agent.phase) in RESTING:
                return self._fenced(job, f"agent is {agent.phase}; the outcome came too late")
            return self._fail(
                job, _Failure(ErrorClass.INVALID, f"handler asked for an illegal move: {exc}", result.usage, None)
            )
        return RunOutcome(job.key, "succeeded", to_publish=done.to_publish)

    def _fail(self, job: ClaimedJob, failure: _Failure) -> RunOutcome:
        failures = job.error_attempts.get(failure.error_class.value, 0) + 1
        decision = decide_retry(failure.error_class, failures, retry_after=failure.retry_after, rules=self.rules)
        error_attempts = {**job.error_attempts, failure.error_class.value: failures}
        details = {
            "job": job.key,
            "attempt": job.attempts,
            "error_class": failure.error_class.value,
            "error": failure.message[:2000],
        }
        now = core.now()
        if isinstance(decision, GiveUp):
            status = "dead" if decision.reason.endswith("_cap_reached") else "failed"

            def give_up(cur: psycopg.Cursor[Any], before: AgentRow, after: AgentRow) -> dict[str, Any]:
                _finish_failed(cur, job, failure, status, error_attempts, after.updated_at)
                return {"job_status": status}

            command = Command(
                job.agent_id, Event.FAIL, self.actor, reason=decision.reason, spend=failure.usage, details=details
            )
            return self._write_failure(job, command, give_up, status, decision.reason)

        run_at = now + decision.delay

        def retry(cur: psycopg.Cursor[Any], before: AgentRow, after: AgentRow) -> dict[str, Any]:
            retry_txn(
                cur,
                job.key,
                job.fencing_token,
                run_at=run_at,
                now=after.updated_at,
                error=failure.message[:2000],
                error_class=failure.error_class.value,
                error_attempts=error_attempts,
                failed_tokens=failure.usage.tokens,
                failed_cost=failure.usage.cost,
            )
            return {"job_status": "pending", "retry_at": run_at.isoformat()}

        command = Command(
            job.agent_id,
            Event.PROGRESS,
            self.actor,
            reason="retry_scheduled",
            spend=failure.usage,
            details={**details, "retry_in_seconds": round(decision.delay.total_seconds(), 3)},
        )
        return self._write_failure(job, command, retry, "retrying", f"retry at {run_at.isoformat()}")

    def _write_failure(
        self, job: ClaimedJob, command: Command, effects: core.EffectsTxn, status: str, detail: str
    ) -> RunOutcome:
        try:
            core.transition(self.db, command, effects=effects)
        except FencedOff:
            return self._fenced(job, "the job's lease was taken over before its failure was written")
        except HardDeadlinePassed:
            return self._stop_agent(job, "hard_deadline_passed", "cancelled", None)
        except IllegalTransition as exc:
            return self._fenced(job, f"agent moved on: {exc}")
        return RunOutcome(job.key, status, detail)

    def _fenced(self, job: ClaimedJob, why: str) -> RunOutcome:
        log.warning("job %s: outcome discarded: %s", job.key, why)
        try:
            core.record_side_event(
                self.db,
                job.agent_id,
                kind="suppressed",
                event="job_outcome",
                actor=self.actor,
                decision="fenced_off",
                details={"job": job.key, "fencing_token": job.fencing_token, "why": why},
            )
        except KeelError:
            log.exception("job %s: could not journal the fenced-off outcome", job.key)
        return RunOutcome(job.key, "fenced", why)


def _finish_failed(
    cur: psycopg.Cursor[Any],
    job: ClaimedJob,
    failure: _Failure,
    status: str,
    error_attempts: dict[str, int],
    now: datetime,
) -> None:
    finish_txn(
        cur,
        job.key,
        job.fencing_token,
        status=status,
        now=now,
        error=failure.message[:2000],
        error_class=failure.error_class.value,
        failed_tokens=failure.usage.tokens,
        failed_cost=Decimal(failure.usage.cost),
        error_attempts=error_attempts,
    )
