"""The lease keeper: one thread per worker process renews the leases of the jobs running in it, so a live step is
never recovered and run twice, and a step whose lease was taken over learns it."""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import psycopg
import sqlalchemy.exc

from agents.core.outage import Outage, is_outage
from models.db import Database
from models.jobs_sql import extend_lease

log = logging.getLogger("keel.runner")  # part of running a job: the runner's logger


class LeaseKeeper:
    """One thread per process renews the leases of the jobs running in it, every third of the lease; a job whose
    lease was taken over (or cancelled) gets its ``lost`` flag set and is dropped."""

    def __init__(self, db: Database, lease: timedelta, outage: Outage | None = None) -> None:
        self.db = db
        self.lease = lease
        self.outage = outage or Outage("database", log)
        # Keyed by (key, token): a fenced-off older run ending must not drop a newer claim's renewal.
        self._held: dict[tuple[str, int], tuple[threading.Event, contextvars.Context]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @contextmanager
    def hold(self, key: str, token: int, lost: threading.Event) -> Iterator[None]:
        with self._lock:
            self._held[(key, token)] = (lost, contextvars.copy_context())
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._renew_forever, name="keel-leases", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._held.pop((key, token), None)

    def _renew_forever(self) -> None:
        interval = self.lease.total_seconds() / 3
        # After a failed renewal (the database restarting) try again every second, not a third of a lease later:
        # the lease must be renewed before it runs out, or a live step is recovered and runs twice.
        retry = min(1.0, interval)
        wait = interval
        while True:
            time.sleep(wait)
            with self._lock:
                held = list(self._held.items())
            wait = interval
            for (key, token), (lost, context) in held:
                # In the job's context: a line about its lease carries the job's request, agent and key.
                if not context.run(self._renew, key, token, lost, retry):
                    wait = retry

    def _renew(self, key: str, token: int, lost: threading.Event, retry: float) -> bool:
        """Renew one job's lease; False if the database could not be asked (try again in ``retry`` seconds)."""
        try:
            renewed = extend_lease(self.db, key, token, self.lease)
        except (psycopg.Error, sqlalchemy.exc.SQLAlchemyError) as exc:
            if not is_outage(exc):
                log.warning("job %s: lease renewal failed; retrying in %.1fs", key, retry, exc_info=True)
            else:  # one line per outage, not one per second (the retry does not back off: see above)
                self.outage.failed(exc)
            return False
        self.outage.recovered()
        if not renewed:
            lost.set()
            with self._lock:
                self._held.pop((key, token), None)
        return True
