"""The domain KPIs as Prometheus metrics, and as the table people read (``keel kpi``, the daily report), computed
in PostgreSQL so every exporting process says the same; a database that cannot be read in time exports
``keel_kpi_up 0`` alone, never a figure of 0 (docs/explanation/runtime-outbox-and-workers.md#kpi-metrics).
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from decimal import Decimal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from agents.observability.scrape import CACHE_SECONDS, READ_TIMEOUT, CachedRead
from models.db import Database
from models.kpi_sql import (
    ERROR_CLASSES,
    REQUEST_SECONDS_BUCKETS,
    SUPPRESSED_KINDS,
    TRANSITION_SECONDS_BUCKETS,
    Gauges,
    Kpis,
    exact,
    histogram,
    labels,
    snapshot,
)
from models.tables import CHANNELS

log = logging.getLogger("keel.kpis")


class DomainCollector(Collector):
    """The domain KPIs of the database ``db`` (the names: docs/reference/kpis.md), read at most every
    ``cache_seconds``, each read cut short after ``read_timeout``. Register it on a registry:
    ``registry.register(DomainCollector(db))``."""

    def __init__(
        self,
        db: Database,
        *,
        cache_seconds: float = CACHE_SECONDS,
        read_timeout: timedelta = READ_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.db = db
        self.read_timeout = read_timeout
        self._cached = CachedRead(self._read, lambda: [_up(0)], cache_seconds=cache_seconds, clock=clock)
        self._down = False

    def describe(self) -> Iterable[Metric]:
        return []  # registering must not read the database

    def collect(self) -> Iterator[Metric]:
        yield from self._cached.get()

    def _read(self) -> list[Metric]:
        try:
            k, g = snapshot(self.db, statement_timeout=self.read_timeout)
        except Exception as exc:  # a scrape must answer whatever the database does
            if not self._down:
                log.warning("KPIs unavailable: the database cannot be read: %s", type(exc).__name__)
            self._down = True
            return [_up(0)]
        if self._down:
            log.info("KPIs available again")
        self._down = False
        return [*domain_metrics(k, g), _up(1)]


def _up(value: int) -> Metric:
    return GaugeMetricFamily("keel_kpi_up", "1 if the database answered this scrape's KPI read, else 0", value=value)


def domain_metrics(k: Kpis, g: Gauges) -> list[Metric]:
    """The domain metric families of ``k`` (counters since they began) and ``g`` (the live state)."""
    c = k.counters

    def counter(name: str, doc: str, stored: str, label_names: tuple[str, ...] = (), **known: Iterable[str]) -> Metric:
        family = CounterMetricFamily(name, doc, labels=label_names)
        values: dict[tuple[str, ...], Decimal] = {}
        if len(label_names) == 1 and label_names[0] in known:
            values = {(v,): Decimal(0) for v in known[label_names[0]]}
        elif not label_names:
            values = {(): Decimal(0)}
        for (n, label), v in c.items():
            if n == stored:
                have = labels(label)
                key = tuple(have.get(label_name, "") for label_name in label_names)
                values[key] = values.get(key, Decimal(0)) + exact(v)
        for key, v in sorted(values.items()):
            family.add_metric(list(key), float(v))
        return family

    def labelled_gauge(name: str, doc: str, label: str, values: dict[str, int] | dict[str, float]) -> Metric:
        family = GaugeMetricFamily(name, doc, labels=[label])
        for key, v in sorted(values.items()):
            family.add_metric([key], float(v))
        return family

    transitions = HistogramMetricFamily(
        "keel_phase_transition_seconds",
        "Database-side time of each transition, from its transaction's start to its journal event",
        labels=["event"],
    )
    events = sorted({labels(label)["event"] for n, label in c if n == "phase_transition_seconds_count"})
    for event in events:
        transitions.add_metric(
            [event],
            _buckets(histogram(c, "phase_transition_seconds", TRANSITION_SECONDS_BUCKETS, event=event)),
            float(c.get(("phase_transition_seconds_sum", f"event={event}"), Decimal(0))),
        )
    requests = HistogramMetricFamily(
        "keel_request_duration_seconds", "Time from a request's submit to its done or failed transition"
    )
    requests.add_metric(
        [],
        _buckets(histogram(c, "request_duration_seconds", REQUEST_SECONDS_BUCKETS)),
        float(c.get(("request_duration_seconds_sum", ""), Decimal(0))),
    )
    return [
        counter(
            "keel_suppressed_duplicates",
            "Duplicates suppressed, by kind: a repeated submit, a duplicate job delivery, a job or message key"
            " already there",
            "suppressed_duplicates",
            ("kind",),
            kind=SUPPRESSED_KINDS,
        ),
        counter(
            "keel_side_effect_confirmations",
            "Confirmed deliveries to Slack or GitHub (delivery log rows)",
            "side_effect_confirmations",
            ("channel",),
            channel=CHANNELS,
        ),
        counter(
            "keel_side_effect_duplicates",
            "Confirmations of a key that had been confirmed already (must stay 0)",
            "side_effect_duplicates",
            ("channel",),
            channel=CHANNELS,
        ),
        counter(
            "keel_requests_finished",
            "Requests that ended, by outcome (done, failed)",
            "requests_finished",
            ("outcome",),
            outcome=("done", "failed"),
        ),
        requests,
        transitions,
        counter(
            "keel_jobs_finished",
            "Jobs that reached a final status, by operation and status",
            "jobs_finished",
            ("operation", "status"),
        ),
        counter(
            "keel_job_attempt_failures",
            "Failed job attempts, by error class",
            "job_attempt_failures",
            ("error_class",),
            error_class=ERROR_CLASSES,
        ),
        counter(
            "keel_jobs_first_failures",
            "Jobs whose first attempt failed, counted at that failure",
            "jobs_first_failures",
        ),
        counter(
            "keel_jobs_finished_after_failure",
            "Jobs that failed at least once, then succeeded, failed or went dead (cancelled ones are left out)",
            "jobs_finished_after_failure",
        ),
        counter(
            "keel_jobs_recovered",
            "Jobs that failed at least once, then succeeded (recovery rate: this / finished after failure)",
            "jobs_recovered",
        ),
        counter("keel_spent_tokens", "Model tokens spent by jobs", "spent_tokens"),
        counter("keel_spent_cost", "Money spent by jobs (USD)", "spent_cost"),
        counter("keel_retry_tokens", "Tokens spent on attempts that failed or whose outcome was void", "retry_tokens"),
        counter("keel_retry_cost", "Money spent on attempts that failed or whose outcome was void", "retry_cost"),
        counter("keel_fenced_outcomes", "Job outcomes discarded: the claim had been taken over", "fenced_outcomes"),
        counter("keel_lease_takeovers", "Running jobs taken over after their lease expired", "lease_takeovers"),
        counter("keel_budget_stops", "Requests stopped because their agent's budget was spent", "budget_stops"),
        counter(
            "keel_deadline_stops",
            "Requests stopped at their hard deadline (kind=hard); agents demoted at their soft one (kind=soft)",
            "deadline_stops",
            ("kind",),
            kind=("hard", "soft"),
        ),
        labelled_gauge("keel_jobs", "Jobs not final, by status", "status", g.jobs_by_status),
        GaugeMetricFamily(
            "keel_oldest_due_job_age_seconds",
            "How long the oldest due job has waited to run (queue lag); 0 when none is due",
            value=g.oldest_due_job_age_seconds,
        ),
        labelled_gauge("keel_outbox_backlog", "Outbox messages pending or sending", "channel", g.outbox_backlog),
        labelled_gauge(
            "keel_outbox_oldest_age_seconds",
            "Age of the oldest pending or sending outbox message; 0 when none",
            "channel",
            g.outbox_oldest_age_seconds,
        ),
        labelled_gauge("keel_dead_letters", "Outbox messages given up on (dead)", "channel", g.dead_letters),
    ]


def _buckets(cumulative: list[tuple[float, float]]) -> list[tuple[str, float]]:
    return [("+Inf" if math.isinf(upper) else _bound(upper), count) for upper, count in cumulative]


def _bound(upper: float) -> str:
    return repr(float(upper))


# --- for people ----------------------------------------------------------------------------------------------------

_DURATION = re.compile(r"^\s*(\d+)\s*([smhdw])\s*$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_duration(text: str) -> timedelta:
    """``24h``, ``90m``, ``7d``, ``30s``, ``2w`` as a timedelta; :class:`ValueError` naming the rule otherwise."""
    match = _DURATION.match(text)
    if not match or int(match[1]) == 0:
        raise ValueError(
            f"{text!r} is not a duration: use a positive whole number and a unit (s, m, h, d or w), e.g. 24h, 90m, 7d"
        )
    try:
        return timedelta(**{_UNITS[match[2]]: int(match[1])})
    except OverflowError:
        raise ValueError(f"{text!r} is too long a duration") from None


def report_lines(k: Kpis) -> list[tuple[str, str]]:
    """The KPI table as (label, value) rows: what ``keel kpi`` prints and the daily report posts."""
    kinds = ", ".join(f"{kind} {_count(n)}" for kind, n in k.suppressed_duplicates.items() if n)
    deadline = f"{_count(k.deadline_stops)} stopped at the hard deadline, {_count(k.deadline_demotions)} demoted"
    return [
        ("suppressed duplicates", _count(sum(k.suppressed_duplicates.values())) + (f" ({kinds})" if kinds else "")),
        (
            "side-effect duplicates",
            f"{_count(k.side_effect_duplicates)} of {_count(k.confirmations)} confirmed deliveries"
            f" (duplicate rate {_percent(k.duplicate_rate)}: deliveries per key - 1)",
        ),
        ("requests finished", f"{_count(k.requests_done)} done, {_count(k.requests_failed)} failed"),
        ("failure rate", _percent(k.failure_rate)),
        ("mean processing time", _seconds(k.mean_request_seconds)),
        ("p95 request time", _seconds(k.p95_request_seconds)),
        ("p95 phase-transition latency", _seconds(k.p95_transition_seconds)),
        (
            "recovery rate after first failure",
            f"{_percent(k.recovery_rate)} of {_count(k.jobs_finished_after_failure)} jobs finished after a failure"
            f" ({_count(k.jobs_first_failures)} failed a first time)",
        ),
        (
            "retry-caused cost",
            f"{_count(k.retry_tokens)} tokens, ${_money(k.retry_cost)} ({_percent(k.retry_cost_share)} of spend)",
        ),
        ("spent", f"{_count(k.spent_tokens)} tokens, ${_money(k.spent_cost)}"),
        ("fenced-off outcomes", _count(k.fenced_outcomes)),
        ("lease takeovers", _count(k.lease_takeovers)),
        ("budget stops", _count(k.budget_stops)),
        ("deadline stops", deadline),
    ]


def _count(n: int) -> str:
    return f"{n:,}"


def _percent(rate: float | None) -> str:
    return "-" if rate is None else f"{rate * 100:.1f}%"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:,.2f} s"


def _money(value: float) -> str:
    text = f"{value:.6f}".rstrip("0").rstrip(".")
    return text or "0"
