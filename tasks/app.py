"""The Celery app, built from Keel's settings with reliable defaults: ``celery -A tasks.app worker`` and ``keel
worker`` both use :data:`app`, whose configuration is computed when Celery first reads it, so importing this module
starts nothing (the embedded Redis starts only when needed).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import redis.exceptions
from celery import Celery, concurrency
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.concurrency.solo import TaskPool as SoloPool
from celery.signals import after_setup_logger, beat_init, worker_init, worker_process_init, worker_process_shutdown
from kombu import Queue  # type: ignore[attr-defined]
from kombu.exceptions import OperationalError as BrokerError

from agents.core.keys import split_key
from agents.core.queues import JOBS_QUEUE, LOW_QUEUE
from agents.observability.tracing import BEAT, WORKER, configure_tracing, flush_tracing
from models.embedded import broker_url_for, redis_status
from models.jobs_sql import Due
from models.settings import Settings
from tasks import metrics as _metrics  # noqa: F401  (connects the worker's and the beat's exporters to their start)
from tasks.kombu_guard import guard_redis_transport
from tasks.logs import quiet_housekeeping

RUN_JOB = "keel.run_job"
RELAY_OUTBOX = "keel.relay_outbox"
OUTBOX_QUEUE = "keel.outbox"  # the relay's own queue: a dedicated worker (`keel worker -Q keel.outbox`) may take it
#: Periodic tasks beat sends every few seconds: Celery's received/succeeded/sending lines for them go to DEBUG.
HOUSEKEEPING = frozenset({RELAY_OUTBOX})


# Before any broker connection: a worker that loses Redis while it holds a message must reconnect, not stop.
guard_redis_transport()


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery settings that make a lost or repeated message harmless and rare."""
    visibility = settings.visibility_timeout_seconds
    transport = {
        # One value everywhere: Redis redelivers an unacked message after this long, and workers sweep for such
        # messages often enough that the redelivery actually happens close to it.
        "visibility_timeout": visibility,
        "unacked_restore_interval": max(1, min(10, visibility // 6)),
        "unacked_restore_throttle": 1,
        # Drain queues in the order a worker lists them (keel.jobs before keel.jobs.low), not round-robin:
        # otherwise a job demoted past its soft deadline could start before the normal backlog.
        "queue_order_strategy": "priority",
        # Every key and pub/sub channel (queues, bindings, unacked messages, control broadcasts such as revoke,
        # events) starts with KEEL_BROKER_PREFIX: deployments sharing a Redis database never see each other's.
        "global_keyprefix": settings.broker_prefix,
        # Bounded waits on a Redis that accepts connections but does not answer: redis-py waits for ever otherwise.
        "socket_timeout": settings.broker_socket_timeout_seconds,
        "socket_connect_timeout": settings.broker_socket_timeout_seconds,
    }
    return {
        "broker_url": broker_url_for(settings),
        "broker_transport_options": transport,
        "broker_connection_retry_on_startup": True,
        # Postgres holds every job's outcome; Celery's result backend would be a second, weaker truth.
        "task_ignore_result": True,
        "result_backend": None,
        # Ack after the handler, and put the message back if the worker process dies mid-task.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        # One message at a time per process (KEEL_WORKER_PREFETCH_MULTIPLIER): a dying worker takes at most one
        # unacked message with it, and a long step holds no other job back from an idle worker.
        "worker_prefetch_multiplier": settings.worker_prefetch_multiplier,
        # On warm shutdown, give running jobs time to finish before their messages go back to the queue.
        "worker_soft_shutdown_timeout": 10.0,
        # Not when idle: with no job running there is nothing to wait for (Keel puts no ETA message on the broker).
        "worker_enable_soft_shutdown_on_idle": False,
        # A broker outage must not interrupt a running step (invariant 12): Celery would cancel every late-ack task
        # in flight when Redis drops, and each cancel counts as a lost run.
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        # Task events cost broker messages on every job (received, started, succeeded; sent at publish): off unless
        # KEEL_WORKER_TASK_EVENTS. Flower turns them on in the workers while it runs (its enable_events broadcast).
        "worker_send_task_events": settings.worker_task_events,
        "task_send_sent_event": settings.worker_task_events,
        "task_default_queue": JOBS_QUEUE,
        "task_queues": [Queue(JOBS_QUEUE), Queue(LOW_QUEUE), Queue(OUTBOX_QUEUE)],  # type: ignore[no-untyped-call]
        "task_routes": {RELAY_OUTBOX: {"queue": OUTBOX_QUEUE}},
        "task_serializer": "json",
        "accept_content": ["json"],
        "enable_utc": True,
        "timezone": "UTC",
        "beat_max_loop_interval": settings.dispatch_interval_seconds,
        "beat_schedule": {
            "relay-outbox": {
                "task": RELAY_OUTBOX,
                "schedule": settings.outbox_interval_seconds,
                # No ``expires``: Celery would stamp it on beat's clock and check it on the worker's, so a relay
                # whose clock runs ahead would drop every pass (invariant 10). A pass with nothing due is one query.
                "options": {"queue": OUTBOX_QUEUE},
            },
        },
        "imports": ["tasks.jobs", "tasks.outbox"],
        # Keel's own: the queues of operations routed elsewhere (KEEL_OPERATION_QUEUES), which publish() applies.
        "keel_operation_queues": dict(settings.operation_queues),
    }


@after_setup_logger.connect(weak=False)  # type: ignore[untyped-decorator]
def _quiet_housekeeping(**_: Any) -> None:
    # Worker and beat set up their logging after this module is imported, whichever command started them.
    quiet_housekeeping(HOUSEKEEPING, job_task=RUN_JOB)


# Traces (off without an OTLP endpoint): set up in the process that runs the tasks. A prefork worker's parent runs
# none: each child sets up its own provider after the fork (an export thread does not survive one).


#: The worker this process runs (Celery's WorkController), once it has started: its exit status is kept on it.
_worker: list[Any] = []


def worker_exit_code() -> int:
    """The status this process's worker stopped with (0 if none ran): Celery.start drops it, and ``keel worker``
    exits with it (70 for a worker that stopped to be replaced, 1 for a failure)."""
    code = getattr(_worker[-1], "exitcode", None) if _worker else None
    return code if isinstance(code, int) else 0


@worker_init.connect(weak=False)  # type: ignore[untyped-decorator]
def _trace_worker(sender: Any = None, **_: Any) -> None:
    _worker.append(sender)
    pool = concurrency.get_implementation(getattr(sender, "pool_cls", None) or "prefork")
    # The pool the jobs run in, as Celery started it (also `celery -A tasks.app worker`, whatever KEEL_WORKER_POOL
    # says): how much stuck work a process may carry, and how it ends, follow from it (tasks/runtime.py).
    os.environ["KEEL_WORKER_POOL"] = pool_name(pool)
    if not (isinstance(pool, type) and issubclass(pool, PreforkPool)):  # solo, threads: tasks run in this process
        configure_tracing(Settings(), WORKER)
    # Each pool thread builds its own (disabled) result backend on its first task, and the first build scans every
    # installed package's entry points. Celery caches that scan, but not against threads racing to fill the cache:
    # 200 threads starting together each scanned (tens of ms each). Scanned once here, before any thread starts.
    sender.app.backend  # noqa: B018 - built for its side effect: the cached scan


def pool_name(pool: Any) -> str:
    """``prefork``, ``solo`` or ``threads`` (any other pool that runs many tasks in one process) for a pool class."""
    if isinstance(pool, type) and issubclass(pool, PreforkPool):
        return "prefork"
    if isinstance(pool, type) and issubclass(pool, SoloPool):
        return "solo"
    return "threads"


@worker_process_init.connect(weak=False)  # type: ignore[untyped-decorator]
def _trace_worker_child(**_: Any) -> None:
    configure_tracing(Settings(), WORKER)


@worker_process_shutdown.connect(weak=False)  # type: ignore[untyped-decorator]
def _flush_worker_child(**_: Any) -> None:
    flush_tracing()  # a pool child ends with os._exit: its exit handlers never export what is left


@beat_init.connect(weak=False)  # type: ignore[untyped-decorator]
def _trace_beat(**_: Any) -> None:
    configure_tracing(Settings(), BEAT)


def make_app(settings: Settings | None = None) -> Celery:
    celery = Celery("keel")
    celery.add_defaults(lambda: celery_config(settings or Settings()))
    return celery


app = make_app()


class PastDeadline(Exception):
    """A publish ran into its deadline: ``sent`` of the jobs went out, the rest did not."""

    def __init__(self, sent: int) -> None:
        super().__init__(f"publish deadline passed after {sent} jobs")
        self.sent = sent


def publish(due: Sequence[Due], celery: Celery | None = None, *, deadline: float | None = None) -> None:
    """Send jobs to the broker. The task id is the job key; retries and re-publishes reuse it. With ``deadline``
    (monotonic), raises :class:`PastDeadline` instead of sending a job once it has passed."""
    if not due:
        return
    celery = celery or app
    queues = [queue_of(job, celery) for job in due]
    with celery.producer_or_acquire() as producer:
        # Declared on every publish, not once per connection: if Redis lost its keys (FLUSHALL, a failover),
        # a cached declaration would route every message to nowhere until a restart.
        for name in set(queues):
            celery.amqp.queues[name](producer.channel).declare()
        for sent, (job, queue) in enumerate(zip(due, queues, strict=True)):
            if deadline is not None and time.monotonic() >= deadline:
                raise PastDeadline(sent)
            celery.send_task(RUN_JOB, args=(job.key,), task_id=job.key, queue=queue, producer=producer)


def queue_of(job: Due, celery: Celery | None = None) -> str:
    """The queue job ``job`` is published to: its operation's own (KEEL_OPERATION_QUEUES), else its row's."""
    routes = (celery or app).conf.get("keel_operation_queues")
    if not routes:
        return job.queue
    try:
        operation = split_key(job.key)[1]
    except ValueError:
        return job.queue
    return str(routes.get(operation, job.queue))


def queue_depths(celery: Celery, names: Sequence[str]) -> dict[str, int]:
    """How many messages each queue holds on the broker now (all of its priority levels)."""
    with celery.producer_or_acquire() as producer:
        return {name: int(celery.amqp.queues[name](producer.channel).queue_declare().message_count) for name in names}


#: What kombu and redis-py raise when Redis cannot be reached.
BROKER_ERRORS = (BrokerError, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


def broker_error(exc: BaseException | None) -> BaseException | None:
    """The error in ``exc``'s chain that says Redis could not be reached (kombu gives up after its own retries),
    also when Celery wrapped it (beat's ``SchedulingError``: "Couldn't apply scheduled task …"); else None."""
    for _ in range(10):
        if exc is None or isinstance(exc, BROKER_ERRORS):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def is_broker_outage(exc: BaseException | None) -> bool:
    """Whether ``exc`` means Redis could not be reached: see :func:`broker_error`."""
    return broker_error(exc) is not None


#: One quick retry, for a publisher that has somewhere else to leave its work (kombu's retry policy fields).
QUICK_RETRY: dict[str, float] = {"interval_start": 0, "interval_step": 0.1, "interval_max": 0.2}


def bounded_app(timeout: float, settings: Settings | None = None) -> Celery:
    """A Celery app for publishing only, that gives up after about ``timeout`` seconds when Redis cannot be reached
    (connecting, each command, and one quick reconnect) instead of Celery's retries of several seconds: for a caller
    that has somewhere else to leave the job, such as the API (the dispatcher publishes it on its next pass)."""
    celery = make_app(settings)
    celery.conf.update(
        broker_transport_options={
            **celery.conf.broker_transport_options,
            **QUICK_RETRY,
            "max_retries": 1,
            "connect_retries_timeout": timeout,
            "socket_connect_timeout": timeout,
            "socket_timeout": timeout,
        },
        task_publish_retry_policy={"max_retries": 1, **QUICK_RETRY},
    )
    return celery


#: Seconds each publish at submit may take when Redis does not answer (the job is then left to the dispatcher).
PUBLISH_TIMEOUT_SECONDS = 1.0


class Publisher:
    """A :class:`agents.client.Client` publisher: sends a submit's first jobs to the broker right after its commit.
    ``close()`` releases its broker connections (``Client.close`` calls it)."""

    def __init__(self, celery: Celery | None = None, *, owned: bool = False) -> None:
        self.celery = celery
        self._owned = owned

    def __call__(self, due: Sequence[Due]) -> None:
        publish(due, self.celery)

    def close(self) -> None:
        if self._owned and self.celery is not None:
            self.celery.close()


def publisher(celery: Celery | None = None, *, timeout: float | None = None) -> Publisher:
    """A :class:`agents.client.Client` publisher: ``Client(db, publisher=publisher())``. With ``timeout``, it
    publishes through an app of its own from :func:`bounded_app`."""
    if timeout is not None and celery is None:
        return Publisher(bounded_app(timeout), owned=True)
    return Publisher(celery)


def submit_publisher(settings: Settings) -> Publisher | None:
    """What a producer's submits publish with (the ``keel.publishers`` entry point ``celery``), bounded by
    :data:`PUBLISH_TIMEOUT_SECONDS` so a lost Redis leaves the job to the dispatcher. None when
    ``KEEL_PUBLISH_AT_SUBMIT`` is off, or while the embedded Redis is not running."""
    if not settings.publish_at_submit:
        return None
    if settings.broker_url is None and not redis_status(settings.home).running:
        # The embedded default with its Redis not started: no worker can take the job yet, and a submit does not
        # start a server of its own. The beat starts it, and its dispatcher publishes the job on its first pass.
        return None
    return Publisher(bounded_app(PUBLISH_TIMEOUT_SECONDS, settings), owned=True)
