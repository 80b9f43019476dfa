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

    # Alerts: agents/observability/alerts.py.
    alert_slack_channel: str | None = Field(
        default=None,
        description=(
            "Slack conversation id (`C…`, `G…` or `D…`) where alerts and the daily KPI report are posted through the "
            "outbox. Unset: episodes are still recorded and listed (`keel alerts`), nothing is posted."
        ),
    )
    alert_interval_seconds: float = Field(
        default=60.0,
        gt=0,
        le=86_400,
        description="How often the leading beat evaluates the alerts (on the database's clock).",
    )
    alert_window_seconds: float = Field(
        default=900.0,
        ge=60,
        le=7 * 86_400,
        description=(
            "The trailing window counters are read over (duplicates, p95, recovery rate, retry cost share, leaderless"
            " gaps); whole minutes, as the counters are kept per minute."
        ),
    )
    alert_resolve_after_seconds: float = Field(
        default=300.0,
        ge=0,
        le=86_400,
        description="An episode resolves only once its condition has been clear this long in a row.",
    )
    alert_disabled: list[str] = Field(
        default_factory=list,
        description="Alerts never evaluated, as a JSON list of names (an open episode of one resolves as usual).",
    )
    alert_side_effect_duplicates_max: float = Field(
        default=0,
        ge=0,
        description="`side_effect_duplicates` fires above this many in the window.",
    )
    alert_dead_letters_max: float = Field(
        default=0,
        ge=0,
        description="`dead_letters` fires above this many dead outbox messages.",
    )
    # The thresholds' defaults are deploy/prometheus/alerts.yml's (tests/unit/test_monitoring.py holds them equal).
    alert_transition_p95_max_seconds: float = Field(
        default=0.5,
        gt=0,
        description="`transition_p95` fires above this p95 phase-transition time.",
    )
    alert_recovery_rate_min: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description=(
            "`recovery_rate` fires below this rate (once at least `KEEL_ALERT_RECOVERY_MIN_FAILURES` jobs that had "
            "failed finished in the window)."
        ),
    )
    alert_recovery_min_failures: int = Field(
        default=5,
        ge=1,
        description="`recovery_rate` gives no verdict until this many jobs that had failed finished in the window.",
    )
    alert_retry_cost_share_max: float = Field(
        default=0.2,
        ge=0,
        le=1,
        description="`retry_cost_share` fires above this share of cost spent on failed attempts.",
    )
    alert_oldest_due_job_max_seconds: float = Field(
        default=300.0,
        gt=0,
        description="`oldest_due_job` fires while a due job has waited longer.",
    )
    alert_beat_leader_gap_max_seconds: float = Field(
        default=120.0,
        gt=0,
        description="`beat_leader_gap` fires when no beat led for longer (before a term begun in the window).",
    )
    alert_audit_ship_lag_max_seconds: float = Field(
        default=3600.0,
        gt=0,
        description=(
            "While `KEEL_AUDIT_SHIP_URL` is set, `audit_ship_lag` fires once the oldest journal event not yet shipped"
            " is older (database clock); keep it above `KEEL_AUDIT_SEGMENT_MINUTES` plus the ship interval."
        ),
    )
    # The default: three of the beat's hourly verify passes missed.
    alert_audit_verify_stale_max_seconds: float = Field(
        default=10800.0,
        gt=0,
        description=(
            "`audit_verify` (and Prometheus's `KeelAuditVerifyStale`) fires once no `keel audit verify`, incremental "
            "or full, has passed for this long (database clock; `keel_audit_verify_last_success_age_seconds`)."
        ),
    )
    kpi_report_at: str = Field(
        default="08:00",
        description=(
            "UTC time of day of the daily KPI report to `KEEL_ALERT_SLACK_CHANNEL` (`HH:MM`); `off`: no report."
        ),
    )

    otlp_endpoint: str | None = Field(
        default=None,
        description=(
            "An OTLP/HTTP collector's base URL, e.g. `http://otel-collector:4318`: every process sends its spans to "
            "`/v1/traces` under it. Unset: traces are off, unless the standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` /"
            " `OTEL_EXPORTER_OTLP_ENDPOINT` turn them on."
        ),
    )
    # Prometheus metrics: every tenant's spend and alerts are in them, so the API's own port serves them only to a
    # scrape that sends the token.
    api_metrics_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description=(
            "Port of the API's `/metrics` on `KEEL_METRICS_HOST`, served by `keel serve`'s main process for all its "
            "worker processes; `0` serves none; not `KEEL_API_PORT`."
        ),
    )
    api_metrics_token: SecretStr | None = Field(
        default=None,
        description=(
            "When set (16 characters or more), the API also serves `/metrics` on its own port, to a scrape sending it"
            " as `Authorization: Bearer …` (401 otherwise). Unset: `/metrics` there is a 404."
        ),
    )
    metrics_host: str = Field(
        default="127.0.0.1",
        description=(
            "Address the API's, the worker's and the beat's metrics listen on (`0.0.0.0` in a container on a private "
            "network)."
        ),
    )
    worker_metrics_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description=(
            "Port of a worker's `/metrics` (the sum of its pool's processes); `0` serves none. Every worker node on "
            "one host needs its own."
        ),
    )
    beat_metrics_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="Port of a beat's `/metrics`; `0` serves none. Two beats on one host need two ports.",
    )

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
