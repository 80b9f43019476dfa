"""The settings of jobs and the Celery side: workers, the beat's passes, retention, retries and run limits. A part
of :class:`models.settings.Settings`."""

from __future__ import annotations

import os
import re
from typing import Literal

from pydantic import BaseModel, Field, field_validator

_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
#: Steps in flight per threads worker when KEEL_WORKER_CONCURRENCY is not set.
THREADS_DEFAULT = 200
_QUEUE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_KEEL_QUEUES = {"keel.jobs", "keel.jobs.low", "keel.outbox"}
_RETRY_FIELDS = {"max_attempts", "base_seconds", "max_seconds", "jitter"}


class JobFields(BaseModel):
    """``KEEL_WORKER_*``, ``KEEL_DISPATCH_*``, the beat's intervals, retention, ``KEEL_RETRY_POLICY`` and
    ``KEEL_RUN_LIMITS``."""

    imports: list[str] = Field(default_factory=list)  # modules with @handler functions, loaded by workers
    # How a worker runs jobs (`keel worker --pool`): ``threads`` keeps up to KEEL_WORKER_CONCURRENCY steps in flight in
    # one process (steps wait on models); ``prefork`` runs one step per process, for CPU-heavy handlers.
    worker_pool: Literal["threads", "prefork", "solo"] = "threads"
    # Jobs in flight per `keel worker`: threads of its one process, or prefork processes. None: 200 threads, or one
    # process per CPU.
    worker_concurrency: int | None = Field(default=None, ge=1, le=5000)
    # A threads worker whose handler or tool threads still running past their limits reach this many is replaced: it
    # stops taking jobs, lets its running ones finish, and exits with status 70 (`keel up` starts it again).
    worker_stuck_limit: int = Field(default=10, ge=1, le=1000)
    # Operations whose jobs go to a queue of their own, e.g. {"summarise": "keel.cpu"}, for a worker that consumes it
    # (`keel worker -P prefork -Q keel.cpu`): CPU-heavy handlers. Every publish routes by it.
    operation_queues: dict[str, str] = Field(default_factory=dict)
    # Celery's task events (what Flower's task views show) cost a few broker messages per job: off unless asked for.
    # A running Flower asks for them itself (its enable_events, on by default), so its views work either way.
    worker_task_events: bool = False
    # Messages a worker process holds beyond the one it runs: 1 takes the next message only when a process is free,
    # so a long step never holds another job back from an idle worker elsewhere (Keel's steps are model calls).
    worker_prefetch_multiplier: int = Field(default=1, ge=1, le=64)
    job_lease_seconds: float = Field(default=60.0, gt=0)  # a running job's lease; heartbeats renew it
    enqueue_timeout_seconds: float = Field(default=300.0, gt=0)  # enqueued but never claimed → re-published
    dispatch_interval_seconds: float = Field(default=0.5, gt=0)
    # A submit through `Client.from_settings`, the CLI or the API publishes its first job to the broker right after
    # its commit (the dispatcher is then only the safety net: a publish that fails leaves the job to its next pass).
    # false: every job waits for the dispatcher's next pass (up to KEEL_DISPATCH_INTERVAL_SECONDS).
    publish_at_submit: bool = True
    # The beat leader's lease (tasks/leadership.py), renewed every dispatch interval: a leader that dies is taken
    # over at most this long after its last renewal (plus a dispatch interval); one that stops cleanly, at once.
    beat_lease_seconds: float = Field(default=5.0, gt=0)
    dispatch_batch: int = Field(default=500, ge=1)
    # Back-pressure: one dispatcher tick publishes at most this many jobs (the rest stay due in PostgreSQL for the
    # next tick), and publishes none while a job queue on the broker already holds this many messages (0: never
    # waits for the broker). Due jobs, recovered ones included, then wait in PostgreSQL, not in Redis.
    dispatch_max_per_tick: int = Field(default=5000, ge=1)
    dispatch_max_queue_depth: int = Field(default=20000, ge=0)
    deadline_check_seconds: float = Field(default=5.0, gt=0)
    # The deadline pass and the schedule pass take this many due agents / schedules at a time.
    deadline_batch: int = Field(default=200, ge=1)
    schedule_batch: int = Field(default=100, ge=1)
    # The KPI counters (models/kpi_sql.py): the leading beat folds their deltas into per-minute rollups at most this
    # often, and keeps the per-minute rollups (what `keel kpi --since` and the alerts read) this many days.
    kpi_fold_seconds: float = Field(default=5.0, gt=0)
    kpi_retention_days: int = Field(default=35, ge=1, le=3650)
    # Retention (models/retention_sql.py, `keel db prune`): finished jobs, sent messages with their delivery log rows,
    # and requests' inputs are pruned this many days after they finished (a request: after its submit; 0: kept for
    # ever). Never anything in flight, a dead letter, anything unsent, nor the journal (`keel audit archive`). The
    # leading beat prunes this often (0: only `keel db prune` does), at most ``prune_batch`` rows per transaction.
    jobs_retention_days: int = Field(default=30, ge=0, le=36500)
    outbox_retention_days: int = Field(default=30, ge=0, le=36500)
    requests_retention_days: int = Field(default=90, ge=0, le=36500)
    prune_interval_seconds: float = Field(default=3600.0, ge=0)
    prune_batch: int = Field(default=1000, ge=1, le=100_000)
    # Redis redelivers a message nobody acked after this long; every place that must agree reads this one value.
    visibility_timeout_seconds: int = Field(default=3600, ge=10)
    # Per error class overrides of the retry rules, e.g. {"transient": {"max_attempts": 3, "base_seconds": 2}}.
    retry_policy: dict[str, dict[str, float]] = Field(default_factory=dict)
    # How long one attempt of an operation may run before it is ended (its thread fenced off, or its prefork process
    # replaced) and counted as an ``unknown`` failure: per operation, e.g. {"plan": 120, "tool": 300}; others get
    # the default.
    run_limit_seconds: float = Field(default=900.0, gt=0)
    run_limits: dict[str, float] = Field(default_factory=dict)

    @property
    def worker_slots(self) -> int:
        """Jobs in flight per ``keel worker``: KEEL_WORKER_CONCURRENCY, else 200 threads or a process per CPU."""
        if self.worker_concurrency is not None:
            return self.worker_concurrency
        return THREADS_DEFAULT if self.worker_pool == "threads" else max(1, os.cpu_count() or 1)

    @field_validator("retry_policy")
    @classmethod
    def _retry_policy_is_complete_and_sane(cls, value: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        known = {"transient", "rate_limited", "invalid", "budget", "unknown"}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"unknown error classes {sorted(unknown)}; known: {sorted(known)}")
        for name, fields in value.items():
            odd = set(fields) - _RETRY_FIELDS
            if odd:
                raise ValueError(f"{name}: unknown fields {sorted(odd)}; known: {sorted(_RETRY_FIELDS)}")
            attempts = fields.get("max_attempts", 1)
            if attempts != int(attempts) or attempts < 1:
                raise ValueError(f"{name}.max_attempts must be a whole number of at least 1, got {attempts}")
            for seconds in ("base_seconds", "max_seconds"):
                if seconds in fields and not fields[seconds] > 0:
                    raise ValueError(f"{name}.{seconds} must be greater than 0, got {fields[seconds]}")
            if fields.get("max_seconds", float("inf")) < fields.get("base_seconds", 0):
                raise ValueError(f"{name}.max_seconds must not be below {name}.base_seconds")
            if not 0 <= fields.get("jitter", 0) <= 1:
                raise ValueError(f"{name}.jitter must be between 0 and 1, got {fields['jitter']}")
        for never in ("invalid", "budget"):
            if value.get(never, {}).get("max_attempts", 1) != 1:
                raise ValueError(f"{never} failures are never retried: its max_attempts must stay 1")
        return value

    @field_validator("operation_queues")
    @classmethod
    def _operation_queues_are_names(cls, value: dict[str, str]) -> dict[str, str]:
        for operation, queue in value.items():
            if not _QUEUE_NAME.fullmatch(queue):
                raise ValueError(f"{operation}: {queue!r} is not a queue name (letters, digits, '.', '_', '-')")
            if queue in _KEEL_QUEUES:
                raise ValueError(f"{operation}: {queue!r} is one of Keel's own queues; name a queue of its own")
        return value

    @field_validator("imports")
    @classmethod
    def _imports_are_module_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not _MODULE_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a module name (dotted Python identifiers, e.g. myapp.handlers)")
        return value
