"""The outbox relay: the only place Slack and GitHub are called.

A pass claims the due head of each destination's line, then works through each line in its own thread (bounded by
``KEEL_OUTBOX_CONCURRENCY``): a message is sent only after every earlier one to the same destination is settled, so
nothing overtakes. Before re-sending a message whose previous attempt's outcome is unknown, the relay asks the
receiver whether it already has it (by the key it carries) and, if so, records it as delivered without sending.
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

from agents import core
from agents.errors import InvalidInput
from agents.receivers import Delivered, FailureKind, GitHubReceiver, Receiver, SendFailed, SlackReceiver, redact
from models.db import Database
from models.outbox_sql import (
    ClaimedMessage,
    Delivery,
    LostClaim,
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

#: How far before a message's creation the reconciliation looks (receiver and database clocks differ a little).
CLOCK_SLACK = timedelta(minutes=2)


@dataclass
class RelayReport:
    sent: int = 0
    reconciled: int = 0
    retried: int = 0
    dead: int = 0
    lost: int = 0  # another relay took the message over: this one's outcome was dropped
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, outcome: str) -> None:
        with self._lock:
            setattr(self, outcome, getattr(self, outcome) + 1)


@dataclass(frozen=True, slots=True)
class Backoff:
    base_seconds: float
    max_seconds: float
    max_attempts: int

    def delay(self, attempts: int) -> float:
        delay: float = min(self.max_seconds, self.base_seconds * 2 ** max(0, attempts - 1))
        return delay * random.uniform(1.0, 1.25)


class Relay:
    def __init__(
        self,
        db: Database,
        receivers: Mapping[str, Receiver],
        *,
        lease: timedelta,
        concurrency: int,
        backoff: Backoff,
        pass_seconds: float,
        secrets: tuple[str, ...] = (),
    ) -> None:
        self.db = db
        self.receivers = receivers
        self.lease = lease
        self.concurrency = concurrency
        self.backoff = backoff
        self.pass_seconds = pass_seconds
        self.secrets = secrets

    @classmethod
    def from_settings(cls, db: Database, settings: Settings) -> Relay:
        receivers: dict[str, Receiver] = {}
        secrets = []
        if settings.slack_token is not None:
            token = settings.slack_token.get_secret_value()
            receivers["slack"] = SlackReceiver(token, settings.slack_api_url, settings.http_timeout_seconds)
            secrets.append(token)
        if settings.github_token is not None:
            token = settings.github_token.get_secret_value()
            receivers["github"] = GitHubReceiver(token, settings.github_api_url, settings.http_timeout_seconds)
            secrets.append(token)
        return cls(
            db,
            receivers,
            lease=timedelta(seconds=settings.outbox_lease_seconds),
            concurrency=settings.outbox_concurrency,
            backoff=Backoff(
                settings.outbox_backoff_seconds, settings.outbox_backoff_max_seconds, settings.outbox_max_attempts
            ),
            pass_seconds=settings.outbox_pass_seconds,
            secrets=tuple(secrets),
        )

    def close(self) -> None:
        for receiver in self.receivers.values():
            receiver.close()

    def run_pass(self) -> RelayReport:
        """Relay what is due now: up to ``concurrency`` destinations at once, each line in order."""
        report = RelayReport()
        deadline = time.monotonic() + self.pass_seconds
        destinations = due_destinations(self.db, core.now(), self.concurrency)
        if not destinations:
            return report
        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="keel-relay") as pool:
            for future in [pool.submit(self._drain, d, deadline, report) for d in destinations]:
                future.result()
        return report

    def _drain(self, destination: str, deadline: float, report: RelayReport) -> None:
        """Work down one destination's line, a run of messages at a time, while they go through and time lasts."""
        while time.monotonic() < deadline:
            claimed_at = time.monotonic()  # before the claim: the lease surely lasts until claimed_at + lease
            run = claim_run(self.db, destination, core.now(), self.lease, RUN_LENGTH)
            if not run or not self._send_run(run, report, claimed_at):
                return

    def _send_run(self, run: list[ClaimedMessage], report: RelayReport, claimed_at: float) -> bool:
        """Send a claimed run in order. Confirmations are written once for the run: should the relay die first, the
        messages are still ``sending`` and get reconciled, not re-sent. Stops at the first failure, which is
        recorded, and gives the rest of the run back untouched. True if the whole run went through."""
        done: list[Delivery] = []
        try:
            for index, message in enumerate(run):
                try:
                    if time.monotonic() - claimed_at > self.lease.total_seconds() / 2:
                        # Half the lease is gone: renew it before sending more. A relay that stalled past its lease
                        # learns here that the line may be someone else's, and stops.
                        renewed_at = time.monotonic()
                        if not all(renew(self.db, m, self.lease) for m in run[index:]):
                            raise LostClaim(message.key)
                        claimed_at = renewed_at
                    delivered = self._attempt(message)
                except LostClaim:
                    self._flush(done, report)  # what did go out is confirmed; the rest is another relay's now
                    raise
                if isinstance(delivered, Delivery):
                    done.append(delivered)
                    continue
                self._flush(done, report)
                report.add(self._settle(message, delivered))
                release(self.db, run[index + 1 :], core.now())
                return False
            self._flush(done, report)
            return True
        except LostClaim as exc:
            log.warning("outbox %s: another relay took it over; this relay's outcome is dropped", exc)
            report.add("lost")
            return False

    def _flush(self, done: list[Delivery], report: RelayReport) -> None:
        record_delivered(self.db, done, now=core.now())
        for delivery in done:
            report.add("sent" if delivery.how == "sent" else "reconciled")
        done.clear()

    def _attempt(self, message: ClaimedMessage) -> Delivery | SendFailed:
        receiver = self.receivers.get(message.channel)
        if receiver is None:
            return SendFailed(
                "permanent", f"{message.channel} is not configured: set KEEL_{message.channel.upper()}_TOKEN"
            )
        try:
            if message.needs_reconcile:
                found = receiver.find(message.key, message.destination, since=message.created_at - CLOCK_SLACK)
                if isinstance(found, Delivered):
                    return Delivery(message, found.external_id, found.url, "reconciled")
                if isinstance(found, SendFailed):  # cannot tell yet whether it arrived: do not send blind, wait
                    kind: FailureKind = "rate_limited" if found.kind == "rate_limited" else "transient"
                    return SendFailed(kind, f"cannot check the receiver yet: {found.error}", found.retry_after)
            result = receiver.send(message.key, message.destination, message.payload)
        except Exception as exc:  # a receiver bug: keep the message, never lose the line
            log.error("outbox %s: unexpected failure: %s", message.key, redact(repr(exc), *self.secrets))
            return SendFailed("ambiguous", f"{type(exc).__name__}: {exc}")
        if isinstance(result, Delivered):
            return Delivery(message, result.external_id, result.url, "sent")
        return result

    def _settle(self, message: ClaimedMessage, failure: SendFailed) -> str:
        error = redact(failure.error, *self.secrets)[:2000]
        now = core.now()
        if failure.kind == "permanent":
            record_dead(self.db, message, error=error, now=now)
            log.warning("outbox %s: dead: %s", message.key, error)
            return "dead"
        if failure.kind != "rate_limited" and message.attempts >= self.backoff.max_attempts:
            record_dead(
                self.db,
                message,
                error=f"gave up after {message.attempts} attempts: {error}",
                now=now,
                ambiguous=failure.kind == "ambiguous",
            )
            return "dead"
        if failure.kind == "rate_limited" and failure.retry_after is not None:
            delay = failure.retry_after + random.uniform(0, 0.1)  # this destination waits; the others do not
        else:
            delay = self.backoff.delay(message.attempts)
        record_retry(
            self.db,
            message,
            error=error,
            delay=timedelta(seconds=delay),
            ambiguous=failure.kind == "ambiguous",
            now=now,
        )
        log.info("outbox %s: %s, retry in %.1fs: %s", message.key, failure.kind, delay, error)
        return "retried"


def retry_dead(db: Database, key: str, *, actor: str) -> None:
    """An operator's retry of a dead message: back to pending (it reconciles first if it may have arrived),
    journaled on its agent's chain with who asked."""
    row = message_row(db, key)
    if row is None:
        raise InvalidInput(f"no outbox message has the key {key!r}")
    if row["status"] != "dead":
        raise InvalidInput(f"outbox message {key!r} is {row['status']}, not dead: only dead messages can be retried")
    revived: list[bool] = []

    def revive(cur: Any) -> None:
        revived.append(revive_txn(cur, key, core.now()))

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
        raise InvalidInput(f"outbox message {key!r} was no longer dead")
