"""Run an agent's due jobs in-process, as a worker would, until none is left."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

import psycopg

import agents.runtime.loop  # noqa: F401 - registers plan, tool and gate
from agents.core.policies import DEFAULT_RULES, ErrorClass, RetryRule
from agents.jobs.handlers import registry
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
