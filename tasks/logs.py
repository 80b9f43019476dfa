"""What Keel's Celery processes log at INFO: the jobs, not the housekeeping.

Beat sends the outbox relay task every ``KEEL_OUTBOX_INTERVAL_SECONDS`` (half a second by default); Celery would
log "Sending due task" in beat and "Task … received" / "Task … succeeded" in the worker for every one of them, and
bury the jobs' lines. Those three lines are logged at DEBUG for the housekeeping tasks (``-l debug`` shows them);
every other task keeps them at INFO. What a relay pass did (sent, retried, dead) is still logged at INFO.

Likewise a job message handed back to the broker while the database is away (:class:`HandedBack`): Celery would log
a traceback for each one, every few seconds for as long as the outage lasts; the outage itself is logged once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from celery.exceptions import Reject

#: Where Celery logs those lines: "Task … received", "Task … succeeded", "Scheduler: Sending due task".
CELERY_LOGGERS = ("celery.worker.strategy", "celery.app.trace", "celery.beat")


class HandedBack(Reject):  # type: ignore[misc]
    """A job's message handed back to the broker because the database could not be reached."""


class HousekeepingAtDebug(logging.Filter):
    """Turns Celery's INFO lines about the given tasks, and its lines about :class:`HandedBack` messages, into DEBUG
    lines without a traceback (dropped unless DEBUG is on)."""

    def __init__(self, tasks: Iterable[str]) -> None:
        super().__init__()
        self.tasks = frozenset(tasks)

    def filter(self, record: logging.LogRecord) -> bool:
        handed_back = record.exc_info is not None and isinstance(record.exc_info[1], HandedBack)
        if not handed_back and (record.levelno != logging.INFO or _task_of(record) not in self.tasks):
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        record.exc_info, record.exc_text = None, None
        return True


def _task_of(record: logging.LogRecord) -> str | None:
    args = record.args
    if isinstance(args, Mapping):  # received / succeeded: a context dict with the task's name
        name = args.get("name")
        return name if isinstance(name, str) else None
    if record.name == "celery.beat" and isinstance(args, tuple) and len(args) == 2:  # (entry name, task name)
        return str(args[1])
    return None


def quiet_housekeeping(tasks: Iterable[str]) -> None:
    """Install the filter on Celery's loggers (once; later calls replace it)."""
    quiet = HousekeepingAtDebug(tasks)
    for name in CELERY_LOGGERS:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, HousekeepingAtDebug)]:
            logger.removeFilter(old)
        logger.addFilter(quiet)
