"""The outbox relay, the only place Slack and GitHub are called: a pass finds the destinations whose line is due,
sends each line in order on a thread of its own, and asks the receiver before re-sending a message whose earlier
attempt's outcome is unknown (docs/explanation/runtime-outbox-and-workers.md#the-outbox-relay).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from agents.core import transition as core
from agents.core.errors import LostClaim, MessageNotDead, MessageNotFound
from agents.core.keys import request_id_of
from agents.core.observe import observe
from agents.outbox.credentials import not_configured, sender_token
from agents.outbox.identity import Planted
from agents.outbox.senders import (
    Delivered,
    FailureKind,
    GitHubSender,
    ScanLimit,
    Sender,
    SendFailed,
    SlackSender,
    redact,
)
from models.db import Database
from models.outbox_sql import (
    HEAD_PROBES,
    ClaimedMessage,
    Delivery,
    claim_run,
    due_destinations,
    message_row,
    record_dead,
    record_delivered,
    record_retry,
    release,
    renew,
    revive_txn,
)
from models.settings import Settings

log = logging.getLogger("keel.outbox")

#: Messages of one line claimed and confirmed together (sent one after the other, in order).
RUN_LENGTH = 50

#: Walks over the lines' heads (HEAD_PROBES each) a pass makes at most while it finds none due: 4,096 heads, some
#: tens of milliseconds.
WALKS_PER_PASS = 16

#: How far before a message's creation the reconciliation looks (receiver and database clocks differ a little).
CLOCK_SLACK = timedelta(minutes=2)


@dataclass
class RelayReport:
    sent: int = 0
    reconciled: int = 0
    retried: int = 0
    dead: int = 0
    lost: int = 0  # another relay took the message over: this one's outcome was dropped
    planted: int = 0  # messages at a receiver carrying a key that someone other than Keel wrote (ignored)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, outcome: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, outcome, getattr(self, outcome) + n)


@dataclass(frozen=True, slots=True)
class Backoff:
    base_seconds: float
    max_seconds: float
    max_attempts: int  # attempts that were not rate limited
    max_rate_limited: int = 200  # rate-limited attempts: a safety cap of their own

    def delay(self, attempts: int) -> float:
        delay: float = min(self.max_seconds, self.base_seconds * 2 ** max(0, attempts - 1))
        return delay * random.uniform(1.0, 1.25)


@dataclass(frozen=True, slots=True)
class Retry:
    delay: float
    error: str


@dataclass(frozen=True, slots=True)
class GiveUp:
    error: str


def next_step(message: ClaimedMessage, failure: SendFailed, error: str, backoff: Backoff) -> Retry | GiveUp:
    """What a failed attempt leads to. Rate limits wait as long as asked and count only toward their own cap;
    other failures back off and count toward ``max_attempts``; permanent ones give up at once."""
    if failure.kind == "permanent":
        return GiveUp(error)
    if failure.kind == "rate_limited":
        if message.rate_limited_attempts + 1 >= backoff.max_rate_limited:
            return GiveUp(
                f"rate limited {message.rate_limited_attempts + 1} times (KEEL_OUTBOX_MAX_RATE_LIMITED): {error}"
            )
        if failure.retry_after is not None:
            return Retry(failure.retry_after + random.uniform(0, 0.1), error)  # this destination waits, no other
        return Retry(backoff.delay(message.rate_limited_attempts + 1), error)
    if message.attempts >= backoff.max_attempts:
        return GiveUp(f"gave up after {message.attempts} attempts: {error}")
    return Retry(backoff.delay(message.attempts), error)


class Relay:
    def __init__(
        self,
        db: Database,
        senders: Mapping[str, Sender],
        *,
        lease: timedelta,
        concurrency: int,
        backoff: Backoff,
        pass_seconds: float,
        reconcile_pages: int = 10,
        reconcile_seconds: float | None = None,
        secrets: tuple[str, ...] = (),
        head_probes: int = HEAD_PROBES,
        walks: int = WALKS_PER_PASS,
    ) -> None:
        self.db = db
        self.head_probes = head_probes
        self.walks = walks
        self.senders = senders
        self.lease = lease
        self.concurrency = concurrency
        self.backoff = backoff
        self.pass_seconds = pass_seconds
        self.reconcile_pages = reconcile_pages
        # A reconciliation starts its last page before this budget runs out; that page and the send after it
        # must still fit in the lease renewed just before (the settings check the configured values).
        self.reconcile_seconds = reconcile_seconds if reconcile_seconds is not None else lease.total_seconds() / 3
        self.secrets = secrets
        # Where the next pass's look at the lines' heads starts (destination order): each pass goes on from where
        # the last one stopped, so every line gets its turn while a pass looks at a bounded number of them.
        self._cursor = ""
        self._cursor_lock = threading.Lock()

    @classmethod
    def from_settings(cls, db: Database, settings: Settings) -> Relay:
        senders: dict[str, Sender] = {}
        secrets = []
        if (token := sender_token(settings, "slack")) is not None:
            senders["slack"] = SlackSender(token, settings.slack_api_url, settings.http_timeout_seconds)
            secrets.append(token)
        if (token := sender_token(settings, "github")) is not None:
            senders["github"] = GitHubSender(token, settings.github_api_url, settings.http_timeout_seconds)
            secrets.append(token)
        return cls(
            db,
            senders,
            lease=timedelta(seconds=settings.outbox_lease_seconds),
            concurrency=settings.outbox_concurrency,
            backoff=Backoff(
                settings.outbox_backoff_seconds,
                settings.outbox_backoff_max_seconds,
                settings.outbox_max_attempts,
                settings.outbox_max_rate_limited,
            ),
            pass_seconds=settings.outbox_pass_seconds,
            reconcile_pages=settings.outbox_reconcile_max_pages,
            reconcile_seconds=settings.outbox_reconcile_seconds,
            secrets=tuple(secrets),
        )

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()

    def run_pass(self) -> RelayReport:
        """Relay what is due now: up to ``concurrency`` destinations at once, each line in order."""
        report = RelayReport()
        deadline = time.monotonic() + self.pass_seconds
        with self._cursor_lock:
            # Walk on past lines whose heads all back off, up to ``walks`` times, so a due line behind thousands of
            # them is found within a pass or a few; a walk that comes round to where an earlier one ended stops.
            ended = {self._cursor}
            for _ in range(self.walks):
                destinations, self._cursor = due_destinations(
                    self.db, self.concurrency, after=self._cursor, probes=self.head_probes
                )
                if destinations or self._cursor in ended or self._cursor == "" or time.monotonic() >= deadline:
                    break
                ended.add(self._cursor)
        if not destinations:
            return report
        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="keel-relay") as pool:
            for future in [pool.submit(self._drain, d, deadline, report) for d in destinations]:
                future.result()
        return report

    def _drain(self, destination: str, deadline: float, report: RelayReport) -> None:
        """Work down one destination's line, a run of messages at a time, while they go through and time lasts."""
        while time.monotonic() < deadline:
            run = claim_run(self.db, destination, self.lease, RUN_LENGTH)
            if not run or not self._send_run(run, report):
                return

    def _send_run(self, run: list[ClaimedMessage], report: RelayReport) -> bool:
        """Send a claimed run in order and confirm it in one write (a relay that dies first leaves it ``sending``, to
        be reconciled, not re-sent). The first failure is recorded and the rest given back; True if all went."""
        done: list[Delivery] = []
        try:
            for index, message in enumerate(run):
                outcome = self._attempt(run, message, report)
                if isinstance(outcome, Delivery):
                    done.append(outcome)
                    continue
                self._confirm(done, report)
                report.add(self._settle(message, outcome))
                release(self.db, run[index + 1 :])
                return False
            self._confirm(done, report)
            return True
        except LostClaim as exc:
            # Nothing more is sent. What did go out is confirmed only where this relay still holds the claim it
            # sent under; the rest is the other relay's to reconcile.
            log.warning("outbox %s: %s; this relay stops on that line", exc.key, exc, extra=_about(message))
            self._confirm(done, report)
            report.add("lost")
            return False

    def _confirm(self, done: list[Delivery], report: RelayReport) -> None:
        lost = record_delivered(self.db, done)
        for delivery in done:
            if delivery not in lost:
                report.add("sent" if delivery.how == "sent" else "reconciled")
        for delivery in lost:
            log.warning(
                "outbox %s: taken over by another relay; its confirmation is dropped",
                delivery.message.key,
                extra=_about(delivery.message),
            )
        report.add("lost", len(lost))
        done.clear()

    def _hold(self, run: list[ClaimedMessage], message: ClaimedMessage) -> None:
        """Renew the lease on the whole run, on the database's clock, or raise :class:`LostClaim`: called right
        before every reconciliation and every send, so neither can start on a claim this relay no longer holds."""
        if not renew(self.db, run, self.lease):
            raise LostClaim(message.key)

    def _attempt(
        self, run: list[ClaimedMessage], message: ClaimedMessage, report: RelayReport
    ) -> Delivery | SendFailed:
        with observe(
            "outbox_send",
            message.channel,
            **_about(message),
            traceparent=message.traceparent,  # the trace of the work that emitted it, on every attempt
        ) as op:
            outcome = self._attempt_once(run, message, report)
            op.outcome = outcome.how if isinstance(outcome, Delivery) else outcome.kind
            return outcome

    def _attempt_once(
        self, run: list[ClaimedMessage], message: ClaimedMessage, report: RelayReport
    ) -> Delivery | SendFailed:
        sender = self.senders.get(message.channel)
        if sender is None:
            return SendFailed("permanent", not_configured(message.channel))
        if message.needs_reconcile:
            self._hold(run, message)
            limit = ScanLimit(self.reconcile_pages, time.monotonic() + self.reconcile_seconds)
            try:
                lookup = sender.find(message.key, message.destination, message.created_at - CLOCK_SLACK, limit)
            except Exception as exc:  # a sender bug: keep the message, never lose the line
                return self._unexpected(message, exc, "transient")
            self._warn_planted(message, lookup.planted, report)
            found = lookup.outcome
            if isinstance(found, Delivered):
                return Delivery(message, found.external_id, found.url, "reconciled")
            if isinstance(found, SendFailed):  # cannot tell whether it arrived: do not send blind, wait
                kind: FailureKind = "rate_limited" if found.kind == "rate_limited" else "transient"
                return SendFailed(kind, f"cannot tell yet whether it arrived: {found.error}", found.retry_after)
        self._hold(run, message)
        try:
            result = sender.send(message.key, message.destination, message.payload)
        except Exception as exc:  # a sender bug: keep the message, never lose the line
            return self._unexpected(message, exc, "ambiguous")
        if isinstance(result, Delivered):
            return Delivery(message, result.external_id, result.url, "sent")
        return result

    @staticmethod
    def _warn_planted(message: ClaimedMessage, planted: tuple[Planted, ...], report: RelayReport) -> None:
        for other in planted:
            log.warning(
                "outbox %s: %s at %s carries this message's key but is not Keel's (written by %s): ignored",
                message.key,
                other.external_id,
                message.destination,
                other.author,
                extra=_about(message),
            )
        report.add("planted", len(planted))

    def _unexpected(self, message: ClaimedMessage, exc: Exception, kind: FailureKind) -> SendFailed:
        log.error("outbox %s: unexpected failure: %s", message.key, redact(repr(exc), *self.secrets))
        return SendFailed(kind, f"{type(exc).__name__}: {exc}")

    def _settle(self, message: ClaimedMessage, failure: SendFailed) -> str:
        error = redact(failure.error, *self.secrets)[:2000]
        ambiguous = failure.kind == "ambiguous"
        rate_limited = failure.kind == "rate_limited"
        step = next_step(message, failure, error, self.backoff)
        if isinstance(step, GiveUp):
            held = record_dead(self.db, message, error=step.error, ambiguous=ambiguous, rate_limited=rate_limited)
            if held:
                log.warning("outbox %s: dead: %s", message.key, step.error, extra=_about(message))
        else:
            held = record_retry(
                self.db,
                message,
                error=error,
                delay=timedelta(seconds=step.delay),
                ambiguous=ambiguous,
                rate_limited=rate_limited,
            )
            if held:
                log.info(
                    "outbox %s: %s, retry in %.1fs: %s",
                    message.key,
                    failure.kind,
                    step.delay,
                    error,
                    extra=_about(message),
                )
        if not held:
            log.warning(
                "outbox %s: taken over by another relay; this attempt's outcome is dropped",
                message.key,
                extra=_about(message),
            )
            return "lost"
        return "dead" if isinstance(step, GiveUp) else "retried"


def _about(message: ClaimedMessage) -> dict[str, Any]:
    """What a message is about: its key, request and agent (the send's context; the ``extra`` of a line about it
    logged outside the send)."""
    about = {"outbox_key": message.key, "request_id": request_id_of(message.key)}
    if message.agent_id is not None:  # Keel's own messages (alerts, reports) belong to no agent
        about["agent_id"] = str(message.agent_id)
    return about


def retry_dead(db: Database, key: str, *, actor: str) -> None:
    """An operator's retry of a dead message: back to pending (it reconciles first if it may have arrived),
    journaled on its agent's chain with who asked (Keel's own messages, which have no agent: logged)."""
    row = message_row(db, key)
    if row is None:
        raise MessageNotFound(key)
    if row["status"] != "dead":
        raise MessageNotDead(key, row["status"])
    revived: list[bool] = []

    def revive(cur: Any) -> None:
        revived.append(revive_txn(cur, key))

    if row["agent_id"] is None:
        # Keel's own message (an alert, the KPI report) belongs to no agent's chain: the retry is logged instead.
        with core.store_errors(), db.transaction() as cur:
            revive(cur)
        if not revived[0]:  # pragma: no cover - another operator won the race
            raise MessageNotDead(key, "no longer dead")
        log.warning("outbox %s: dead -> pending (retried by %s; a system message: not journaled)", key, actor)
        return

    core.record_side_event(
        db,
        row["agent_id"],
        kind="operator",
        event="outbox_retry",
        actor=actor,
        decision="dead_to_pending",
        details={"key": key, "last_error": row["last_error"], "attempts": row["attempts"]},
        effects=revive,
    )
    if not revived or not revived[0]:  # pragma: no cover - another operator won the race; journaled anyway
        raise MessageNotDead(key, "no longer dead")
