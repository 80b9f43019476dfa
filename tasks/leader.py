"""What the leading beat does besides dispatching: its heartbeat, alerts, the audit verify, shipping the journal, the
journal's partitions ahead, the daily KPI report and retention's prune, each due on the database's clock so no chore
runs more often than its interval; the slow ones run on threads of their own
(docs/explanation/runtime-outbox-and-workers.md#the-leaders-chores).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from agents.audit.ship import ShipperBusy, ship_configured
from agents.audit.verify import verify_and_record
from agents.core.journal.verdict import Verdict
from agents.core.outage import unreachable
from agents.observability import alerts, report
from models import alerts_sql, partitions_sql, retention_sql
from models.alerts_sql import Term
from models.db import Database
from models.settings import Settings

log = logging.getLogger("keel.leader")

ALERTS_CHORE = "alerts"
AUDIT_VERIFY_CHORE = "audit_verify"
AUDIT_SHIP_CHORE = "audit_ship"
JOURNAL_PARTITIONS_CHORE = "journal_partitions"
PRUNE_CHORE = "prune"
#: How often the leading beat makes sure the journal has its months ahead (and each time it starts leading).
JOURNAL_PARTITIONS_EVERY = timedelta(days=1)


class LeaderDuties:
    def __init__(self, db: Database, settings: Settings, name: str | None = None) -> None:
        self.db = db
        self.settings = settings
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.term: Term | None = None
        self._term_number = -1
        # Chores are due on the database's clock; this only spares asking it on every tick.
        self._ask_every = min(1.0, settings.alert_interval_seconds / 4)
        self._next_ask = 0.0
        self._verifying: threading.Thread | None = None
        self._shipping: threading.Thread | None = None
        self._pruning: threading.Thread | None = None
        self._partitions_now = True  # at the start of every term, whenever the chore last ran

    def chores_under_way(self) -> list[threading.Thread]:
        """The chores running on threads of their own (audit verify, shipping, pruning), for a close to wait for:
        each holds a pooled connection until it ends."""
        return [t for t in (self._verifying, self._shipping, self._pruning) if t is not None and t.is_alive()]

    def stand_down(self) -> None:
        """This beat no longer leads: the next time it does is a new term."""
        self.term = None

    def tick(self, term_number: int) -> None:
        """One leader tick. ``term_number`` changes each time this beat acquires leadership anew."""
        if self.term is None or term_number != self._term_number:
            self.term = alerts_sql.start_term(self.db, self.name)
            self._term_number = term_number
            self._partitions_now = True
            gap = self.term.gap_seconds
            if gap is not None and gap > self.settings.alert_beat_leader_gap_max_seconds:
                log.warning("no beat led for %.0f s before this one", gap)
        else:
            alerts_sql.heartbeat(self.db, self.term.id)
        now = time.monotonic()
        if now < self._next_ask:
            return
        self._next_ask = now + self._ask_every
        self._chore("alert evaluation", self._alerts)
        self._chore("audit verify", self._audit_verify)
        self._chore("audit ship", self._audit_ship)
        self._chore("journal partitions", self._journal_partitions)
        self._chore("prune", self._prune)

    def _chore(self, what: str, run: Callable[[], None]) -> None:
        try:
            run()
        except Exception as exc:  # one chore failing must not stop the others (or the dispatcher)
            if unreachable(exc):
                raise
            log.exception("%s failed; trying again at its next interval", what)

    def _alerts(self) -> None:
        every = timedelta(seconds=self.settings.alert_interval_seconds)
        if alerts_sql.claim_chore(self.db, ALERTS_CHORE, every) is None:
            return
        alerts.evaluate_and_record(self.db, self.settings)
        self._chore("the daily KPI report", self._report)

    def _report(self) -> None:
        key = report.post_daily_report(self.db, self.settings)
        if key is not None:
            log.info("daily KPI report queued: %s", key)

    def _audit_verify(self) -> None:
        seconds = self.settings.audit_verify_interval_seconds
        if not seconds or (self._verifying is not None and self._verifying.is_alive()):
            return
        if alerts_sql.claim_chore(self.db, AUDIT_VERIFY_CHORE, timedelta(seconds=seconds)) is None:
            return
        self._verifying = threading.Thread(target=self._verify, name="keel-audit-verify", daemon=True)
        self._verifying.start()

    def _verify(self) -> None:
        try:
            every = self.settings.audit_verify_full_interval_seconds
            # Due by the last full pass recorded (sealed, the CLI's too): a restart does not put it off, and one that
            # died midway recorded nothing, so the next run is full again.
            age = alerts_sql.last_full_age(self.db) if every else None
            full = bool(every) and (age is None or age >= every)
            result = verify_and_record(
                self.db,
                "beat",
                full=full,
                chunk_chains=self.settings.audit_verify_chunk_chains,
                chunk_events=self.settings.audit_verify_chunk_events,
            )
        except Exception:
            log.exception("periodic audit verify failed to run")
            return
        if result.ok:
            log.info("audit verify %s", Verdict.of(result).text())
        else:
            log.error(
                "audit verify: %d broken chains, %d events not checked (their key is not in KEEL_AUDIT_KEYS);"
                " keel audit verify names them",
                len(result.breaks),
                sum(u.events for u in result.unchecked),
            )

    def _journal_partitions(self) -> None:
        # Catalog changes only, on empty tables; the function waits at most seconds for its lock.
        due = alerts_sql.claim_chore(self.db, JOURNAL_PARTITIONS_CHORE, JOURNAL_PARTITIONS_EVERY) is not None
        if not (due or self._partitions_now):
            return
        self._partitions_now = False
        created = partitions_sql.ensure_partitions(self.db, self.settings.audit_partition_months_ahead)
        for name in created:
            log.info("journal partitions: created audit.%s", name)

    def _prune(self) -> None:
        seconds = self.settings.prune_interval_seconds
        retention = retention_sql.Retention.of(self.settings)
        if not seconds or retention.keeps_everything:
            return
        if self._pruning is not None and self._pruning.is_alive():
            return
        if alerts_sql.claim_chore(self.db, PRUNE_CHORE, timedelta(seconds=seconds)) is None:
            return
        self._pruning = threading.Thread(target=self._run_prune, args=(retention,), name="keel-prune", daemon=True)
        self._pruning.start()

    def _run_prune(self, retention: retention_sql.Retention) -> None:
        try:
            pruned = retention_sql.prune(self.db, retention)
        except Exception:
            log.exception("prune failed; trying again at its next interval (keel db prune --dry-run says what is due)")
            return
        if pruned.total:
            log.info(
                "prune: %d jobs, %d outbox messages with %d delivery log rows, %d request inputs",
                pruned.jobs,
                pruned.messages,
                pruned.confirmations,
                pruned.requests,
            )

    def _audit_ship(self) -> None:
        seconds = self.settings.audit_ship_interval_seconds
        if not seconds or self.settings.audit_ship_url is None:
            return
        if self._shipping is not None and self._shipping.is_alive():
            return
        if alerts_sql.claim_chore(self.db, AUDIT_SHIP_CHORE, timedelta(seconds=seconds)) is None:
            return
        self._shipping = threading.Thread(target=self._ship, name="keel-audit-ship", daemon=True)
        self._shipping.start()

    def _ship(self) -> None:
        try:
            report = ship_configured(self.db, self.settings)
        except ShipperBusy:
            log.info("audit ship: another shipper (keel audit ship?) is shipping; trying again at the next interval")
            return
        except Exception:
            log.exception("audit ship failed; trying again at its next interval (keel audit ship says why)")
            return
        for note in report.notes:
            log.warning("audit ship: %s", note)
        for s in report.segments:
            log.info("audit ship: %s, %d events (ids %d..%d)", s.segment, s.events, s.first_id, s.last_id)
