"""The beat dispatcher: Postgres decides what is due, Redis only carries it.

Every ``KEEL_DISPATCH_INTERVAL_SECONDS`` the beat leader fires due schedules and publishes due jobs (task id = key):
new ones whose ``run_at`` has come, enqueued ones whose message never got claimed (the broker lost it), and running
ones whose lease expired (the worker died). Nothing is ever put on Redis with an ETA. Claims use
``FOR UPDATE SKIP LOCKED``, so two dispatchers never publish the same row at once; a lease on the database's clock
keeps a single beat leader anyway (tasks/leadership.py): a beat that stops hands leadership over at once, one that
dies within ``KEEL_BEAT_LEASE_SECONDS``.

Each tick the leader also records its heartbeat and, at their own intervals, evaluates the alerts, runs the periodic
audit verify and posts the daily KPI report (tasks/leader.py).

Every ``KEEL_APPROVAL_CHECK_SECONDS`` it applies tools' approval timeouts (agents/runtime/approvals.py): a call
that waited too long is rejected or escalated, once.

Every ``KEEL_DEADLINE_CHECK_SECONDS`` the leader also enforces deadlines, in the beat process itself: a deadline
must bite even when every worker is busy with the very job that overran it. Every ``KEEL_KPI_FOLD_SECONDS`` it folds
the KPI counters' deltas into their rollups (models/kpi_sql.py); a fold that fails never stops dispatching.

When the database (or the broker) cannot be reached, beat says so once ("database down: …; retrying with
backoff"), tries again with exponential backoff, and says so once more when it is back: no traceback per tick.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
from celery import Celery
from celery.beat import ScheduleEntry, Scheduler

from agents.core.outage import Outage, is_outage
from agents.core.redaction import register_settings
from agents.core.transition import store_errors
from agents.jobs import deadlines, schedules
from agents.runtime import approvals
from models.db import Database
from models.jobs_sql import take_due
from models.kpi_sql import fold
from models.settings import Settings
from tasks.app import broker_error, is_broker_outage, publish
from tasks.leader import LeaderDuties
from tasks.leadership import Leadership

log = logging.getLogger("keel.dispatcher")
celery_beat_log = logging.getLogger("celery.beat")  # its "Sending due task" line: DEBUG for housekeeping tasks


@dataclass(frozen=True, slots=True)
class DispatchReport:
    published: int
    recovered: int
    fired: int


def dispatch_once(db: Database, celery: Celery, settings: Settings) -> DispatchReport:
    """One pass: fire due schedules, then publish due jobs in batches until none are left (on the database's
    clock, whatever this host's says)."""
    try:
        fired = schedules.fire_due(db)
    except Exception as exc:  # schedules must never stop the jobs from moving
        if is_outage(exc):
            raise  # neither can the jobs, then
        log.exception("firing schedules failed; jobs are dispatched anyway")
        fired = []
    published = recovered = 0
    timeout = timedelta(seconds=settings.enqueue_timeout_seconds)
    while True:
        with store_errors(), db.transaction() as cur:
            due = take_due(cur, enqueue_timeout=timeout, limit=settings.dispatch_batch)
            # Published inside the transaction: if publishing fails, the rows stay due for the next pass. If the
            # commit fails after publishing, the next pass publishes again and the claim suppresses the duplicate.
            publish(due, celery)
        published += len(due)
        recovered += sum(1 for d in due if d.recovered)
        if len(due) < settings.dispatch_batch:
            break
    if recovered:
        log.warning("recovered %d jobs whose worker died or whose message was lost", recovered)
    return DispatchReport(published, recovered, len(fired))


class KeelScheduler(Scheduler):  # type: ignore[misc]
    """Celery beat's scheduler plus the dispatcher. Only the leader dispatches or sends periodic tasks.

    In-memory on purpose: what is due lives in Postgres, so beat keeps no schedule file of its own.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.settings = Settings()
        self.db = Database.from_settings(self.settings, pool_size=self.settings.db_pool_size_beat)
        register_settings(self.settings)  # again: opening the database may have generated the development audit key
        self.leadership = Leadership(self.db.libpq_url, self.settings)
        self.duties = LeaderDuties(self.db, self.settings)
        self.database = Outage("database", log, first=self.settings.dispatch_interval_seconds)
        self.broker = Outage("broker", log, first=self.settings.dispatch_interval_seconds)
        self._next_deadline_check = 0.0
        self._next_fold = 0.0
        self._next_approval_check = 0.0
        super().__init__(*args, **kwargs)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        interval = self.settings.dispatch_interval_seconds
        backoff = max(self.database.wait(), self.broker.wait())
        if backoff:
            return backoff
        try:
            leader = self.leadership.held()
        except psycopg.Error as exc:
            return self.database.failed(exc)
        self.database.recovered()
        if not leader:
            self.duties.stand_down()
            return interval
        started = time.monotonic()
        try:
            report = dispatch_once(self.db, self.app, self.settings)
            if report.published:  # (a pass that published nothing did not reach the broker: it says nothing of it)
                self.broker.recovered()
            if report.published or report.fired:
                log.info(
                    "dispatched %d jobs (%d recovered), fired %d schedules",
                    report.published,
                    report.recovered,
                    report.fired,
                )
        except Exception as exc:  # beat must outlive a database or broker outage; the rows stay due
            if is_outage(exc):
                return self.database.failed(exc)
            if is_broker_outage(exc):
                return self.broker.failed(broker_error(exc) or exc)
            log.exception("dispatch pass failed; retrying next tick")
        if started >= self._next_deadline_check:
            self._next_deadline_check = started + self.settings.deadline_check_seconds
            try:
                # On the database's clock, not this host's; each agent on its own (one failure is journaled on
                # that agent and the others go on).
                enforced = deadlines.enforce(self.db, notify_slack_channel=self.settings.notify_slack_channel)
                if enforced.demoted or enforced.stopped or enforced.failed:
                    log.info(
                        "deadlines: %d agents demoted, %d stopped, %d failed",
                        len(enforced.demoted),
                        len(enforced.stopped),
                        len(enforced.failed),
                    )
            except Exception as exc:  # the scan itself failed: nobody was skipped for another's sake
                if is_outage(exc):
                    return self.database.failed(exc)
                log.exception("deadline pass failed; retrying next tick")
        if started >= self._next_approval_check:
            self._next_approval_check = started + self.settings.approval_check_seconds
            try:
                # Tools' approval timeouts, on the database's clock: reject (the model is told) or escalate (once).
                timed_out = approvals.enforce_timeouts(self.db, self.settings)
                if timed_out.rejected or timed_out.escalated or timed_out.failed:
                    log.info(
                        "approval timeouts: %d calls rejected, %d escalated, %d failed",
                        len(timed_out.rejected),
                        len(timed_out.escalated),
                        len(timed_out.failed),
                    )
            except Exception as exc:  # the scan itself failed; dispatching goes on
                if is_outage(exc):
                    return self.database.failed(exc)
                log.exception("approval timeout pass failed; retrying next tick")
        if started >= self._next_fold:
            self._next_fold = started + self.settings.kpi_fold_seconds
            self._fold_kpis()
        try:
            # Heartbeat, alerts, periodic audit verify, daily KPI report: each at its own interval on the
            # database's clock; a failure of theirs never stops the dispatcher.
            self.duties.tick(self.leadership.terms)
        except Exception as exc:
            if is_outage(exc):
                return self.database.failed(exc)
            log.exception("leader duties failed; retrying next tick")
        spent = time.monotonic() - started
        # Beat's producer connects the first time it is used. Here, not inside Celery's tick: that one has taken the
        # due entry off its heap by then, and would lose it (the relay's pass, for good) if connecting failed.
        try:
            self.producer  # noqa: B018
        except Exception as exc:
            cause = broker_error(exc)
            if cause is None:
                raise
            return self.broker.failed(cause)
        next_periodic: float = super().tick(*args, **kwargs)
        return max(0.01, min(next_periodic, interval - spent))

    def _fold_kpis(self) -> None:
        """Fold the KPI counters' deltas (the readers count unfolded ones too: a fold that fails only waits)."""
        try:
            folded = fold(self.db, retention=timedelta(days=self.settings.kpi_retention_days))
        except Exception as exc:
            if is_outage(exc):
                return  # the dispatch pass above says so
            log.exception("folding the KPI counters failed; retrying in %gs", self.settings.kpi_fold_seconds)
            return
        if folded:
            log.debug("folded %d KPI deltas", folded)

    def _ensure_connected(self) -> Any:
        """One attempt to connect. Celery retries here for as long as the broker is away, a line per retry, with
        the whole beat (the dispatcher and deadline enforcement too) waiting inside; :meth:`tick` backs off."""
        return self.connection.ensure_connection(max_retries=0)

    def apply_entry(self, entry: ScheduleEntry, producer: Any = None) -> None:
        """Send a periodic task (the outbox relay's pass). Celery would log "Couldn't apply scheduled task" with a
        traceback on every failed send, twice a second while Redis is away: an outage is one line going and one
        coming back, and beat waits with backoff in between (the pass it missed is not owed: the next one does it)."""
        celery_beat_log.info("Scheduler: Sending due task %s (%s)", entry.name, entry.task)
        try:
            self.apply_async(entry, producer=producer, advance=False)
        except Exception as exc:
            cause = broker_error(exc)
            if cause is None:
                log.exception("periodic task %s could not be sent", entry.name)
            else:
                self.broker.failed(cause)
            return
        self.broker.recovered()

    def close(self) -> None:
        self.leadership.release()
        self.db.dispose()
        super().close()
