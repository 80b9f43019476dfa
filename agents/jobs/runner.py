"""Running one job: claim it (a delivery that finds it running under a live lease, or finished, is suppressed:
counted on the job, journaled on the agent), check the agent may spend, run its handler under a renewed lease, and
write the outcome through ``transition()`` only while this worker's fencing token is still the job's. Knows nothing
of Celery: ``tasks/jobs.py`` calls :meth:`Runner.run` with the task id."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from contextvars import copy_context
from dataclasses import dataclass, field, replace
from datetime import timedelta
from decimal import Decimal
from typing import Any, cast

from agents.core import transition as core
from agents.core.commands import ACCEPTED, Command, JobOutcome, Usage, check_json_text
from agents.core.errors import (
    AgentNotFound,
    FencedOff,
    HardDeadlinePassed,
    IllegalTransition,
    InvalidInput,
    InvalidJob,
    JobError,
    KeelError,
)
from agents.core.keys import request_id_of, split_key
from agents.core.observe import observe
from agents.core.outage import Outage, is_outage
from agents.core.phases import RESTING, Event, Phase
from agents.core.policies import ErrorClass, GiveUp, RetryRule, decide_retry, over_budget, past
from agents.jobs.handler_threads import STUCK, HandlerThreads, StuckWork
from agents.jobs.handlers import FencedDatabase, JobContext, JobResult, Registry
from agents.jobs.leases import LeaseKeeper
from models.db import Database
from models.dispatch_sql import Due
from models.jobs_sql import (
    ClaimedJob,
    JobStatus,
    checkpoint,
    claim,
    count_suppressed_txn,
    drop_result_fields_txn,
    job_row,
    release_staged_txn,
)

log = logging.getLogger("keel.runner")


#: The key under which a step's whole outcome is checkpointed (in ``jobs.result``) before it is recorded.
STAGED = "staged"


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """What happened to one delivery of a job."""

    key: str
    status: str  # succeeded, retrying, dead, failed, cancelled, suppressed, fenced, missing
    detail: str = ""
    to_publish: tuple[Due, ...] = ()
    #: Work past its limit that nothing can stop still runs in this process, as much as it may hold
    #: (``stuck_limit``): the caller must replace this process.
    end_process: bool = False
    #: The agent the job belongs to, once its claim found it (for the caller's lines about the job).
    agent_id: str | None = None


@dataclass(frozen=True, slots=True)
class _Failure:
    error_class: ErrorClass
    message: str
    usage: Usage
    retry_after: float | None
    #: The journaled decision if this failure ends the request (None: the retry policy's), and facts to journal.
    decision: str | None = None
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "error_class": self.error_class.value,
            "message": self.message,
            "usage": {"tokens": self.usage.tokens, "cost": str(self.usage.cost)},
            "retry_after": self.retry_after,
            "decision": self.decision,
            "details": dict(self.details),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> _Failure:
        usage = data.get("usage") or {}
        return cls(
            ErrorClass(data["error_class"]),
            str(data["message"]),
            Usage(int(usage.get("tokens", 0)), Decimal(str(usage.get("cost", "0")))),
            data.get("retry_after"),
            data.get("decision"),
            dict(data.get("details") or {}),
        )


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
        run_limits: Mapping[str, float] | None = None,
        default_run_limit: float = 900.0,
        outage: Outage | None = None,
        stuck_limit: int = 1,
        stuck: StuckWork = STUCK,
    ) -> None:
        self.db = db
        self.registry = registry
        self.worker = worker
        self.lease = lease
        self.rules = rules
        self.publish_due = publish_due  # the caller publishes next jobs right after commit
        # What this process knows of the database being away (shared with whatever else it runs: the relay).
        self.outage = outage or Outage("database", log)
        # On a connection of its own: a renewal waiting behind the jobs for one of theirs could let every lease run out.
        self.leases = LeaseKeeper(db.sibling(1), lease, self.outage)
        self.stuck = stuck
        self.threads = HandlerThreads(stuck)
        # How much stuck work this process may carry before it is replaced: 1 where a process runs one job (prefork,
        # solo: ending it ends the work), KEEL_WORKER_STUCK_LIMIT where it runs hundreds (threads).
        self.stuck_limit = stuck_limit
        self.run_limits = dict(run_limits or {})
        self.default_run_limit = default_run_limit

    @property
    def actor(self) -> str:
        return f"worker:{self.worker}"

    def run_limit(self, operation: str) -> float:
        """How long one attempt of ``operation`` may run before it is ended (``KEEL_RUN_LIMITS``)."""
        return self.run_limits.get(operation, self.default_run_limit)

    def run(self, key: str) -> RunOutcome:
        try:
            _, operation, _ = split_key(key)
            request_id: str | None = request_id_of(key)
        except ValueError:
            request_id, operation = None, "unknown"
        # Claimed before the run is observed: the job's stored traceparent (the trace of the work that scheduled
        # it, also for a retry or a redelivery) is what the run continues, and a span's parent is fixed at its start.
        claimed = claim(self.db, key, self.worker, self.lease)
        with observe(
            "job",
            operation,
            job_key=key,
            request_id=request_id,
            actor=self.actor,
            agent_id=None if claimed is None else claimed.agent_id,
            traceparent=None if claimed is None else claimed.traceparent,
        ) as op:
            outcome = self._run(key, claimed)
            op.outcome = outcome.status
            return replace(outcome, agent_id=op.context.get("agent_id"))

    def _run(self, key: str, claimed: ClaimedJob | JobStatus | None) -> RunOutcome:
        if claimed is None:
            log.warning("job %s: no such job; message dropped", key)
            return RunOutcome(key, "missing")
        if not isinstance(claimed, ClaimedJob):
            reason = "duplicate_delivery" if claimed.status != "pending" else "not_due_yet"
            try:
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
            except AgentNotFound as exc:  # a late copy of a deleted agent's finished job: its chain is closed
                log.info("job %s: %s; message dropped", key, exc)
                return RunOutcome(key, "suppressed", f"{reason}: job is {claimed.status}, its agent was deleted")
            return RunOutcome(key, "suppressed", f"{reason}: job is {claimed.status}")
        job = claimed
        lost = threading.Event()
        abandoned = threading.Event()
        # The lease is renewed until the outcome is written, not just while the handler runs.
        with self.leases.hold(job.key, job.fencing_token, lost):
            try:
                outcome = self._run_claimed(job, lost, abandoned)
            except Exception as exc:  # a bug in a handler's result must not leave the job running forever
                if is_outage(exc):
                    raise  # the database is away: the lease will expire and the job be recovered (and counted)
                # The database refused the outcome itself (a value it cannot store, a constraint): retrying or
                # replaying it cannot help, so the job fails as invalid, with nothing of the refused outcome but
                # its spend (if it was staged: what was spent was spent).
                log.exception("job %s: its outcome could not be recorded", job.key)
                message = _storable(f"outcome could not be recorded: {exc!r}")
                spend = self._staged_spend(job.key)
                failure = _Failure(ErrorClass.INVALID, message, spend or Usage(), None)
                # Staged: whoever takes the outcome out of the job charges its spend (a sweep may, meanwhile).
                outcome = self._fail(job, failure, staged=spend is not None)
        if abandoned.is_set() and self.stuck.count() >= self.stuck_limit:
            # Work that nothing can stop still runs on threads of this process, as much as it may hold: replace it.
            return replace(outcome, end_process=True)
        return outcome

    def _run_claimed(self, job: ClaimedJob, lost: threading.Event, abandoned: threading.Event) -> RunOutcome:
        staged = (job.checkpoint or {}).get(STAGED)
        lost_runs = job.error_attempts.get(ErrorClass.UNKNOWN.value, 0)
        if lost_runs >= self.rules[ErrorClass.UNKNOWN].max_attempts:  # its workers kept dying under it
            # A staged outcome that could not be recorded that many times is given up too; what it spent is charged.
            spend = _staged_usage(staged)
            return self._stop_agent(
                job, "unknown_cap_reached", "dead", ErrorClass.UNKNOWN, spend=spend, staged=staged is not None
            )
        if staged is not None:
            # An earlier attempt finished this step and staged its whole outcome, but died before recording it:
            # record exactly that (same keys, same messages, same usage), without running the step again.
            log.info("job %s: replaying the outcome an earlier attempt staged", job.key)
            return self._replay(job, staged)
        stop = self._preflight(job)
        if stop is not None:
            return stop
        failure, result = self._execute(job, lost, abandoned)
        if failure is None:
            assert result is not None
            try:  # what the database cannot store (NUL, a lone surrogate) fails the step now, charged, not later
                check_json_text("the step's result", result.to_json())
            except InvalidInput as exc:
                failure = _Failure(ErrorClass.INVALID, str(exc), result.usage, None)
        repeatable = self.registry.repeatable(job.operation)
        if failure is None:
            assert result is not None
            if not _worth_staging(repeatable, result.usage, result.messages):
                return self._succeed(job, result)
            if not self._stage(job, {"result": result.to_json()}):
                return self._fenced(job, "the job's claim was lost before its outcome was staged", result.usage)
            return self._succeed(job, result, staged=True)
        if not _worth_staging(repeatable, failure.usage, ()):
            return self._fail(job, failure)
        if not self._stage(job, {"failure": failure.to_json()}):
            return self._fenced(job, "the job's claim was lost before its outcome was staged", failure.usage)
        return self._fail(job, failure, staged=True)

    def _staged_spend(self, key: str) -> Usage | None:
        """The spend of the outcome staged on job ``key``; None if none is staged."""
        row = job_row(self.db, key)
        staged = ((row or {}).get("result") or {}).get(STAGED)
        if staged is None:
            return None
        try:
            return _staged_usage(staged)
        except (KeyError, TypeError, ValueError, KeelError):
            return Usage()

    def _stage(self, job: ClaimedJob, outcome: dict[str, Any]) -> bool:
        """Checkpoint the whole outcome under the claim's token before the transition that records it."""
        return checkpoint(self.db, job.key, job.fencing_token, {STAGED: outcome})

    def _replay(self, job: ClaimedJob, staged: Mapping[str, Any]) -> RunOutcome:
        if "result" in staged:
            return self._succeed(job, JobResult.from_json(staged["result"]), staged=True)
        return self._fail(job, _Failure.from_json(staged["failure"]), staged=True)

    # --- before the handler -----------------------------------------------------------------------------------

    def _preflight(self, job: ClaimedJob) -> RunOutcome | None:
        at = job.claimed_at  # the database's clock at the claim
        if Phase(job.agent_phase) in RESTING:
            # Unreachable by design (coming to rest cancels every live job in the same transaction); if it happens
            # anyway, the job is settled by the single writer, and journaled, like everything else.
            outcome = JobOutcome(job.key, job.fencing_token, "cancelled", error=f"agent is {job.agent_phase}")
            command = Command(
                job.agent_id,
                Event.CHARGE,
                self.actor,
                reason="agent_at_rest",
                details={"job": job.key},
                outcome=outcome,
            )
            return self._record(job, command, "cancelled", f"agent is {job.agent_phase}")
        if past(job.hard_deadline, at):
            return self._stop_agent(job, "hard_deadline_passed", "cancelled", None)
        if over_budget(
            spent_tokens=job.spent_tokens,
            spent_cost=job.spent_cost,
            budget_tokens=job.budget_tokens,
            budget_cost=job.budget_cost,
        ):
            return self._stop_agent(job, "budget_exhausted", "failed", ErrorClass.BUDGET)
        return None

    def _stop_agent(
        self,
        job: ClaimedJob,
        reason: str,
        status: str,
        error_class: ErrorClass | None,
        *,
        spend: Usage | None = None,
        error: str | None = None,
        staged: bool = False,
    ) -> RunOutcome:
        spend = spend or Usage()
        outcome = JobOutcome(
            job.key,
            job.fencing_token,
            status,
            failed_usage=spend,
            error=error or f"not started: {reason}",
            error_class=None if error_class is None else error_class.value,
        )
        command = Command(
            job.agent_id,
            Event.FAIL,
            self.actor,
            reason=reason,
            spend=spend,
            details={"job": job.key},
            outcome=outcome,
        )
        return self._record(job, command, status, reason, staged=staged)

    # --- the handler ------------------------------------------------------------------------------------------

    def _execute(
        self, job: ClaimedJob, lost: threading.Event, abandoned: threading.Event
    ) -> tuple[_Failure | None, JobResult | None]:
        handler = self.registry.get(job.operation)
        if handler is None:
            known = ", ".join(self.registry.operations()) or "none"
            error = InvalidJob(
                f"no handler is registered for operation {job.operation!r} in this worker (registered: {known}): a"
                " worker imports KEEL_IMPORTS when it starts, so restart it (keel up) after adding a handler"
            )
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
            # Refused once ``lost`` is set: a handler left running past its limit cannot act through Keel.
            db=cast(Database, FencedDatabase(self.db, job.key, lost)),
            lost=lost,
            checkpointed=job.checkpoint,
            abandoned=abandoned,
        )
        # The handler runs on a thread of its own so that its run limit holds even when it never returns.
        box: list[tuple[_Failure | None, JobResult | None]] = []

        def call() -> None:
            try:
                result = handler(context)
            except Exception as exc:  # every failure is classified, none crashes the worker
                # A JobError is the handler saying how it failed, and an outage is said once elsewhere; anything
                # else is most likely a bug in the handler, whose traceback its author needs.
                bug = not isinstance(exc, JobError) and not is_outage(exc)
                log.info("job %s failed: %r", job.key, exc, exc_info=bug)
                box.append((self._classify(exc), None))
                return
            if not isinstance(result, JobResult):
                failure = self._classify(InvalidJob(f"handler returned {type(result).__name__}, not JobResult"))
                box.append((failure, None))
                return
            box.append((None, result))

        limit = self.run_limit(job.operation)
        # In this context: the handler's model and tool calls belong to this job's run (its span, its log context).
        finished = self.threads.run(f"keel-job-{job.operation}", copy_context(), call, limit)
        if finished and not box:  # it raised past Exception (its thread logged it): no result, nothing left running
            message = "the handler ended with an exception it did not catch (the worker's log has it)"
            return _Failure(ErrorClass.UNKNOWN, message, Usage(), None), None
        if not finished:
            lost.set()  # a cooperative handler stops; one that does not is fenced off (and counted as stuck)
            abandoned.set()
            message = (
                f"ran past its run limit of {limit:g}s (KEEL_RUN_LIMITS); the attempt was fenced off, its outcome is"
                " unknown"
            )
            log.warning("job %s: %s", job.key, message)
            return _Failure(ErrorClass.UNKNOWN, message, Usage(), None), None
        return box[0]

    @staticmethod
    def _classify(exc: BaseException) -> _Failure:
        if isinstance(exc, JobError):
            usage = exc.usage if isinstance(exc.usage, Usage) else Usage()
            return _Failure(
                ErrorClass(exc.error_class), _storable(str(exc)), usage, exc.retry_after, exc.decision, exc.details
            )
        return _Failure(ErrorClass.UNKNOWN, _storable(f"{type(exc).__name__}: {exc}"), Usage(), None)

    # --- outcomes ---------------------------------------------------------------------------------------------

    def _succeed(self, job: ClaimedJob, result: JobResult, *, staged: bool = False) -> RunOutcome:
        outcome = JobOutcome(job.key, job.fencing_token, "succeeded", result=dict(result.output), usage=result.usage)
        command = Command(
            job.agent_id,
            result.event or Event.PROGRESS,
            self.actor,
            spend=result.usage,
            jobs=result.jobs,
            messages=result.messages,
            join=result.join,
            reason=result.decision or ACCEPTED,
            details={**result.details, "job": job.key, "attempt": job.attempts},
            outcome=outcome,
        )
        # In the transaction that records the result: its replay drops them too, a failure to record it does not.
        effects = _dropping(job.request_id, result.drops) if result.drops else None
        try:
            done = core.transition(self.db, command, effects=effects, publish_due=self.publish_due)
        except IllegalTransition as exc:
            if Phase(exc.phase) in RESTING:
                return self._fenced(
                    job, f"agent is {exc.phase}; the outcome came too late", result.usage, staged=staged
                )
            failure = _Failure(ErrorClass.INVALID, f"handler asked for an illegal move: {exc}", result.usage, None)
            return self._fail(job, failure, staged=staged)
        except FencedOff:
            return self._fenced(
                job, "the job's lease was taken over before its outcome was written", result.usage, staged=staged
            )
        except HardDeadlinePassed:
            return self._stop_agent(
                job,
                "hard_deadline_passed",
                "cancelled",
                None,
                spend=result.usage,
                error="finished after the hard deadline: its result was discarded",
                staged=staged,
            )
        return RunOutcome(job.key, "succeeded", to_publish=done.to_publish)

    def _fail(self, job: ClaimedJob, failure: _Failure, *, staged: bool = False) -> RunOutcome:
        failures = job.error_attempts.get(failure.error_class.value, 0) + 1
        decision = decide_retry(failure.error_class, failures, retry_after=failure.retry_after, rules=self.rules)
        message = failure.message[:2000]
        details = {
            "job": job.key,
            "attempt": job.attempts,
            "error_class": failure.error_class.value,
            "error": message,
            **failure.details,
        }
        common = {
            "failed_usage": failure.usage,
            "error": message,
            "error_class": failure.error_class.value,
            "error_attempts": {**job.error_attempts, failure.error_class.value: failures},
        }
        if isinstance(decision, GiveUp):
            status = "dead" if decision.reason.endswith("_cap_reached") else "failed"
            outcome = JobOutcome(job.key, job.fencing_token, status, **common)  # type: ignore[arg-type]
            command = Command(
                job.agent_id,
                Event.FAIL,
                self.actor,
                reason=failure.decision or decision.reason,
                spend=failure.usage,
                details=details,
                outcome=outcome,
            )
            return self._record(job, command, status, failure.decision or decision.reason, staged=staged)
        outcome = JobOutcome(
            job.key,
            job.fencing_token,
            "pending",
            retry_delay=decision.delay,
            **common,  # type: ignore[arg-type]
        )
        retry_in = round(decision.delay.total_seconds(), 3)
        command = Command(
            job.agent_id,
            Event.PROGRESS,
            self.actor,
            reason="retry_scheduled",
            spend=failure.usage,
            details={**details, "retry_in_seconds": retry_in},
            outcome=outcome,
        )
        return self._record(job, command, "retrying", f"retry in {retry_in:g}s", staged=staged)

    def _record(
        self, job: ClaimedJob, command: Command, status: str, detail: str, *, staged: bool = False
    ) -> RunOutcome:
        """Write a failure or a stop through transition(); a lost race means this worker's outcome is void."""
        try:
            core.transition(self.db, command)
        except FencedOff:
            why = "the job's lease was taken over before its outcome was written"
            return self._fenced(job, why, command.spend, staged=staged)
        except HardDeadlinePassed:
            return self._stop_agent(job, "hard_deadline_passed", "cancelled", None, spend=command.spend, staged=staged)
        except IllegalTransition as exc:
            return self._fenced(job, f"agent moved on: {exc}", command.spend, staged=staged)
        return RunOutcome(job.key, status, detail)

    def _fenced(self, job: ClaimedJob, why: str, spend: Usage, *, staged: bool = False) -> RunOutcome:
        """This worker's outcome is void. What it spent was still spent: that is charged, and journaled — once.

        A ``staged`` outcome carries its spend with it, and whoever takes it out of its job charges it: the attempt
        that records it if the job is live again (another claim took it over); the cancel, stop or rejection that ended
        the job (agents/core/transition.py); here, only if the job ended otherwise with it still in place.
        """
        log.warning("job %s: outcome discarded: %s", job.key, why)
        details = {"job": job.key, "fencing_token": job.fencing_token, "why": why}

        def take_staged(cur: Any, before: Any, after: Any) -> dict[str, Any]:
            if not release_staged_txn(cur, job.key):
                raise _ChargedElsewhere
            return {"staged_outcome_charged": True}

        try:
            if spend:
                try:
                    core.transition(
                        self.db,
                        Command(
                            job.agent_id, Event.CHARGE, self.actor, reason="fenced_off", spend=spend, details=details
                        ),
                        effects=take_staged if staged else None,
                    )
                    return RunOutcome(job.key, "fenced", why)
                except _ChargedElsewhere:
                    details["spend"] = "charged with the staged outcome (by the attempt that records it, or the sweep)"
            core.record_side_event(
                self.db,
                job.agent_id,
                kind="suppressed",
                event="job_outcome",
                actor=self.actor,
                decision="fenced_off",
                details=details,
            )
        except KeelError:
            log.exception("job %s: could not journal the fenced-off outcome", job.key)
        return RunOutcome(job.key, "fenced", why)


def _worth_staging(repeatable: bool, usage: Usage, messages: tuple[Any, ...]) -> bool:
    """Whether an outcome is staged (its own commit) before the transition that records it: always, unless its
    handler said running it again does no harm (``repeatable``) and the outcome itself spent nothing (``usage``: a
    reply paid for) and declared nothing to send (``messages``). Such an outcome, if recording it fails, is produced
    again by running the step again, as after a crash mid-step: the same keys, so the same jobs and messages, nothing
    paid twice. A model call (its reply differs, and it is paid) or a tool call (it may have acted) is always staged.
    Which commits each guarantee needs: docs/explanation/storage-and-jobs.md#the-commits-of-one-job."""
    return not repeatable or bool(usage) or bool(messages)


def _dropping(request_id: str, drops: tuple[tuple[str, str], ...]) -> core.EffectsTxn:
    """The effect of a result's ``drops``: fields of its request's earlier steps' results it supersedes."""

    def effects(cur: Any, before: Any, after: Any) -> None:
        drop_result_fields_txn(cur, before.id, request_id, drops)

    return effects


def _storable(text: str) -> str:
    """An error text PostgreSQL can store and the journal can hold: no NUL, no lone surrogate, bounded."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")[:2000]


class _ChargedElsewhere(Exception):
    """The staged outcome's spend will be (or was) charged by whoever took it out of its job."""


def _staged_usage(staged: Mapping[str, Any] | None) -> Usage:
    """The spend a staged outcome carries (of its result, or of its failure)."""
    if not staged:
        return Usage()
    if "result" in staged:
        return JobResult.from_json(staged["result"]).usage
    return _Failure.from_json(staged["failure"]).usage
