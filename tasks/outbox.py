"""The outbox relay task: a beat task on its own queue; each run is one relay pass. A worker that takes that queue
says at start which senders have no token (their messages would go dead unsent)."""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

from celery import shared_task
from celery.signals import worker_ready

from agents.core.outage import unreachable
from agents.outbox.credentials import missing_senders
from agents.outbox.relay import Relay
from models.settings import Settings
from tasks.app import OUTBOX_QUEUE, RELAY_OUTBOX
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


@worker_ready.connect(weak=False)  # type: ignore[untyped-decorator]
def _warn_missing_senders(sender: Any = None, **_: Any) -> None:
    # Said once, as the worker that runs the relay starts, rather than found later on a dead message.
    if sender is None or OUTBOX_QUEUE not in sender.app.amqp.queues.consume_from:
        return
    for warning in missing_senders(Settings()):
        logging.getLogger("keel.outbox").warning("%s", warning)
