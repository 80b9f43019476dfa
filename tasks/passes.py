"""The leading beat's timed passes (schedules, deadlines, approval timeouts, the KPI fold), each on a thread of its
own so a slow one never holds up dispatching; a pass is safe to run twice at once, so one still running after
leadership is lost does no harm (docs/explanation/runtime-outbox-and-workers.md#timed-passes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from agents.core.outage import unreachable

log = logging.getLogger("keel.dispatcher")


class TimedPass:
    """One pass run every ``every`` seconds at most, never two of it at once."""

    def __init__(self, name: str, every: float, run: Callable[[], None]) -> None:
        self.name = name
        self.every = every
        self._run = run
        self._next = 0.0
        self._thread: threading.Thread | None = None
        self._outage: BaseException | None = None
        self._outage_run_started = 0.0  # when the run that met the outage started (the monotonic clock)
        self._lock = threading.Lock()

    def poke(self, now: float, *, back_since: float = 0.0) -> BaseException | None:
        """Start the pass if it is due (``now``: monotonic) and not running. Returns, once, the error with which the
        last run found the database away, for the caller's backoff; a run that started before ``back_since`` (the
        database came back since) is only logged."""
        with self._lock:
            outage, self._outage = self._outage, None
            run_started = self._outage_run_started
        if outage is not None:
            if run_started >= back_since:
                return outage
            log.info("%s pass met the database outage that has ended (%s); it runs again when due", self.name, outage)
        if now < self._next or self.running():
            return None
        self._next = now + self.every
        self._thread = threading.Thread(target=self._body, name=f"keel-{self.name}", daemon=True)
        self._thread.start()
        return None

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _body(self) -> None:
        started = time.monotonic()
        try:
            self._run()
        except Exception as exc:  # a pass that failed is tried again at its next interval; dispatching goes on
            if unreachable(exc):
                with self._lock:
                    self._outage, self._outage_run_started = exc, started
                return
            log.exception("%s pass failed; retrying at its next interval", self.name)
