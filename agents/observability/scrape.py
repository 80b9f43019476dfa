"""How a collector that reads the database answers a scrape: from one read at most every few seconds, never queued
behind a read in progress, never waiting on the database longer than :data:`READ_TIMEOUT`, so a slow database
cannot tie up a thread per scrape (docs/explanation/runtime-outbox-and-workers.md#scrapes-that-read-the-database).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

from prometheus_client.core import Metric

#: A scrape's read of the database is cancelled after this long (below Prometheus's default 10 s scrape timeout).
READ_TIMEOUT = timedelta(seconds=5)
#: How long one read serves scrapes.
CACHE_SECONDS = 5.0


class CachedRead:
    """The metrics ``read()`` returns, read again at most every ``cache_seconds`` and by one scrape at a time; a scrape
    that finds a read in progress gets the previous read's metrics, or ``busy()`` if there is none yet."""

    def __init__(
        self,
        read: Callable[[], list[Metric]],
        busy: Callable[[], list[Metric]],
        *,
        cache_seconds: float = CACHE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.read = read
        self.busy = busy
        self.cache_seconds = cache_seconds
        self.clock = clock
        self._lock = threading.Lock()  # held for bookkeeping only, never during a read
        self._reading = False
        self._read_at: float | None = None
        self._metrics: list[Metric] | None = None

    def get(self) -> list[Metric]:
        with self._lock:
            now = self.clock()
            if self._metrics is not None and self._read_at is not None and now - self._read_at < self.cache_seconds:
                return list(self._metrics)
            if self._reading:
                return list(self._metrics) if self._metrics is not None else self.busy()
            self._reading = True
        try:
            metrics = self.read()
        finally:
            with self._lock:
                self._reading = False
        with self._lock:
            self._metrics, self._read_at = metrics, now
        return list(metrics)
