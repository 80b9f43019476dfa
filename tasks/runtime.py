"""What a worker or beat process holds: settings, one database pool per process, the handler registry."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from functools import cache

from agents.handlers import Registry, load
from agents.policies import rules_with
from agents.runner import Runner
from models.db import Database
from models.settings import Settings


@dataclass(frozen=True)
class Runtime:
    settings: Settings
    db: Database
    runner: Runner


@cache
def _runtime(pid: int) -> Runtime:
    # Keyed by pid: a forked pool child must not share its parent's connections.
    settings = Settings()
    db = Database.from_settings(settings)
    registry: Registry = load(settings.imports)
    runner = Runner(
        db,
        registry,
        worker=f"{socket.gethostname()}:{pid}",
        lease=timedelta(seconds=settings.job_lease_seconds),
        rules=rules_with(settings.retry_policy),
        publish_due=True,
    )
    return Runtime(settings, db, runner)


def runtime() -> Runtime:
    return _runtime(os.getpid())
