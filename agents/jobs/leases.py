"""The lease keeper: one thread per worker process renews the leases of every job running in it, in one statement,
so a live step is never recovered and run twice, and a step whose lease was taken over learns it."""

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
from models.jobs_sql import extend_leases

log = logging.getLogger("keel.runner")  # part of running a job: the runner's logger


class LeaseKeeper:
    """One thread per process renews the leases of the jobs running in it, every third of the lease, with one
    statement for all of them; a job whose lease was taken over (or cancelled) gets its ``lost`` flag set and is
    dropped."""

    def __init__(self, db: Database, lease: timedelta, outage: Outage | None = None) -> None:
        self.db = db
        self.lease = lease
        self.outage = outage or Outage("database", log)
        # Keyed by (key, token): a fenced-off older run ending must not drop a newer claim's renewal.
        self._held: dict[tuple[str, int], tuple[threading.Event, contextvars.Context]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._renewed_at = time.monotonic()  # the last round that reached the database

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

    def held(self) -> int:
        """How many jobs this process runs now."""
        with self._lock:
            return len(self._held)

    def _give_up(self, held: dict[tuple[str, int], tuple[threading.Event, contextvars.Context]]) -> None:
        """No renewal reached the database for a whole lease: another worker may have taken these jobs over, so
        their runs stop here (what they write is refused: ``lost``)."""
        for pair, (lost, context) in held.items():
            with self._lock:
                self._held.pop(pair, None)
            context.run(log.warning, "job %s: its lease went unrenewed for a whole lease; this run stops", pair[0])
            lost.set()

    def _renew_forever(self) -> None:
        interval = self.lease.total_seconds() / 3
        # After a failed renewal (the database restarting) try again every second, not a third of a lease later:
        # the lease must be renewed before it runs out, or a live step is recovered and runs twice.
        retry = min(1.0, interval)
        wait = interval
        while True:
            time.sleep(wait)
            wait = interval if self._renew_all(retry) else retry

    def _renew_all(self, retry: float) -> bool:
        """Renew every lease held; False if the database could not be asked (try again in ``retry`` seconds)."""
        with self._lock:
            held = dict(self._held)
        if not held:
            # Nothing to renew is as good as renewed: a job claimed after a long idle spell has a fresh lease, and its
            # first failed round must not count the idle spell as time without a renewal (it would stop at once).
            self._renewed_at = time.monotonic()
            return True
        try:
            renewed = extend_leases(self.db, list(held), self.lease)
        except (psycopg.Error, sqlalchemy.exc.SQLAlchemyError) as exc:
            if not is_outage(exc):
                log.warning("%d leases: renewal failed; retrying in %.1fs", len(held), retry, exc_info=True)
            else:  # one line per outage, not one per second (the retry does not back off: see above)
                self.outage.failed(exc)
            if time.monotonic() - self._renewed_at > self.lease.total_seconds():
                self._give_up(held)
            return False
        self._renewed_at = time.monotonic()
        self.outage.recovered()
        for pair, (lost, context) in held.items():
            if pair in renewed:
                continue
            with self._lock:
                if self._held.pop(pair, None) is None:
                    continue  # its run ended meanwhile: it wrote its outcome, nothing was lost
            # In the job's context: the line about its lease carries the job's request, agent and key.
            context.run(log.info, "job %s: its lease was taken over or its job was ended; this run stops", pair[0])
            lost.set()
        return True
