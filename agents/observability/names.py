"""The Prometheus metrics Keel exports, in one place: the dashboard (deploy/grafana/keel.json), the alert rules
(deploy/prometheus/alerts.yml), the exporters and their tests all use exactly these names, and the docs' metrics
reference is generated from them (its help texts are the exporters' own: tests/support/metrics.py holds them equal).
Counters are named as they are scraped (``…_total``); a collector builds them as families without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MetricType = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True, slots=True)
class MetricName:
    name: str
    type: MetricType
    labels: tuple[str, ...] = ()
    help: str = ""

    @property
    def family(self) -> str:
        """The name a collector gives the metric family (a counter's without its ``_total``)."""
        return self.name.removesuffix("_total") if self.type == "counter" else self.name

    def samples(self) -> frozenset[str]:
        """The series names a scrape shows for it."""
        if self.type == "histogram":
            return frozenset(f"{self.name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        return frozenset({self.name})


def _m(name: str, type_: MetricType, *labels: str, help: str = "") -> MetricName:
    return MetricName(name, type_, labels, help)


#: Domain KPIs, computed from PostgreSQL: every API process and every beat exports the same values (the dashboard
#: and the rules wrap them in ``max``/``max by``).
DOMAIN: tuple[MetricName, ...] = (
    _m(
        "keel_suppressed_duplicates_total",
        "counter",
        "kind",
        help=(
            "Duplicates suppressed, by kind: a repeated submit, a duplicate job delivery, a job or message key "
            "already there"
        ),
    ),
    _m(
        "keel_side_effect_confirmations_total",
        "counter",
        "channel",
        help="Confirmed deliveries to Slack or GitHub (delivery log rows)",
    ),
    _m(
        "keel_side_effect_duplicates_total",
        "counter",
        "channel",
        help="Confirmations of a key that had been confirmed already (must stay 0)",
    ),
    _m("keel_requests_finished_total", "counter", "outcome", help="Requests that ended, by outcome (done, failed)"),
    _m(
        "keel_request_duration_seconds",
        "histogram",
        help="Time from a request's submit to its done or failed transition",
    ),
    _m(
        "keel_phase_transition_seconds",
        "histogram",
        "event",
        help="Database-side time of each transition, from its transaction's start to its journal event",
    ),
    _m(
        "keel_jobs_finished_total",
        "counter",
        "operation",
        "status",
        help="Jobs that reached a final status, by operation and status",
    ),
    _m("keel_job_attempt_failures_total", "counter", "error_class", help="Failed job attempts, by error class"),
    _m("keel_jobs_first_failures_total", "counter", help="Jobs whose first attempt failed, counted at that failure"),
    _m(
        "keel_jobs_finished_after_failure_total",
        "counter",
        help="Jobs that failed at least once, then succeeded, failed or went dead (cancelled ones are left out)",
    ),
    _m(
        "keel_jobs_recovered_total",
        "counter",
        help="Jobs that failed at least once, then succeeded (recovery rate: this / finished after failure)",
    ),
    _m("keel_spent_tokens_total", "counter", help="Model tokens spent by jobs"),
    _m("keel_spent_cost_total", "counter", help="Money spent by jobs (USD)"),
    _m("keel_retry_tokens_total", "counter", help="Tokens spent on attempts that failed or whose outcome was void"),
    _m("keel_retry_cost_total", "counter", help="Money spent on attempts that failed or whose outcome was void"),
    _m("keel_fenced_outcomes_total", "counter", help="Job outcomes discarded: the claim had been taken over"),
    _m("keel_lease_takeovers_total", "counter", help="Running jobs taken over after their lease expired"),
    _m("keel_budget_stops_total", "counter", help="Requests stopped because their agent's budget was spent"),
    _m(
        "keel_deadline_stops_total",
        "counter",
        "kind",
        help="Requests stopped at their hard deadline (kind=hard); agents demoted at their soft one (kind=soft)",
    ),
    _m("keel_jobs", "gauge", "status", help="Jobs not final, by status"),
    _m(
        "keel_oldest_due_job_age_seconds",
        "gauge",
        help="How long the oldest due job has waited to run (queue lag); 0 when none is due",
    ),
    _m("keel_outbox_backlog", "gauge", "channel", help="Outbox messages pending or sending"),
    _m(
        "keel_outbox_oldest_age_seconds",
        "gauge",
        "channel",
        help="Age of the oldest pending or sending outbox message; 0 when none",
    ),
    _m("keel_dead_letters", "gauge", "channel", help="Outbox messages given up on (dead)"),
    _m("keel_kpi_up", "gauge", help="1 if the database answered this scrape's KPI read, else 0"),
)

#: Process-local histograms, one per kind of observed work (``agents.core.observe.KINDS``); every process has its
#: own (a prefork worker's children share one through prometheus_client's multiprocess mode).
PROCESS_LOCAL: dict[str, MetricName] = {
    "transition": _m(
        "keel_transition_latency_seconds", "histogram", "event", "outcome", help="transition() as its caller saw it"
    ),
    "job": _m("keel_job_run_seconds", "histogram", "operation", "outcome", help="One job run in a worker"),
    "model_call": _m("keel_model_call_seconds", "histogram", "provider", "outcome", help="One call to the model"),
    "tool_call": _m("keel_tool_call_seconds", "histogram", "tool", "outcome", help="One tool call"),
    "outbox_send": _m(
        "keel_outbox_send_seconds", "histogram", "channel", "outcome", help="One outbox attempt (reconcile and send)"
    ),
    "http": _m("keel_http_request_seconds", "histogram", "method", "route", "status", help="One HTTP request"),
}

#: Exported from the alerts' tables by every API process and beat: the episodes firing, and how long ago the beat
#: leader last ticked (an age the database computes: no other clock enters it).
ALERTS: tuple[MetricName, ...] = (
    _m("keel_alerts_firing", "gauge", "alert", help="1 while the alert has an open episode"),
    _m(
        "keel_beat_leader_last_tick_age_seconds",
        "gauge",
        help="Seconds since a beat leader last ticked, measured by the database",
    ),
    # Since the latest passing `keel audit verify` whose record's seal holds (absent: none), on the database's clock.
    _m(
        "keel_audit_verify_last_success_age_seconds",
        "gauge",
        help="Seconds since the latest keel audit verify that passed (its seal holds), measured by the database",
    ),
    # While KEEL_AUDIT_SHIP_URL is set (in compose: the beats only).
    _m(
        "keel_audit_unshipped_events", "gauge", help="Journal events not yet recorded as shipped to KEEL_AUDIT_SHIP_URL"
    ),
    _m(
        "keel_audit_oldest_unshipped_age_seconds",
        "gauge",
        help="Age of the oldest journal event not yet shipped, measured by the database (0: none)",
    ),
)

ALL: tuple[MetricName, ...] = (*DOMAIN, *PROCESS_LOCAL.values(), *ALERTS)
