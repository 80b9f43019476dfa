"""The Prometheus metrics Keel exports, in one place: the dashboard (deploy/grafana/keel.json), the alert rules
(deploy/prometheus/alerts.yml), the exporters and their tests all use exactly these names. Counters are named as they
are scraped (``…_total``); a collector builds them as families without it.
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
    _m("keel_suppressed_duplicates_total", "counter", "kind"),
    _m("keel_side_effect_confirmations_total", "counter", "channel"),
    _m("keel_side_effect_duplicates_total", "counter", "channel"),
    _m("keel_requests_finished_total", "counter", "outcome"),
    _m("keel_request_duration_seconds", "histogram"),
    _m("keel_phase_transition_seconds", "histogram", "event"),
    _m("keel_jobs_finished_total", "counter", "operation", "status"),
    _m("keel_job_attempt_failures_total", "counter", "error_class"),
    _m("keel_jobs_first_failures_total", "counter"),
    _m("keel_jobs_finished_after_failure_total", "counter"),
    _m("keel_jobs_recovered_total", "counter"),
    _m("keel_spent_tokens_total", "counter"),
    _m("keel_spent_cost_total", "counter"),
    _m("keel_retry_tokens_total", "counter"),
    _m("keel_retry_cost_total", "counter"),
    _m("keel_fenced_outcomes_total", "counter"),
    _m("keel_lease_takeovers_total", "counter"),
    _m("keel_budget_stops_total", "counter"),
    _m("keel_deadline_stops_total", "counter", "kind"),
    _m("keel_jobs", "gauge", "status"),
    _m("keel_oldest_due_job_age_seconds", "gauge"),
    _m("keel_outbox_backlog", "gauge", "channel"),
    _m("keel_outbox_oldest_age_seconds", "gauge", "channel"),
    _m("keel_dead_letters", "gauge", "channel"),
    _m("keel_kpi_up", "gauge"),
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
    _m("keel_alerts_firing", "gauge", "alert"),
    _m("keel_beat_leader_last_tick_age_seconds", "gauge"),
    # Since the latest passing `keel audit verify` whose record's seal holds (absent: none), on the database's clock.
    _m("keel_audit_verify_last_success_age_seconds", "gauge"),
    # While KEEL_AUDIT_SHIP_URL is set (in compose: the beats only).
    _m("keel_audit_unshipped_events", "gauge"),
    _m("keel_audit_oldest_unshipped_age_seconds", "gauge"),
)

ALL: tuple[MetricName, ...] = (*DOMAIN, *PROCESS_LOCAL.values(), *ALERTS)
