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

    imports: list[str] = Field(
        default_factory=list,
        description=(
            "Handler modules workers import (those with `@handler` and `@tool` functions), as a JSON list, e.g. "
            '`["myagents"]`; a module in the current directory is found without `PYTHONPATH`.'
        ),
    )
    worker_pool: Literal["threads", "prefork", "solo"] = Field(
        default="threads",
        description=(
            "How `keel worker` runs jobs (`-P` overrides it): `threads` (steps in flight in one process: they wait on"
            " models), `prefork` (a process per job: CPU-heavy handlers; late effects of a hung handler impossible) "
            "or `solo`."
        ),
    )
    worker_concurrency: int | None = Field(
        default=None,
        ge=1,
        le=5000,
        description=(
            "Jobs in flight per `keel worker` (`-c` overrides it). Unset: 200 threads, or one prefork process per CPU."
        ),
    )
    worker_stuck_limit: int = Field(
        default=10,
        ge=1,
        le=1000,
        description=(
            "A threads worker with this many handler or tool threads still running past their limits takes no more "
            "jobs, lets its running ones finish and exits with status 70 to be replaced."
        ),
    )
    operation_queues: dict[str, str] = Field(
        default_factory=dict,
        description=(
            'Operations whose jobs go to a queue of their own, e.g. `{"summarise": "keel.cpu"}`, for a worker that '
            "consumes it (`keel worker -P prefork -Q keel.cpu`: CPU-heavy handlers); the others keep Keel's queues."
        ),
    )
    worker_task_events: bool = Field(
        default=False,
        description=(
            "Celery's task events (`-E`: received, started, succeeded; sent at publish), which cost broker messages "
            "on every job; a running Flower turns them on in the workers itself, so its task views work either way."
        ),
    )
    worker_prefetch_multiplier: int = Field(
        default=1,
        ge=1,
        le=64,
        description=(
            "Messages a worker process reserves (Celery's prefetch multiplier): 1 takes the next message only when a "
            "process is free, so a long step never holds another job back from an idle worker elsewhere; more hides "
            "the broker round trip between short jobs, and a worker that dies holds that many messages until "
            "`KEEL_VISIBILITY_TIMEOUT_SECONDS`."
        ),
    )
    job_lease_seconds: float = Field(
        default=60.0,
        gt=0,
        description=(
            "A running job's lease; renewed every third of it while the handler runs. Shorter than "
            "`KEEL_VISIBILITY_TIMEOUT_SECONDS`."
        ),
    )
    enqueue_timeout_seconds: float = Field(
        default=300.0,
        gt=0,
        description=(
            "A published job nobody claimed for this long is published again, backlog or not; longer than "
            "`KEEL_DISPATCH_INTERVAL_SECONDS`."
        ),
    )
    dispatch_interval_seconds: float = Field(
        default=0.5,
        gt=0,
        description="How often the beat dispatcher looks for due jobs (and fires due schedules).",
    )
    publish_at_submit: bool = Field(
        default=True,
        description=(
            "A submit (`Client.from_settings`, the CLI, the HTTP API) publishes its first job to the broker right "
            "after its commit, giving up within about a second when Redis does not answer (the job is then the "
            "dispatcher's); `false`: every job waits for the dispatcher's next pass."
        ),
    )
    beat_lease_seconds: float = Field(
        default=5.0,
        gt=0,
        description=(
            "The beat leader's lease, renewed every dispatch interval (at least 3 of them): a leader that dies is "
            "taken over this long after its last renewal, plus a dispatch interval; one that stops cleanly hands over"
            " at once."
        ),
    )
    dispatch_batch: int = Field(
        default=500,
        ge=1,
        description="Due jobs the dispatcher takes and publishes per transaction.",
    )
    # Back-pressure: due jobs, recovered ones included, wait in PostgreSQL, not in Redis.
    dispatch_max_per_tick: int = Field(
        default=5000,
        ge=1,
        description=(
            "At most this many jobs published per dispatcher tick; the rest stay due in PostgreSQL for the next."
        ),
    )
    dispatch_max_queue_depth: int = Field(
        default=20000,
        ge=0,
        description=(
            "No job is published to `keel.jobs` or to `keel.jobs.low` while that queue holds this many messages (its "
            "due jobs wait in PostgreSQL; the other queue's are still published); `0`: never wait for the broker."
        ),
    )
    deadline_check_seconds: float = Field(
        default=5.0,
        gt=0,
        description="How often the beat enforces deadlines.",
    )
    deadline_batch: int = Field(
        default=200,
        ge=1,
        description="Agents past a deadline read per query of a deadline pass.",
    )
    schedule_batch: int = Field(
        default=100,
        ge=1,
        description="Due schedules locked and fired per transaction.",
    )
    # The KPI counters: models/kpi_sql.py.
    kpi_fold_seconds: float = Field(
        default=5.0,
        gt=0,
        description="How often the leading beat folds the KPI counters' deltas into their per-minute rollups.",
    )
    kpi_retention_days: int = Field(
        default=35,
        ge=1,
        le=3650,
        description=(
            "Per-minute KPI rollups older than this are dropped (the running totals stay); the longest `keel kpi "
            "--since`."
        ),
    )
    # Retention (models/retention_sql.py, `keel db prune`) never touches anything in flight, a dead letter, anything
    # unsent, nor the journal (`keel audit archive`).
    jobs_retention_days: int = Field(
        default=30,
        ge=0,
        le=36500,
        description=(
            "Finished jobs (their replies, their copy of the input) are pruned this many days after they finished, "
            "their keys kept; `0`: kept for ever."
        ),
    )
    outbox_retention_days: int = Field(
        default=30,
        ge=0,
        le=36500,
        description=(
            "Sent outbox messages and their delivery log rows are pruned this many days after they were sent, their "
            "keys kept; `0`: kept for ever. Dead letters and unsent messages are never pruned."
        ),
    )
    requests_retention_days: int = Field(
        default=90,
        ge=0,
        le=36500,
        description=(
            "A request's input is replaced by its sha256 this many days after its submit (the row stays: the id is "
            "its agent's for ever); `0`: kept for ever."
        ),
    )
    prune_interval_seconds: float = Field(
        default=3600.0,
        ge=0,
        description="How often the leading beat prunes (in a thread of its own); `0`: only `keel db prune` does.",
    )
    prune_batch: int = Field(
        default=1000,
        ge=1,
        le=100_000,
        description="Rows per prune transaction: each batch is one short transaction.",
    )
    # Every place that must agree on when Redis redelivers reads this one value.
    visibility_timeout_seconds: int = Field(
        default=3600,
        ge=10,
        description=(
            "Redis redelivers a message nobody acknowledged after this long; longer than `KEEL_JOB_LEASE_SECONDS`."
        ),
    )
    retry_policy: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description=(
            "Per error class (`transient`, `rate_limited`, `invalid`, `budget`, `unknown`) overrides of "
            '`max_attempts`, `base_seconds`, `max_seconds`, `jitter`, e.g. `{"transient": {"max_attempts": 3, '
            '"base_seconds": 2}}`; `invalid` and `budget` failures are never retried.'
        ),
    )
    run_limit_seconds: float = Field(
        default=900.0,
        gt=0,
        description=(
            "How long one attempt of a job may run before it is ended (an `unknown` failure): its thread fenced off, "
            "or its prefork process replaced."
        ),
    )
    run_limits: dict[str, float] = Field(
        default_factory=dict,
        description=('`KEEL_RUN_LIMIT_SECONDS` per operation, e.g. `{"plan": 120, "tool": 300}`.'),
    )

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
