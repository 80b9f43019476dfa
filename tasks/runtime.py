"""What a worker or beat process holds: settings, one database pool per process, the handler registry."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import cache
from typing import Generic, TypeVar

from agents.core.outage import Outage
from agents.core.policies import rules_with
from agents.core.redaction import register_settings
from agents.jobs.handlers import Registry, load
from agents.jobs.runner import Runner
from agents.runtime.tools import load_entry_points
from models.db import Database
from models.settings import Settings


@dataclass(frozen=True)
class Runtime:
    settings: Settings
    db: Database
    runner: Runner
    #: The database as this process sees it: its jobs, lease keeper and relay passes report to this one, so an
    #: outage is one "database down" line and one "database back" line per process.
    outage: Outage
    #: The broker as this process sees it when it publishes a step's next jobs: likewise one line each way.
    broker: Outage


@cache
def _runtime(pid: int) -> Runtime:
    # Keyed by pid: a forked pool child must not share its parent's connections.
    settings = Settings()
    # Exactly its size, no burst above it: the jobs of a threads worker borrow a connection in turn, and a burst of
    # connections opened and closed again costs the server a process each. One of KEEL_DB_POOL_SIZE_WORKER is the
    # lease keeper's own (Runner).
    size = max(1, settings.db_pool_size_worker - 1)
    # Its statements are a few, run on every job: prepared at their first run on each connection.
    db = Database.from_settings(settings, pool_size=size, max_overflow=0, prepare_threshold=0)
    register_settings(settings)  # again: opening the database may have generated the development audit key
    # The agent loop's own handlers (plan, tool, gate) and the tools, then the user's modules.
    registry: Registry = load(["agents.runtime.loop", *settings.imports])
    load_entry_points()
    outage = Outage("database", logging.getLogger("keel.worker"))
    broker = Outage("broker", logging.getLogger("keel.worker"))
    runner = Runner(
        db,
        registry,
        worker=f"{socket.gethostname()}:{pid}",
        lease=timedelta(seconds=settings.job_lease_seconds),
        rules=rules_with(settings.retry_policy),
        publish_due=True,
        run_limits=settings.run_limits,
        default_run_limit=settings.run_limit_seconds,
        outage=outage,
        # A threads worker carries some stuck work and runs on; a process that runs one job at a time ends with it.
        stuck_limit=settings.worker_stuck_limit if settings.worker_pool == "threads" else 1,
    )
    return Runtime(settings, db, runner, outage, broker)


T = TypeVar("T")


class PerProcess(Generic[T]):
    """What ``build()`` makes, once per process (a forked pool child builds its own), however many threads ask at
    once: the first jobs of a threads worker arrive together, and each would otherwise build a pool of its own."""

    def __init__(self, build: Callable[[int], T]) -> None:
        self._build = build
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._lock = threading.Lock()  # a fork copies a lock as it was: held, if a thread of the parent held it then

    def __call__(self) -> T:
        with self._lock:
            return self._build(os.getpid())


#: This process's runtime.
runtime = PerProcess(_runtime)
