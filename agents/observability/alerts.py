"""Alerts: pure rules over the KPIs (:func:`evaluate`), episodes in ``alert_episodes`` opened and resolved on the
database's clock (:func:`record`), and their Slack posts through Keel's own outbox, each exactly once however many
beats evaluate (how: docs/explanation/runtime-outbox-and-workers.md#alerts).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from agents.core.keys import make_key
from agents.observability.scrape import CACHE_SECONDS, READ_TIMEOUT, CachedRead
from models import alerts_sql, kpi_sql, partitions_sql
from models.alerts_sql import Episode
from models.audit_destination import parse_store_url
from models.audit_records import ShipLag, ship_lag_txn
from models.clock import database_now, rfc3339
from models.db import Database, end_read
from models.outbox_sql import NewMessage, insert_messages_txn
from models.settings import Settings

log = logging.getLogger("keel.alerts")

#: The request id (first key segment) of every alert message; its second segment is the alert's name, never a
#: channel, so no alert key can equal an agent's message key (``{request}:{channel}:{target}``).
ALERT_REQUEST_ID = "alert"


@dataclass(frozen=True, slots=True)
class Measures:
    """What the rules look at: counters over the trailing window, gauges now, and what only alerts know."""

    side_effect_duplicates: float = 0  # confirmations of a key beyond its first, in the window
    dead_letters: float = 0  # outbox messages dead now
    p95_transition_seconds: float | None = None  # in the window
    jobs_finished_after_failure: float = 0  # in the window: jobs that failed at least once, then finished
    recovery_rate: float | None = None  # in the window: of those, the share that succeeded
    retry_cost_share: float | None = None  # in the window
    oldest_due_job_age_seconds: float = 0  # now
    beat_leader_gap_seconds: float | None = None  # the longest time without a leader before a term begun in the window
    audit_verify_breaks: int | None = None  # of the latest `keel audit verify`; None: never run
    audit_verify_ok: bool | None = None
    audit_verify_unchecked: int = 0  # events the latest verify could not check (their key not in its ring)
    journal_months_ahead: int | None = None  # whole months after this one the journal's partitions cover
    audit_verify_forged: str | None = None  # why the latest verify's record cannot be believed (its seal fails)
    audit_ship_lag_seconds: float | None = None  # age of the oldest event not shipped yet; None: shipping is off
    audit_verify_success_age_seconds: float | None = None  # since the latest believed passing verify; None: none


def _default(name: str) -> Any:
    """The default of setting ``KEEL_ALERT_{NAME}``: one source for the thresholds' defaults."""
    return Settings.model_fields[f"alert_{name}"].default


@dataclass(frozen=True, slots=True)
class Thresholds:
    side_effect_duplicates_max: float = _default("side_effect_duplicates_max")
    dead_letters_max: float = _default("dead_letters_max")
    transition_p95_max_seconds: float = _default("transition_p95_max_seconds")
    recovery_rate_min: float = _default("recovery_rate_min")
    recovery_min_failures: int = _default("recovery_min_failures")
    retry_cost_share_max: float = _default("retry_cost_share_max")
    oldest_due_job_max_seconds: float = _default("oldest_due_job_max_seconds")
    beat_leader_gap_max_seconds: float = _default("beat_leader_gap_max_seconds")
    audit_ship_lag_max_seconds: float = _default("audit_ship_lag_max_seconds")
    audit_verify_stale_max_seconds: float = _default("audit_verify_stale_max_seconds")

    @classmethod
    def from_settings(cls, settings: Settings) -> Thresholds:
        return cls(
            side_effect_duplicates_max=settings.alert_side_effect_duplicates_max,
            dead_letters_max=settings.alert_dead_letters_max,
            transition_p95_max_seconds=settings.alert_transition_p95_max_seconds,
            recovery_rate_min=settings.alert_recovery_rate_min,
            recovery_min_failures=settings.alert_recovery_min_failures,
            retry_cost_share_max=settings.alert_retry_cost_share_max,
            oldest_due_job_max_seconds=settings.alert_oldest_due_job_max_seconds,
            beat_leader_gap_max_seconds=settings.alert_beat_leader_gap_max_seconds,
            audit_ship_lag_max_seconds=settings.alert_audit_ship_lag_max_seconds,
            audit_verify_stale_max_seconds=settings.alert_audit_verify_stale_max_seconds,
        )


@dataclass(frozen=True, slots=True)
class Verdict:
    name: str
    firing: bool
    value: float | None
    threshold: float
    summary: str  # one line for people: what is measured against what


def _above(name: str, value: float | None, limit: float, what: str) -> Verdict:
    if value is None:
        return Verdict(name, False, None, limit, f"{what}: nothing to measure (threshold {limit:g})")
    return Verdict(name, value > limit, value, limit, f"{what} is {value:g} (threshold: above {limit:g})")


def side_effect_duplicates(m: Measures, t: Thresholds) -> Verdict:
    return _above(
        "side_effect_duplicates", m.side_effect_duplicates, t.side_effect_duplicates_max, "side-effect duplicates"
    )


def dead_letters(m: Measures, t: Thresholds) -> Verdict:
    return _above("dead_letters", m.dead_letters, t.dead_letters_max, "dead outbox messages")


def transition_p95(m: Measures, t: Thresholds) -> Verdict:
    return _above(
        "transition_p95", m.p95_transition_seconds, t.transition_p95_max_seconds, "p95 phase-transition seconds"
    )


def recovery_rate(m: Measures, t: Thresholds) -> Verdict:
    name, limit = "recovery_rate", t.recovery_rate_min
    if m.recovery_rate is None or m.jobs_finished_after_failure < t.recovery_min_failures:
        summary = (
            f"{m.jobs_finished_after_failure:g} jobs finished after a failure: too few to judge"
            f" (needs {t.recovery_min_failures})"
        )
        return Verdict(name, False, m.recovery_rate, limit, summary)
    summary = f"recovery rate after a first failure is {m.recovery_rate:.1%} (threshold: below {limit:.1%})"
    return Verdict(name, m.recovery_rate < limit, m.recovery_rate, limit, summary)


def retry_cost_share(m: Measures, t: Thresholds) -> Verdict:
    return _above("retry_cost_share", m.retry_cost_share, t.retry_cost_share_max, "share of cost spent on retries")


def oldest_due_job(m: Measures, t: Thresholds) -> Verdict:
    return _above(
        "oldest_due_job", m.oldest_due_job_age_seconds, t.oldest_due_job_max_seconds, "oldest due job's age (s)"
    )


def beat_leader_gap(m: Measures, t: Thresholds) -> Verdict:
    return _above(
        "beat_leader_gap", m.beat_leader_gap_seconds, t.beat_leader_gap_max_seconds, "seconds without a beat leader"
    )


def audit_verify(m: Measures, t: Thresholds) -> Verdict:
    if m.audit_verify_forged is not None:  # whatever it says: a record that is not Keel's says nothing
        return Verdict(
            "audit_verify",
            True,
            None,
            0,
            f"the latest recorded keel audit verify cannot be believed: {m.audit_verify_forged}; run keel audit verify",
        )
    if m.audit_verify_ok is None:
        return Verdict("audit_verify", False, None, 0, "keel audit verify has not run yet")
    breaks = float(m.audit_verify_breaks or 0)
    age = m.audit_verify_success_age_seconds
    if m.audit_verify_ok and age is not None and age > t.audit_verify_stale_max_seconds:
        # A verify that no longer runs (the beat's chore off or put off) proves nothing about what was written since.
        return Verdict(
            "audit_verify",
            True,
            breaks,
            0,
            f"no keel audit verify has passed for {age:.0f} s (threshold: {t.audit_verify_stale_max_seconds:g} s)",
        )
    if m.audit_verify_ok:
        return Verdict("audit_verify", False, breaks, 0, "the latest keel audit verify passed")
    if not breaks:
        return Verdict(
            "audit_verify",
            True,
            breaks,
            0,
            f"the latest keel audit verify could not check {m.audit_verify_unchecked} events: their audit key is not"
            " in its KEEL_AUDIT_KEYS",
        )
    return Verdict("audit_verify", True, breaks, 0, f"the latest keel audit verify found {breaks:g} broken chains")


#: Fewer whole months ahead than this with a partition of the journal: the beat has not been creating them.
JOURNAL_MONTHS_AHEAD_MIN = 2


def journal_partitions(m: Measures, t: Thresholds) -> Verdict:
    ahead = m.journal_months_ahead
    if ahead is None:
        return Verdict("journal_partitions", False, None, JOURNAL_MONTHS_AHEAD_MIN, "not measured")
    summary = (
        f"the journal has partitions for {ahead} month(s) after this one (at least {JOURNAL_MONTHS_AHEAD_MIN} wanted;"
        " an event in a month without one is refused)"
    )
    return Verdict(
        "journal_partitions", ahead < JOURNAL_MONTHS_AHEAD_MIN, float(ahead), JOURNAL_MONTHS_AHEAD_MIN, summary
    )


def audit_ship_lag(m: Measures, t: Thresholds) -> Verdict:
    if m.audit_ship_lag_seconds is None:
        return Verdict("audit_ship_lag", False, None, t.audit_ship_lag_max_seconds, "the journal is not shipped")
    return _above(
        "audit_ship_lag",
        m.audit_ship_lag_seconds,
        t.audit_ship_lag_max_seconds,
        "age of the oldest journal event not shipped yet (s)",
    )


Rule = Callable[[Measures, Thresholds], Verdict]

#: Every alert, by name: the order in which they are evaluated and listed.
RULES: dict[str, Rule] = {
    "side_effect_duplicates": side_effect_duplicates,
    "dead_letters": dead_letters,
    "transition_p95": transition_p95,
    "recovery_rate": recovery_rate,
    "retry_cost_share": retry_cost_share,
    "oldest_due_job": oldest_due_job,
    "beat_leader_gap": beat_leader_gap,
    "audit_verify": audit_verify,
    "journal_partitions": journal_partitions,
    "audit_ship_lag": audit_ship_lag,
}
# (A unit test holds RULES equal to models.settings.ALERT_NAMES, and no alert named like a channel in CHANNELS:
# such a name could make an alert's key equal an agent message's.)


def evaluate(m: Measures, t: Thresholds, disabled: Iterable[str] = ()) -> list[Verdict]:
    """One verdict per alert. A disabled alert never fires (an episode it had open resolves as usual)."""
    off = set(disabled)
    verdicts = []
    for name, rule in RULES.items():
        verdict = rule(m, t)
        if name in off:
            verdict = Verdict(name, False, verdict.value, verdict.threshold, "disabled (KEEL_ALERT_DISABLED)")
        verdicts.append(verdict)
    return verdicts


# --- episodes ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Open:
    """Open an episode now."""


@dataclass(frozen=True, slots=True)
class Keep:
    """The episode stays open; ``clear_since``: since when its condition has been clear (None: it holds)."""

    clear_since: datetime | None


@dataclass(frozen=True, slots=True)
class Resolve:
    clear_since: datetime


Step = Open | Keep | Resolve | None


def next_step(firing: bool, clear_since: datetime | None, is_open: bool, now: datetime, hold: timedelta) -> Step:
    """What one evaluation does to an alert: given whether it fires, whether an episode is open and since when its
    condition has been clear, on the database's clock ``now``."""
    if firing:
        return Keep(None) if is_open else Open()
    if not is_open:
        return None
    since = clear_since or now
    return Resolve(since) if now - since >= hold else Keep(since)


def episode_key(name: str, started_at: datetime, state: str) -> str:
    """``alert:{name}:{episode start}:{state}``: made from the episode alone, the same in every process."""
    return make_key(ALERT_REQUEST_ID, name, f"{rfc3339(started_at)}:{state}")


def _message(episode: Episode, state: str, channel: str, text: str) -> NewMessage:
    return NewMessage(
        key=episode_key(episode.name, episode.started_at, state),
        agent_id=None,
        request_id=ALERT_REQUEST_ID,
        channel="slack",
        destination=channel,
        payload={"text": text},
    )


def _duration(delta: timedelta) -> str:
    total = int(delta.total_seconds())
    hours, rest = divmod(total, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h {minutes}m" if hours else f"{minutes}m {seconds}s" if minutes else f"{seconds}s"


def firing_text(episode: Episode, summary: str) -> str:
    return (
        f":rotating_light: Keel alert *{episode.name}* is firing: {summary}."
        f" Since {rfc3339(episode.started_at)}. Runbook: docs/runbook.md, alert {episode.name}."
    )


def resolved_text(episode: Episode, summary: str) -> str:
    assert episode.resolved_at is not None
    return (
        f":white_check_mark: Keel alert *{episode.name}* resolved after"
        f" {_duration(episode.resolved_at - episode.started_at)}: {summary}."
        f" (It fired at {rfc3339(episode.started_at)}.)"
    )


@dataclass(frozen=True, slots=True)
class Change:
    name: str
    what: str  # opened | resolved
    episode: Episode


def record(db: Database, verdicts: Sequence[Verdict], *, channel: str | None, hold: timedelta) -> list[Change]:
    """Apply ``verdicts`` to the episodes, each alert in a transaction of its own; returns what opened or resolved."""
    changes = []
    for verdict in verdicts:
        change = _record_one(db, verdict, channel=channel, hold=hold)
        if change is not None:
            changes.append(change)
    return changes


def _record_one(db: Database, verdict: Verdict, *, channel: str | None, hold: timedelta) -> Change | None:
    with db.transaction() as cur:
        episode = alerts_sql.lock_alert_txn(cur, verdict.name)
        now = database_now(cur)
        clear_since = _clear_since(episode)
        step = next_step(verdict.firing, clear_since, episode is not None, now, hold)
        if isinstance(step, Open):
            details: dict[str, Any] = {"summary": verdict.summary, "posted_to": channel}
            opened = alerts_sql.open_episode_txn(
                cur, verdict.name, value=verdict.value, threshold=verdict.threshold, details=details
            )
            if opened is None:  # another evaluator opened it first (the unique index said so)
                return None
            if channel is not None:
                insert_messages_txn(cur, [_message(opened, "firing", channel, firing_text(opened, verdict.summary))])
            return Change(verdict.name, "opened", opened)
        if isinstance(step, Keep) and episode is not None:
            alerts_sql.note_evaluation_txn(cur, episode.id, value=verdict.value, clear_since=step.clear_since)
        if isinstance(step, Resolve) and episode is not None:
            resolved = alerts_sql.resolve_episode_txn(
                cur, episode.id, value=verdict.value, clear_since=step.clear_since
            )
            if resolved is None:
                return None
            posted_to = resolved.details.get("posted_to")
            if posted_to:
                text = resolved_text(resolved, verdict.summary)
                insert_messages_txn(cur, [_message(resolved, "resolved", posted_to, text)])
            return Change(verdict.name, "resolved", resolved)
    return None


def _clear_since(episode: Episode | None) -> datetime | None:
    if episode is None or not episode.details.get("clear_since"):
        return None
    return datetime.fromisoformat(str(episode.details["clear_since"]))


# --- measuring --------------------------------------------------------------------------------------------------


def ship_destination(settings: Settings) -> str | None:
    """The destination the journal is shipped to, as the shipper records it (None: not shipped)."""
    if settings.audit_ship_url is None:
        return None
    try:
        return str(parse_store_url(settings.audit_ship_url))
    except ValueError:
        return None  # the shipper says what is wrong with it; there is no lag to measure


def ship_lag(db: Database, destination: str) -> ShipLag:
    with db.connection() as conn:
        try:
            return ship_lag_txn(conn, destination, db.audit_keys)
        finally:
            end_read(conn)


def measure(db: Database, window: timedelta, ship_to: str | None = None) -> Measures:
    """The measures now: counters over the trailing ``window``, gauges as they are; with ``ship_to``, how far
    shipping there is behind."""
    k = kpi_sql.window(db, window)
    g = kpi_sql.gauges(db)
    verified = alerts_sql.last_verification(db)
    lag = None if ship_to is None else ship_lag(db, ship_to).oldest_age_seconds
    return Measures(
        side_effect_duplicates=k.side_effect_duplicates,
        dead_letters=float(sum(g.dead_letters.values())),
        p95_transition_seconds=k.p95_transition_seconds,
        jobs_finished_after_failure=k.jobs_finished_after_failure,
        recovery_rate=k.recovery_rate,
        retry_cost_share=k.retry_cost_share,
        oldest_due_job_age_seconds=g.oldest_due_job_age_seconds,
        beat_leader_gap_seconds=alerts_sql.longest_leader_gap(db, window),
        audit_verify_breaks=None if verified is None else verified.breaks,
        audit_verify_ok=None if verified is None else verified.ok,
        audit_verify_unchecked=(
            int(verified.details.get("unchecked_events") or 0)
            if verified is not None and verified.forged is None
            else 0
        ),
        audit_verify_forged=None if verified is None else verified.forged,
        audit_ship_lag_seconds=lag,
        audit_verify_success_age_seconds=alerts_sql.last_success_age(db),
        journal_months_ahead=partitions_sql.months_ahead(db),
    )


def evaluate_and_record(db: Database, settings: Settings) -> list[Change]:
    """One evaluation of every alert (the leading beat's, once per ``KEEL_ALERT_INTERVAL_SECONDS``)."""
    verdicts = evaluate(
        measure(db, timedelta(seconds=settings.alert_window_seconds), ship_destination(settings)),
        Thresholds.from_settings(settings),
        settings.alert_disabled,
    )
    changes = record(
        db,
        verdicts,
        channel=settings.alert_slack_channel,
        hold=timedelta(seconds=settings.alert_resolve_after_seconds),
    )
    for change in changes:
        episode = change.episode
        if change.what == "opened":
            log.warning("alert %s firing: %s", change.name, episode.details.get("summary"))
        else:
            log.info("alert %s resolved", change.name)
    return changes


# --- for the metrics ----------------------------------------------------------------------------------------------


def firing(db: Database) -> dict[str, int]:
    """``keel_alerts_firing{alert}``: 1 for every alert with an open episode, 0 for the others."""
    open_names = {e.name for e in alerts_sql.open_episodes(db)}
    return {name: int(name in open_names) for name in RULES}


def leader_tick_age(db: Database) -> float | None:
    """``keel_beat_leader_last_tick_age_seconds``: how long ago a beat leader last ticked, measured by the database
    (its clock made both ends); None if no beat ever led."""
    with db.connection() as conn:
        try:
            return alerts_sql.leader_tick_age_txn(conn)
        finally:
            end_read(conn)


class AlertsCollector:
    """``keel_alerts_firing{alert}``, ``keel_beat_leader_last_tick_age_seconds`` and the audit gauges, read as
    :mod:`agents.observability.scrape` reads; nothing when the database cannot be read in time. The tick's age, not
    its time, so that one clock (the database's) measures it."""

    def __init__(
        self,
        db: Database,
        cache_seconds: float = CACHE_SECONDS,
        *,
        read_timeout: timedelta = READ_TIMEOUT,
        ship_to: str | None = None,
    ) -> None:
        self.db = db
        self.ship_to = ship_to  # with it, also the shipping lag (KEEL_AUDIT_SHIP_URL's destination)
        self.read_timeout = read_timeout
        self._cached = CachedRead(self._read, lambda: [], cache_seconds=cache_seconds)

    def collect(self) -> Iterable[Metric]:
        return self._cached.get()

    def _read(self) -> list[Metric]:
        try:
            with self.db.reading(statement_timeout=self.read_timeout) as conn:
                open_names = alerts_sql.open_episode_names_txn(conn)
                age = alerts_sql.leader_tick_age_txn(conn)
                verified = alerts_sql.last_success_age_txn(conn, self.db.audit_keys)
                lag = None if self.ship_to is None else ship_lag_txn(conn, self.ship_to, self.db.audit_keys)
        except Exception as exc:  # a scrape must never fail because the database is away
            log.debug("alert metrics not read: %s", exc)
            return []
        families: list[Metric] = []
        alerts = GaugeMetricFamily("keel_alerts_firing", "1 while the alert has an open episode", labels=["alert"])
        for name in sorted(RULES):
            alerts.add_metric([name], int(name in open_names))
        families.append(alerts)
        if age is not None:
            families.append(
                GaugeMetricFamily(
                    "keel_beat_leader_last_tick_age_seconds",
                    "Seconds since a beat leader last ticked, measured by the database",
                    value=age,
                )
            )
        if verified is not None:
            families.append(
                GaugeMetricFamily(
                    "keel_audit_verify_last_success_age_seconds",
                    "Seconds since the latest keel audit verify that passed (its seal holds), measured by the database",
                    value=verified,
                )
            )
        if lag is not None:
            families.append(
                GaugeMetricFamily(
                    "keel_audit_unshipped_events",
                    "Journal events not yet recorded as shipped to KEEL_AUDIT_SHIP_URL",
                    value=lag.unshipped,
                )
            )
            families.append(
                GaugeMetricFamily(
                    "keel_audit_oldest_unshipped_age_seconds",
                    "Age of the oldest journal event not yet shipped, measured by the database (0: none)",
                    value=lag.oldest_age_seconds,
                )
            )
        return families
