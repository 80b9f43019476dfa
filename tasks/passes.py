"""The leading beat's timed passes — schedules, deadlines, approval timeouts — each on a thread of its own.

They used to run inside the dispatcher's tick, one after the other: a deadline pass over many agents, or a schedule
pass waiting on a lock, held up every job behind it. Now the tick only starts a pass that is due and not already
running (on a thread of its own, like the audit verify in tasks/leader.py) and goes on dispatching.

Still one leader: a pass is only ever started by a tick that has just confirmed this beat holds the lock. A pass
already running when leadership is lost runs to its end; that is safe, because every pass is safe to run twice at
once (each move is a transition under the agent's lock that a lost race turns into a rejection, and due schedules
are locked with ``SKIP LOCKED`` and fire under a deterministic request id). What is due is judged on the
database's clock inside each pass; the host's monotonic clock only spaces the attempts.
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
        """Start the pass if it is due (``now``: the monotonic clock) and not running. Returns the error that made
        the last run find the database away, once, for the caller's backoff; None otherwise. ``back_since``: when
        the caller last saw the database come back after an outage (0: never). A run that started before then met
        that outage, which has ended: saying it now would log a second "database down" right after "database
        back", so it is logged as such instead, and the pass runs again when due."""
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
