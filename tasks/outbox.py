"""The outbox relay task: a beat task on its own queue; each run is one relay pass."""

from __future__ import annotations

import logging
from functools import cache

from celery import shared_task

from agents.core.outage import unreachable
from agents.outbox.relay import Relay
from tasks.app import RELAY_OUTBOX
from tasks.runtime import PerProcess, runtime

log = logging.getLogger("keel.tasks")


@cache
def _build_relay(pid: int) -> Relay:
    rt = runtime()
    return Relay.from_settings(rt.db, rt.settings)


#: This process's relay (passes may run at once on the threads of one worker: they share it).
_relay = PerProcess(_build_relay)


@shared_task(name=RELAY_OUTBOX)  # type: ignore[untyped-decorator]
def relay_outbox() -> dict[str, int]:
    outage = runtime().outage
    if outage.wait():
        # The database is away and the backoff has not passed: skip this pass (beat sends one every
        # KEEL_OUTBOX_INTERVAL_SECONDS) rather than fail it with a traceback.
        return {"sent": 0, "reconciled": 0, "retried": 0, "dead": 0}
    try:
        report = _relay().run_pass()
    except Exception as exc:
        if not unreachable(exc):
            raise
        outage.failed(exc)  # one line when the database goes down; what was claimed is re-claimed after its lease
        return {"sent": 0, "reconciled": 0, "retried": 0, "dead": 0}
    outage.recovered()
    if report.sent or report.reconciled or report.dead or report.retried:
        log.info("outbox pass: %s", report)
    return {"sent": report.sent, "reconciled": report.reconciled, "retried": report.retried, "dead": report.dead}
