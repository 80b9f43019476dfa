"""The settings of what Keel tells operators: alerts, the daily KPI report, traces and metrics. A part of
:class:`models.settings.Settings`."""

from __future__ import annotations

import re

from pydantic import BaseModel, Field, SecretStr, field_validator

#: The alerts Keel evaluates (agents/observability/alerts.py holds their rules; a unit test keeps the two equal).
ALERT_NAMES = (
    "side_effect_duplicates",
    "dead_letters",
    "transition_p95",
    "recovery_rate",
    "retry_cost_share",
    "oldest_due_job",
    "beat_leader_gap",
    "audit_verify",
    "journal_partitions",
    "audit_ship_lag",
)
_TIME_OF_DAY = re.compile(r"^([01][0-9]|2[0-3]):[0-5][0-9]$")


class ObservabilityFields(BaseModel):
    """``KEEL_ALERT_*``, ``KEEL_KPI_REPORT_AT``, ``KEEL_OTLP_ENDPOINT`` and the metrics ports."""

    # Alerts (agents/observability/alerts.py): evaluated by the leading beat every KEEL_ALERT_INTERVAL_SECONDS on the
    # database's clock; posted to KEEL_ALERT_SLACK_CHANNEL through the outbox (unset: recorded and listed only).
    alert_slack_channel: str | None = None
    alert_interval_seconds: float = Field(default=60.0, gt=0, le=86_400)
    # Counters (duplicates, p95, recovery and retry-cost rates) are read over this trailing window: whole minutes, so
    # at least one.
    alert_window_seconds: float = Field(default=900.0, ge=60, le=7 * 86_400)
    # An open episode resolves only once its condition has been clear this long (no flapping posts).
    alert_resolve_after_seconds: float = Field(default=300.0, ge=0, le=86_400)
    alert_disabled: list[str] = Field(default_factory=list)  # alert names never evaluated
    alert_side_effect_duplicates_max: float = Field(default=0, ge=0)
    alert_dead_letters_max: float = Field(default=0, ge=0)
    # The thresholds' defaults are deploy/prometheus/alerts.yml's (tests/unit/test_monitoring.py holds them equal).
    alert_transition_p95_max_seconds: float = Field(default=0.5, gt=0)
    alert_recovery_rate_min: float = Field(default=0.5, ge=0, le=1)
    # Fewer jobs finished after a failure in the window: no verdict.
    alert_recovery_min_failures: int = Field(default=5, ge=1)
    alert_retry_cost_share_max: float = Field(default=0.2, ge=0, le=1)
    alert_oldest_due_job_max_seconds: float = Field(default=300.0, gt=0)
    alert_beat_leader_gap_max_seconds: float = Field(default=120.0, gt=0)
    # audit_ship_lag fires while KEEL_AUDIT_SHIP_URL is set and the oldest journal event not yet shipped there is older.
    alert_audit_ship_lag_max_seconds: float = Field(default=3600.0, gt=0)
    # audit_verify (and Prometheus's KeelAuditVerifyStale) also fires when no keel audit verify, incremental or full,
    # has passed for this long: three of the beat's hourly passes missed.
    alert_audit_verify_stale_max_seconds: float = Field(default=10800.0, gt=0)
    # The daily KPI report (the last 24 h) goes to KEEL_ALERT_SLACK_CHANNEL at this time of day, UTC ("HH:MM");
    # "off": no report.
    kpi_report_at: str = "08:00"

    # Traces (OpenTelemetry): off unless an OTLP/HTTP collector is named, e.g. http://otel-collector:4318 (spans go
    # to its /v1/traces). Unset, the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT turn
    # them on instead (agents/observability/tracing.py).
    otlp_endpoint: str | None = None
    # Prometheus metrics (every tenant's spend and alerts are in them). Each process serves /metrics on a port of its
    # own on KEEL_METRICS_HOST, 0 = not served (several on one host need distinct ports); `keel serve`'s main process
    # serves its API workers' together. With a token, the API also serves /metrics on its own port to a scrape that
    # sends it; without one, never there.
    api_metrics_port: int = Field(default=0, ge=0, le=65535)
    api_metrics_token: SecretStr | None = None
    metrics_host: str = "127.0.0.1"
    worker_metrics_port: int = Field(default=0, ge=0, le=65535)
    beat_metrics_port: int = Field(default=0, ge=0, le=65535)

    @field_validator("alert_disabled")
    @classmethod
    def _alerts_are_known(cls, value: list[str]) -> list[str]:
        unknown = sorted(set(value) - set(ALERT_NAMES))
        if unknown:
            raise ValueError(f"unknown alerts {unknown}; known: {list(ALERT_NAMES)}")
        return value

    @field_validator("kpi_report_at")
    @classmethod
    def _report_time_is_a_time_of_day(cls, value: str) -> str:
        value = value.strip()
        if value.lower() == "off":
            return "off"
        if not _TIME_OF_DAY.fullmatch(value):
            raise ValueError(f"must be a UTC time of day as HH:MM (00:00 to 23:59) or off, not {value[:20]!r}")
        return value

    @field_validator("api_metrics_token")
    @classmethod
    def _metrics_token_is_long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 16:
            raise ValueError("must be at least 16 characters (Prometheus sends it as a Bearer token)")
        return value
