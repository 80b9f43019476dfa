"""Dispatchers racing on one database: what each took, in one list; and what they published to the broker."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

from models.db import Database
from models.dispatch_sql import take_due
from tests.support.broker import Broker


def race_dispatchers(db: Database, *, dispatchers: int = 4, batch: int = 3) -> list[str]:
    """Start ``dispatchers`` threads at once, each taking due jobs ``batch`` at a time, one transaction per batch,
    until none is left; the keys they took, every one of them (a key taken twice is there twice)."""
    taken: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(dispatchers)

    def dispatcher() -> None:
        barrier.wait()
        while True:
            with db.transaction() as cur:
                due = take_due(cur, enqueue_timeout=timedelta(minutes=5), limit=batch)
            if not due:
                return
            with lock:
                taken.extend(d.key for d in due)

    threads = [threading.Thread(target=dispatcher) for _ in range(dispatchers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return taken


def published(broker: Broker, queue: str = "keel.jobs") -> list[str]:
    """The task ids (job keys) of the messages waiting on ``queue``, oldest first."""
    with broker.redis() as redis:
        raw = redis.lrange(broker.key(queue), 0, -1)
    return [json.loads(m)["headers"]["id"] for m in raw]
