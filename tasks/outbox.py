"""The outbox relay task: a beat task on its own queue; each run is one relay pass."""

from __future__ import annotations

import logging
import os
from functools import cache

from celery import shared_task

from agents.outbox.relay import Relay
from tasks.app import RELAY_OUTBOX
from tasks.runtime import runtime

log = logging.getLogger("keel.tasks")


@cache
def _relay(pid: int) -> Relay:
    rt = runtime()
    return Relay.from_settings(rt.db, rt.settings)


@shared_task(name=RELAY_OUTBOX)  # type: ignore[untyped-decorator]
def relay_outbox() -> dict[str, int]:
    report = _relay(os.getpid()).run_pass()
    if report.sent or report.reconciled or report.dead or report.retried:
        log.info("outbox pass: %s", report)
    return {"sent": report.sent, "reconciled": report.reconciled, "retried": report.retried, "dead": report.dead}
