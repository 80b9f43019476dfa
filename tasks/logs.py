"""What Keel's Celery processes log at INFO: the jobs, not the housekeeping (the relay task's send and receive lines, a
traceback per message handed back during an outage, a warning that does not apply go to DEBUG), in Keel's line format,
with the job's key and request added to Celery's own lines
(docs/explanation/runtime-outbox-and-workers.md#what-celery-processes-log).
"""

from __future__ import annotations

import logging
import multiprocessing.util
from collections.abc import Iterable, Mapping
from typing import Any

from celery.exceptions import Reject
from celery.signals import after_setup_logger, after_setup_task_logger

from agents.core.keys import request_id_of
from agents.observability.logs import restyle, use_structlog

#: Where Celery logs those lines: "Task … received", "Task … succeeded", "Scheduler: Sending due task".
CELERY_LOGGERS = ("celery.worker.strategy", "celery.app.trace", "celery.beat")
#: Where Celery's warnings go (it turns on ``logging.captureWarnings``).
WARNINGS_LOGGER = "py.warnings"
#: The setting whose default-will-change warning Celery repeats at every lost broker connection.
SETTLED = "worker_cancel_long_running_tasks_on_connection_loss"


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
        return _at_debug(record)


class SettledWarningAtDebug(logging.Filter):
    """Turns Celery's warning about :data:`SETTLED` (a setting Keel sets) into a DEBUG line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return SETTLED not in record.getMessage() or _at_debug(record)


class NamesTheJob(logging.Filter):
    """Adds ``job_key`` (the task id: a job's key) and ``request_id`` (the key's first part) to Celery's lines about
    the given task, which name the job only in their text."""

    def __init__(self, task: str) -> None:
        super().__init__()
        self.task = task

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        key = args.get("id") if isinstance(args, Mapping) and args.get("name") == self.task else None
        if isinstance(key, str):
            record.job_key = key
            try:
                record.request_id = request_id_of(key)
            except ValueError:  # not a job key: the line keeps what it says
                pass
        return True


def _at_debug(record: logging.LogRecord) -> bool:
    """Make ``record`` a DEBUG line without a traceback; False (drop it) unless its logger shows DEBUG."""
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


def quiet_housekeeping(tasks: Iterable[str], job_task: str | None = None) -> None:
    """Install the filters on Celery's loggers and on its warnings' (once; later calls replace them); with
    ``job_task``, :class:`NamesTheJob` for that task's lines."""
    quiet = HousekeepingAtDebug(tasks)
    for name in CELERY_LOGGERS:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, HousekeepingAtDebug | NamesTheJob)]:
            logger.removeFilter(old)
        logger.addFilter(quiet)
        if job_task is not None:
            logger.addFilter(NamesTheJob(job_task))
    warnings_logger = logging.getLogger(WARNINGS_LOGGER)
    for stale in [f for f in warnings_logger.filters if isinstance(f, SettledWarningAtDebug)]:
        warnings_logger.removeFilter(stale)
    warnings_logger.addFilter(SettledWarningAtDebug())


def structured_logs(role: str, json: bool | None) -> None:
    """In a worker or beat (``role``) about to start: the handlers Celery sets up (the root logger's, its task
    logger's, multiprocessing's) write Keel's log lines (``json``; None: chosen from each handler's stream), and
    structlog goes through them. Celery keeps its levels, its log file and its housekeeping of the root logger."""
    use_structlog()

    def restyled(logger: logging.Logger | None = None, **_: Any) -> None:
        loggers = [logging.getLogger(), multiprocessing.util.get_logger(), *([logger] if logger else [])]
        restyle({handler for each in loggers for handler in each.handlers}, role, json)

    after_setup_logger.connect(restyled, weak=False, dispatch_uid="keel-structured-logs")
    after_setup_task_logger.connect(restyled, weak=False, dispatch_uid="keel-structured-task-logs")
