"""Run jobs in-process, as a worker would: every due job until none is left (:func:`run_all`), or through a runner
with handlers of the test's own (:func:`make_runner`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import psycopg

import agents.runtime.loop  # noqa: F401 - registers plan, tool and gate
from agents.core.policies import DEFAULT_RULES, ErrorClass, RetryRule
from agents.jobs.handlers import JobContext, JobResult, Registry, registry
from agents.jobs.runner import Runner
from models.db import Database

#: Transient failures retried at once (no backoff to wait out in a test).
FAST_RULES = {**DEFAULT_RULES, ErrorClass.TRANSIENT: RetryRule(3, 0.0, 0.0, 0.0)}


def run_all(db: Database, limit: int = 50, rules: Mapping[ErrorClass, RetryRule] = FAST_RULES) -> list[str]:
    """Run due jobs in creation order until none is left (a worker, in-process); the keys it ran."""
    runner = Runner(db, registry, worker="t", lease=timedelta(seconds=30), rules=dict(rules))
    ran = []
    for _ in range(limit):
        with psycopg.connect(db.libpq_url) as conn:
            row = conn.execute(
                "SELECT key FROM jobs WHERE status IN ('pending', 'enqueued') AND run_at <= now() + interval '1 second'"
                " ORDER BY created_at, key LIMIT 1"
            ).fetchone()
        if row is None:
            return ran
        runner.run(row[0])
        ran.append(row[0])
    raise AssertionError(f"still running after {limit} jobs: {ran[-5:]}")


def make_runner(
    db: Database, handlers: dict[str, Callable[[JobContext], JobResult]] | None = None, **kw: Any
) -> Runner:
    """A worker's runner; with ``handlers``, those are its whole registry (else the global one: plan, tool, gate)."""
    own: Registry = registry
    if handlers:
        own = Registry()
        for name, fn in handlers.items():
            own.register(name, fn)
    return Runner(db, own, worker="w", lease=timedelta(seconds=30), rules=DEFAULT_RULES, **kw)
