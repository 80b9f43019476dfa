"""The beat dispatcher: PostgreSQL decides what is due, Redis only carries it. Every ``KEEL_DISPATCH_INTERVAL_SECONDS``
the beat leader publishes due jobs (new, lost and lease-expired ones; task id = key), held back by a per-tick cap, a
time budget and each queue's depth, never with an ETA; it also starts the timed passes (tasks/passes.py) and runs the
leader's chores (tasks/leader.py). How and why: docs/explanation/runtime-outbox-and-workers.md#the-beat-dispatcher.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
from celery import Celery
from celery.beat import ScheduleEntry, Scheduler

from agents.core.outage import Outage, unreachable
from agents.core.redaction import register_settings
from agents.core.transition import store_errors
from agents.jobs import deadlines, schedules
from agents.runtime import approvals
from models.db import Database
from models.jobs_sql import queues_with_due, take_due
from models.kpi_sql import fold
from models.settings import Settings
from models.tables import JOB_QUEUES
from tasks.app import (
    OUTBOX_QUEUE,
    QUICK_RETRY,
    RELAY_OUTBOX,
    PastDeadline,
    bounded_app,
    broker_error,
    is_broker_outage,
    publish,
    queue_depths,
)
from tasks.leader import LeaderDuties
from tasks.leadership import Leadership
from tasks.passes import TimedPass

log = logging.getLogger("keel.dispatcher")
celery_beat_log = logging.getLogger("celery.beat")  # its "Sending due task" line: DEBUG for housekeeping tasks

#: How long a closing beat waits for its passes under way, all of them together.
CLOSE_WAIT_SECONDS = 5.0
#: The share of the leader's lease a tick may spend publishing (then the rest waits, due, for the next tick).
PUBLISH_SHARE = 0.5
#: The first batch of a beat with a time budget, before it knows how long a publish takes.
PROBE = 50


@contextmanager
def _stop_signals_ignored() -> Iterator[None]:
    """SIGTERM and SIGINT ignored for the block, then their handlers back (only the main thread may set them: in
    another, as Celery's embedded beat runs, the block runs as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, signal.SIG_IGN)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def beat_broker_timeout(settings: Settings) -> float:
    """How long the beat waits on Redis per attempt (connecting, each command: a queue's depth, a publish, a periodic
    task's send): a tenth of its leader lease, at most a second, so that a tick stays well inside the lease while
    Redis accepts connections but does not answer, and the leader keeps leading (and enforcing deadlines)."""
    return max(0.2, min(1.0, settings.beat_lease_seconds / 10))


@dataclass(frozen=True, slots=True)
class DispatchReport:
    published: int
    recovered: int
    fired: int
    #: What held publishing back, if anything did: "per-tick cap", "time budget", or "queue keel.jobs: N" for each
    #: job queue at KEEL_DISPATCH_MAX_QUEUE_DEPTH (whose due jobs wait; the other queue's were published).
    held: str | None = None


class Pace:
    """How long one publish has taken lately (a moving average over the batches), so that a batch is sized to the
    time a tick has left: behind a slow broker a tick publishes fewer jobs per batch. A batch that still runs into
    the deadline (the broker turned slow in the middle of it) is rolled back, its jobs left due."""

    def __init__(self) -> None:
        self.seconds_per_publish = 0.0

    def observe(self, count: int, seconds: float) -> None:
        """A batch of ``count`` publishes took ``seconds``: a slower pace is taken at once, a faster one halfway."""
        if count:
            each = seconds / count
            slower = each > self.seconds_per_publish
            self.seconds_per_publish = each if slower else 0.5 * (self.seconds_per_publish + each)

    def fits(self, seconds: float) -> int:
        """How many publishes fit in ``seconds`` at this pace, with a fifth of it to spare (at least one: a tick with
        time left makes progress); a first batch, the pace not known yet, of ``PROBE`` jobs."""
        if self.seconds_per_publish <= 0:
            return PROBE
        return max(1, int(0.8 * seconds / self.seconds_per_publish))


def _rounded(n: int, batch: int) -> int:
    """``n`` rounded down to a power of two (``batch`` itself when it is at least that): the due scan is written out
    per limit, and a few texts are planned once each, where every limit would be planned anew."""
    return batch if n >= batch else 1 << (max(1, n).bit_length() - 1)


def dispatch_once(
    db: Database,
    celery: Celery,
    settings: Settings,
    *,
    fire_schedules: bool = True,
    deadline: float | None = None,
    pace: Pace | None = None,
) -> DispatchReport:
    """One pass: fire due schedules (unless ``fire_schedules`` is False), then publish due jobs in batches sized by
    ``pace`` until none are left, ``KEEL_DISPATCH_MAX_PER_TICK`` are published or ``deadline`` (monotonic) comes; a
    full queue is held back and a batch past the deadline rolled back. What is not published stays due."""
    fired = fire_schedules_once(db, settings) if fire_schedules else []
    published = recovered = 0
    stopped: str | None = None
    full: list[str] = []
    pace = pace or Pace()
    timeout = timedelta(seconds=settings.enqueue_timeout_seconds)
    while True:
        room = settings.dispatch_max_per_tick - published
        if room <= 0:
            stopped = "per-tick cap"
            break
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            stopped = "time budget"
            break
        queues, full = open_queues(db, celery, settings)
        if not queues:
            break
        limit = _rounded(min(room, pace.fits(left) if left is not None else room), settings.dispatch_batch)
        began = time.monotonic()
        try:
            with store_errors(), db.transaction() as cur:
                due = take_due(cur, enqueue_timeout=timeout, limit=limit, queues=queues)
                # Published inside the transaction: if publishing fails, the rows stay due for the next pass. If the
                # commit fails after publishing, the next pass publishes again and the claim suppresses the copy.
                publish(due, celery, deadline=deadline)
        except PastDeadline as late:  # rolled back: its jobs stay due, and the next batch is sized to this pace
            pace.observe(late.sent, time.monotonic() - began)
            stopped = "time budget"
            break
        pace.observe(len(due), time.monotonic() - began)
        published += len(due)
        recovered += sum(1 for d in due if d.recovered)
        if len(due) < limit:
            break
    if recovered:
        log.warning("recovered %d jobs whose worker died or whose message was lost", recovered)
    return DispatchReport(published, recovered, len(fired), "; ".join([*([stopped] if stopped else []), *full]) or None)


def fire_schedules_once(db: Database, settings: Settings) -> list[str]:
    """Fire the due schedules; a failure is logged (the jobs move anyway), an outage raised."""
    try:
        return schedules.fire_due(db, batch=settings.schedule_batch)
    except Exception as exc:  # schedules must never stop the jobs from moving
        if unreachable(exc):
            raise  # neither can the jobs, then
        log.exception("firing schedules failed; jobs are dispatched anyway")
        return []


def _reasons(held: str | None) -> set[str]:
    """What holds dispatch back, without the depths (which change every tick)."""
    return set() if held is None else {reason.split(":")[0] for reason in held.split("; ")}


def open_queues(db: Database, celery: Celery, settings: Settings) -> tuple[list[str], list[str]]:
    """The job queues with room on the broker, and, as "queue NAME: N", the full ones — those that hold
    ``KEEL_DISPATCH_MAX_QUEUE_DEPTH`` messages or more — that have due jobs waiting (a full queue with nothing due
    holds nothing back). With the limit 0 (off) every queue is open, and the broker is not asked."""
    limit = settings.dispatch_max_queue_depth
    if not limit:
        return list(JOB_QUEUES), []
    depths = queue_depths(celery, JOB_QUEUES)
    full = [name for name in JOB_QUEUES if depths[name] >= limit]
    if full:
        with store_errors(), db.transaction() as cur:
            waiting = set(
                queues_with_due(cur, enqueue_timeout=timedelta(seconds=settings.enqueue_timeout_seconds), queues=full)
            )
        full = [name for name in full if name in waiting]
    return (
        [name for name in JOB_QUEUES if depths[name] < limit],
        [f"queue {name}: {depths[name]}" for name in full],
    )


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
        self._held: str | None = None
        self.pace = Pace()  # how long a publish takes lately: each batch is sized to the tick's time left
        # Each on a thread of its own (tasks/passes.py): a slow pass never holds up dispatching, nor the others.
        settings = self.settings
        self.passes = (
            TimedPass("schedules", settings.dispatch_interval_seconds, self._fire_schedules),
            TimedPass("deadlines", settings.deadline_check_seconds, self._enforce_deadlines),
            TimedPass("approval-timeouts", settings.approval_check_seconds, self._enforce_approval_timeouts),
            # Off the tick's thread too: a fold of a large backlog of deltas must not delay dispatching.
            TimedPass("kpi-fold", settings.kpi_fold_seconds, self._fold_kpis),
        )
        self._waited = False
        self._closing = False
        #: The thread inside :meth:`tick` now (None: none): a stop signal's close there is left to the loop's end.
        self._ticking: threading.Thread | None = None
        self._database_back_since = 0.0
        # The dispatcher publishes through an app of its own whose every wait on Redis is bounded (tasks/app.py).
        timeout = beat_broker_timeout(settings)
        self.publishing = bounded_app(timeout, settings)
        super().__init__(*args, **kwargs)
        # And so are Celery's own sends of the periodic tasks (the relay's pass): this app is the beat's alone.
        self.app.conf.broker_transport_options = {
            **self.app.conf.broker_transport_options,
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
        }
        self.app.conf.task_publish_retry_policy = {"max_retries": 1, **QUICK_RETRY}

    def tick(self, *args: Any, **kwargs: Any) -> float:
        self._ticking = threading.current_thread()
        try:
            return self._tick(*args, **kwargs)
        finally:
            self._ticking = None

    def _tick(self, *args: Any, **kwargs: Any) -> float:
        interval = self.settings.dispatch_interval_seconds
        backoff = self.database.wait()
        if backoff:
            return backoff
        try:
            leader = self.leadership.held()
        except psycopg.Error as exc:
            return self.database.failed(exc)
        if self.database.down:
            self._database_back_since = time.monotonic()  # what a pass met before now was that outage
        self.database.recovered()
        if not leader:
            self.duties.stand_down()
            return interval
        started = time.monotonic()
        # The passes need the database only: they run on time while the broker is away too (deadlines are enforced
        # while Redis is down or hung).
        for timed in self.passes:  # started only by a tick that has just confirmed this beat leads
            outage = timed.poke(started, back_since=self._database_back_since)
            if outage is not None:
                return self.database.failed(outage)
        # With the broker away nothing is published, but the duties below still run and the lease is renewed every
        # interval (a backoff longer than the lease would hand leadership over for nothing).
        backoff = self.broker.wait()
        if not backoff:
            try:
                backoff = self._dispatch(started)
            except Exception as exc:
                return self.database.failed(exc)  # (only an unreachable database gets here)
        try:
            # Heartbeat, alerts, periodic audit verify, daily KPI report: each at its own interval on the
            # database's clock; a failure of theirs never stops the dispatcher.
            self.duties.tick(self.leadership.terms)
        except Exception as exc:
            if unreachable(exc):
                return self.database.failed(exc)
            log.exception("leader duties failed; retrying next tick")
        if backoff:
            return min(backoff, interval)
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

    def _dispatch(self, started: float) -> float:
        """Publish what is due; the broker's backoff (seconds) if it could not be reached, else 0. A database that
        cannot be reached is raised (the tick backs off on it)."""
        try:
            report = dispatch_once(
                self.db,
                self.publishing,
                self.settings,
                fire_schedules=False,
                deadline=self._publish_deadline(started),
                pace=self.pace,
            )
        except Exception as exc:  # beat must outlive a database or broker outage; the rows stay due
            if unreachable(exc):
                raise
            if is_broker_outage(exc):
                return self.broker.failed(broker_error(exc) or exc)
            log.exception("dispatch pass failed; retrying next tick")
            return 0.0
        if report.published or report.held or self.settings.dispatch_max_queue_depth:  # it reached the broker
            self.broker.recovered()
        if report.published:
            log.info("dispatched %d jobs (%d recovered)", report.published, report.recovered)
        self._say_held(report.held)
        return 0.0

    def _publish_deadline(self, started: float) -> float:
        """When this tick stops publishing (monotonic): after ``PUBLISH_SHARE`` of the lease, and a dispatch interval
        before the lease this tick renewed runs out, whichever is sooner — a tick publishing a backlog behind a slow
        broker must not outlast its own leadership (the rest waits, due, for the next tick)."""
        settings = self.settings
        return min(
            started + PUBLISH_SHARE * settings.beat_lease_seconds,
            self.leadership.valid_until - settings.dispatch_interval_seconds,
        )

    def _say_held(self, held: str | None) -> None:
        """Back-pressure is said once when it starts holding jobs back (a warning) and once when it stops; what holds
        it back changing meanwhile (the cap one tick, a full queue the next) is only a debug line."""
        if held is not None and self._held is None:
            log.warning("dispatch held back (%s); due jobs wait in PostgreSQL", held)
        elif held is None and self._held is not None:
            log.info("dispatch no longer held back")
        elif held is not None and _reasons(held) != _reasons(self._held):
            log.debug("dispatch still held back (%s)", held)
        self._held = held

    def _fire_schedules(self) -> None:
        fired = fire_schedules_once(self.db, self.settings)
        if fired:
            log.info("fired %d schedules", len(fired))

    def _enforce_deadlines(self) -> None:
        # On the database's clock, not this host's; each agent on its own (one failure is journaled on that agent
        # and the others go on).
        enforced = deadlines.enforce(
            self.db, notify_slack_channel=self.settings.notify_slack_channel, batch=self.settings.deadline_batch
        )
        if enforced.demoted or enforced.stopped or enforced.failed:
            log.info(
                "deadlines: %d agents demoted, %d stopped, %d failed",
                len(enforced.demoted),
                len(enforced.stopped),
                len(enforced.failed),
            )

    def _enforce_approval_timeouts(self) -> None:
        # Tools' approval timeouts, on the database's clock: reject (the model is told) or escalate (once).
        timed_out = approvals.enforce_timeouts(self.db, self.settings)
        if timed_out.rejected or timed_out.escalated or timed_out.failed:
            log.info(
                "approval timeouts: %d calls rejected, %d escalated, %d failed",
                len(timed_out.rejected),
                len(timed_out.escalated),
                len(timed_out.failed),
            )

    def _fold_kpis(self) -> None:
        """Fold the KPI counters' deltas (the readers count unfolded ones too: a fold that fails only waits; the
        pass logs it and tries again at its next interval)."""
        folded = fold(self.db, retention=timedelta(days=self.settings.kpi_retention_days))
        if folded:
            log.debug("folded %d KPI deltas", folded)

    def _ensure_connected(self) -> Any:
        """One attempt to connect. Celery retries here for as long as the broker is away, a line per retry, with
        the whole beat (the dispatcher and deadline enforcement too) waiting inside; :meth:`tick` backs off."""
        return self.connection.ensure_connection(max_retries=0)

    def apply_entry(self, entry: ScheduleEntry, producer: Any = None) -> None:
        """Send a periodic task (the outbox relay's pass), without Celery's traceback per failed send: an outage is
        one line going and one coming back (a missed pass is not owed: the next one does it)."""
        try:
            if entry.task == RELAY_OUTBOX and self._relay_pass_waiting():
                # An earlier pass still waits on keel.outbox: another would only pile up behind it (not an expiry,
                # which would be stamped on this host's clock and checked on the worker's: invariant 10).
                celery_beat_log.debug("Scheduler: %s not sent: a pass still waits on %s", entry.name, OUTBOX_QUEUE)
                return
            celery_beat_log.info("Scheduler: Sending due task %s (%s)", entry.name, entry.task)
            self.apply_async(entry, producer=producer, advance=False)
        except Exception as exc:
            cause = broker_error(exc)
            if cause is None:
                log.exception("periodic task %s could not be sent", entry.name)
            else:
                self.broker.failed(cause)
            return
        self.broker.recovered()

    def _relay_pass_waiting(self) -> bool:
        """Whether a relay pass is waiting on its queue, not yet taken by a worker."""
        return queue_depths(self.publishing, (OUTBOX_QUEUE,))[OUTBOX_QUEUE] > 0

    def close(self) -> None:
        # A close inside a tick or inside another close does nothing (the close as Celery's loop ends does the work);
        # passes share one CLOSE_WAIT_SECONDS budget. Why: docs/explanation/runtime-outbox-and-workers.md#closing-a-beat
        if self._closing or self._ticking is threading.current_thread():
            return
        with _stop_signals_ignored():
            self._closing = True
            try:
                if not self._waited:
                    self._waited = True
                    deadline = time.monotonic() + CLOSE_WAIT_SECONDS
                    for timed in self.passes:
                        timed.join(max(0.0, deadline - time.monotonic()))
                    for chore in self.duties.chores_under_way():  # within the same budget
                        chore.join(max(0.0, deadline - time.monotonic()))
                self.leadership.release()
                self.publishing.close()
                self.db.dispose()
                super().close()
            finally:
                self._closing = False
