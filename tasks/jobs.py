"""The job task. Its Celery task id is the job key; it only hands the key to the runner."""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task

from tasks.app import RUN_JOB, publish
from tasks.runtime import runtime

log = logging.getLogger("keel.tasks")


@shared_task(name=RUN_JOB, bind=True)  # type: ignore[untyped-decorator]
def run_job(self: Any, key: str) -> str:
    """Run job ``key`` once. Duplicate deliveries are suppressed by the claim, not by Celery."""
    if self.request.id != key:
        log.warning("run_job for %s arrived with task id %s; the key is what counts", key, self.request.id)
    outcome = runtime().runner.run(key)
    if outcome.to_publish:
        publish(outcome.to_publish, self.app)
    log.info("job %s: %s %s", key, outcome.status, outcome.detail)
    return outcome.status
