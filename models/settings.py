"""Keel's one settings object: every knob is an environment variable prefixed ``KEEL_``."""

from __future__ import annotations

import importlib
import ipaddress
import math
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from models.audit_destination import load_signing_key, parse_store_url
from models.errors import KeelError
from models.urls import sqlalchemy_url

#: A Slack conversation id (C…, G…, D…). Names like "#ops" are refused: the relay reconciles by reading the
#: channel's history, which takes ids only (agents.core.commands.MessageSpec applies the same rule to every message).
SLACK_CONVERSATION_ID = re.compile(r"^[CGD][A-Z0-9]{1,20}$")
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_RETRY_FIELDS = {"max_attempts", "base_seconds", "max_seconds", "jitter"}
#: What a broker prefix may hold: no spaces, and none of Redis's glob characters (``*?[]\\``), so that
#: ``SCAN MATCH <prefix>*`` finds exactly one deployment's keys.
_BROKER_PREFIX = re.compile(r"^[A-Za-z0-9_.:/-]{0,100}$")
#: What an audit key's id may be: it is stored on every journal event it keys, and printed by `keel audit verify`.
AUDIT_KEY_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: The shortest secret the journal's HMAC takes: 32 bytes, SHA-256's own output size (RFC 2104 §3).
MIN_AUDIT_SECRET_BYTES = 32
#: A database role name Keel creates and names in SQL: lower case, so that it reads the same quoted or not.
_ROLE_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")

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

#: What an API token may be allowed to do (see agents/ingress). Rate limits are set per scope.
SCOPES = ("producer", "approver", "operator", "auditor")


class ScopeRateLimit(BaseModel):
    """One scope's default rate control: ``rate`` requests per second sustained, ``burst`` at once (a token
    bucket holding ``burst`` requests that refills at ``rate`` per second)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rate: float = Field(gt=0, le=1_000_000, allow_inf_nan=False)
    burst: int = Field(ge=1, le=1_000_000)

    @field_validator("rate", "burst", mode="before")
    @classmethod
    def _not_a_boolean(cls, value: object) -> object:
        if isinstance(value, bool):  # JSON true would otherwise pass as 1
            raise ValueError("must be a number, not true or false")
        return value


#: Producers are services submitting work: the most headroom. Approvers are people in the console (a page makes a
#: few reads, an approval one write). Operators are people and their scripts (retries, cancels). Auditors read the
#: journal page by page.
DEFAULT_API_RATE_LIMITS: dict[str, ScopeRateLimit] = {
    "producer": ScopeRateLimit(rate=50, burst=100),
    "approver": ScopeRateLimit(rate=5, burst=20),
    "operator": ScopeRateLimit(rate=20, burst=50),
    "auditor": ScopeRateLimit(rate=10, burst=50),
}


#: The longest interval, timeout, lease or age in seconds a setting may name: ten years.
MAX_SECONDS = 10 * 365 * 86400.0


class BadConfiguration(KeelError, ValueError):
    """A ``KEEL_*`` setting is missing, malformed or unsafe. The message is one line naming the variable and the
    rule: ``bad configuration: KEEL_X: …``."""


class Settings(BaseSettings):
    """Configuration read from ``KEEL_*`` environment variables (and an optional ``.env`` file)."""

    model_config = SettingsConfigDict(env_prefix="KEEL_", env_file=".env", extra="ignore")

    environment: Literal["development", "test", "production"] = "development"
    # None means "use the embedded default under home" (development only).
    database_url: str | None = None
    broker_url: str | None = None
    # What `keel db upgrade`, `keel db downgrade` and `keel db roles` connect with: a superuser, or a member of the
    # owning role (models/roles.py). None: KEEL_DATABASE_URL (development: the embedded server's superuser).
    migration_database_url: str | None = None
    # The database roles (models/roles.py): the owner of Keel's schema (migrations SET ROLE to it), the role the
    # API, workers, beat and relay log in as (SELECT and INSERT on the journal, no more), and a read-only auditor.
    db_owner_role: str = "keel_owner"
    db_app_role: str = "keel_app"
    db_auditor_role: str = "keel_auditor"
    # Their passwords, set by `keel db roles` (None: the role gets no password; set one with ALTER ROLE … PASSWORD).
    db_app_password: SecretStr | None = None
    db_auditor_password: SecretStr | None = None
    # Put before every Redis key and pub/sub channel Keel's Celery uses (kombu's ``global_keyprefix``), so that
    # deployments (or test runs) sharing one Redis database never see each other's messages or broadcasts.
    broker_prefix: str = ""
    # How long a connection to Redis waits for it to connect or answer before it is given up on (and retried): a
    # broker that accepts connections but never answers (a hung or paused server, a lost route) must not hang a
    # worker's publish or the beat for ever. Above kombu's 1 s BRPOP wait, which a consumer's read spans.
    broker_socket_timeout_seconds: float = Field(default=10.0, ge=2.0, le=300)
    home: Path = Path(".keel")
    #: How processes write their log lines: one JSON object per line, or readable lines; None: readable on a
    #: terminal, JSON otherwise (agents/observability/logs.py).
    log_format: Literal["json", "console"] | None = None

    # Whether KEEL_DATABASE_URL goes through a connection pooler in transaction mode (PgBouncer
    # pool_mode=transaction): then Keel prepares no statements, sends no startup options (the statement timeout is
    # the role's: README "Behind PgBouncer") and keeps what needs a session of its own on KEEL_DATABASE_DIRECT_URL.
    database_pooler: Literal["none", "transaction"] = "none"
    # A direct connection to PostgreSQL, for what a transaction pooler cannot carry: the API's live events (LISTEN)
    # and the audit shipper's lock. None: KEEL_DATABASE_URL (required when KEEL_DATABASE_POOLER=transaction).
    database_direct_url: str | None = None
    # Connections per process (README "Connection budget"): each pool keeps up to its size open and opens as many
    # again in a burst. KEEL_DB_POOL_SIZE is the API's (and any process not named below).
    db_pool_size: int = Field(default=10, ge=1, le=200)
    db_pool_size_worker: int = Field(default=2, ge=1, le=200)  # each worker (and relay) pool child
    db_pool_size_beat: int = Field(
        default=4, ge=1, le=200
    )  # besides its lease connection: dispatch, 3 passes, verify, ship, prune threads
    db_pool_size_cli: int = Field(default=2, ge=1, le=200)
    statement_timeout_ms: int = Field(default=30_000, ge=0)
    # TCP keepalives and the TCP user timeout on every connection to PostgreSQL over TCP (models/keepalives.py): a
    # server that vanished without a word (a partition, a host powered off) is given up on in about a minute, not
    # after the kernel's two hours. 0: the operating system's default.
    db_keepalives_idle_seconds: int = Field(default=30, ge=0, le=86_400)
    db_keepalives_interval_seconds: int = Field(default=10, ge=0, le=3_600)
    db_keepalives_count: int = Field(default=3, ge=0, le=100)
    db_tcp_user_timeout_ms: int = Field(default=30_000, ge=0, le=3_600_000)
    # Largest accepted request input, as canonical JSON.
    max_input_bytes: int = Field(default=64 * 1024, ge=1)

    # The HTTP API's rate control per token, shared by every API process through Redis. Per scope, e.g.
    # {"producer": {"rate": 100, "burst": 200}}; scopes not named keep their defaults. A token with several scopes
    # gets the most generous of their limits.
    api_rate_limit_enabled: bool = True
    api_rate_limits: dict[str, ScopeRateLimit] = Field(default_factory=lambda: dict(DEFAULT_API_RATE_LIMITS))

    # Jobs and the Celery side.
    imports: list[str] = Field(default_factory=list)  # modules with @handler functions, loaded by workers
    worker_concurrency: int = Field(default=2, ge=1, le=64)
    # Celery's task events (what Flower's task views show) cost a few broker messages per job: off unless asked for.
    # A running Flower asks for them itself (its enable_events, on by default), so its views work either way.
    worker_task_events: bool = False
    # Messages a worker process holds beyond the one it runs: 1 takes the next message only when a process is free,
    # so a long step never holds another job back from an idle worker elsewhere (Keel's steps are model calls).
    worker_prefetch_multiplier: int = Field(default=1, ge=1, le=64)
    job_lease_seconds: float = Field(default=60.0, gt=0)  # a running job's lease; heartbeats renew it
    enqueue_timeout_seconds: float = Field(default=300.0, gt=0)  # enqueued but never claimed → re-published
    dispatch_interval_seconds: float = Field(default=0.5, gt=0)
    # A submit through `Client.from_settings`, the CLI or the API publishes its first job to the broker right after
    # its commit (the dispatcher is then only the safety net: a publish that fails leaves the job to its next pass).
    # false: every job waits for the dispatcher's next pass (up to KEEL_DISPATCH_INTERVAL_SECONDS).
    publish_at_submit: bool = True
    # The beat leader's lease (tasks/leadership.py), renewed every dispatch interval: a leader that dies is taken
    # over at most this long after its last renewal (plus a dispatch interval); one that stops cleanly, at once.
    beat_lease_seconds: float = Field(default=5.0, gt=0)
    dispatch_batch: int = Field(default=500, ge=1)
    # Back-pressure: one dispatcher tick publishes at most this many jobs (the rest stay due in PostgreSQL for the
    # next tick), and publishes none while a job queue on the broker already holds this many messages (0: never
    # waits for the broker). Due jobs, recovered ones included, then wait in PostgreSQL, not in Redis.
    dispatch_max_per_tick: int = Field(default=5000, ge=1)
    dispatch_max_queue_depth: int = Field(default=20000, ge=0)
    deadline_check_seconds: float = Field(default=5.0, gt=0)
    # The deadline pass and the schedule pass take this many due agents / schedules at a time.
    deadline_batch: int = Field(default=200, ge=1)
    schedule_batch: int = Field(default=100, ge=1)
    # The KPI counters (models/kpi_sql.py): the leading beat folds their deltas into per-minute rollups at most this
    # often, and keeps the per-minute rollups (what `keel kpi --since` and the alerts read) this many days.
    kpi_fold_seconds: float = Field(default=5.0, gt=0)
    kpi_retention_days: int = Field(default=35, ge=1, le=3650)
    # Retention (models/retention_sql.py, `keel db prune`): finished jobs, sent outbox messages with their delivery
    # log rows, and requests' inputs, this many days after they finished (a request: after its submit); 0 keeps
    # them for ever. Nothing of a request in flight, no dead letter and nothing unsent is ever pruned; the journal
    # is not (`keel audit archive`). The leading beat prunes this often (0: only `keel db prune` does), in
    # transactions of at most ``prune_batch`` rows each.
    jobs_retention_days: int = Field(default=30, ge=0, le=36500)
    outbox_retention_days: int = Field(default=30, ge=0, le=36500)
    requests_retention_days: int = Field(default=90, ge=0, le=36500)
    prune_interval_seconds: float = Field(default=3600.0, ge=0)
    prune_batch: int = Field(default=1000, ge=1, le=100_000)
    # Redis redelivers a message nobody acked after this long; every place that must agree reads this one value.
    visibility_timeout_seconds: int = Field(default=3600, ge=10)
    # Per error class overrides of the retry rules, e.g. {"transient": {"max_attempts": 3, "base_seconds": 2}}.
    retry_policy: dict[str, dict[str, float]] = Field(default_factory=dict)
    # How long one attempt of an operation may run before it is ended for real (its worker process is replaced)
    # and counted as an ``unknown`` failure: per operation, e.g. {"plan": 120, "tool": 300}; others get the default.
    run_limit_seconds: float = Field(default=900.0, gt=0)
    run_limits: dict[str, float] = Field(default_factory=dict)

    # Inference: "scripted" replays the conversation each request carries in its input (tests, the demo, offline
    # use); "openai" calls an OpenAI-compatible chat-completions endpoint.
    llm_provider: Literal["scripted", "openai"] = "scripted"
    llm_base_url: str = "https://api.openai.com/v1"
    llm_model: str = "gpt-4o-mini"
    llm_api_key: SecretStr | None = None
    llm_timeout_seconds: float = Field(default=60.0, gt=0)
    # USD per million tokens, e.g. {"gpt-4o-mini": {"input": 0.15, "output": 0.6}}.
    llm_prices: dict[str, dict[str, float]] = Field(default_factory=dict)
    llm_system_prompt: str = "You are a careful assistant. Use the tools when they help; answer briefly."

    # The outbox relay and the receivers it talks to. Tokens are secrets: never logged, never in error text.
    slack_token: SecretStr | None = None
    slack_api_url: str = "https://slack.com/api/"
    github_token: SecretStr | None = None
    github_api_url: str = "https://api.github.com"
    http_timeout_seconds: float = Field(default=10.0, gt=0)
    # Where Keel tells people it stopped a request at its hard deadline (a Slack channel), if anywhere.
    notify_slack_channel: str | None = None
    # Where people are told that a tool call waits for their approval, and how it was decided (a Slack channel), if
    # anywhere; and where a call is escalated when its tool's approval timeout passes with on_timeout="escalate".
    approval_slack_channel: str | None = None
    approval_escalation_slack_channel: str | None = None
    # How often the leading beat looks for calls that waited longer than their tool's approval timeout.
    approval_check_seconds: float = Field(default=5.0, gt=0)
    outbox_interval_seconds: float = Field(default=0.5, gt=0)
    outbox_concurrency: int = Field(default=8, ge=1, le=128)  # destinations sent to at once
    outbox_lease_seconds: float = Field(default=60.0, gt=0)
    outbox_max_attempts: int = Field(default=12, ge=1)
    outbox_backoff_seconds: float = Field(default=1.0, gt=0)
    outbox_backoff_max_seconds: float = Field(default=300.0, gt=0)
    outbox_pass_seconds: float = Field(default=10.0, gt=0)  # one relay pass sends for at most this long
    outbox_max_rate_limited: int = Field(default=200, ge=1)  # rate-limited attempts before a message is dead
    outbox_reconcile_max_pages: int = Field(default=10, ge=1)  # history/comment pages one reconciliation reads
    outbox_reconcile_seconds: float | None = Field(default=None, gt=0)  # its time budget; None: a third of the lease

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
    # The leading beat runs `keel audit verify` (in a thread of its own) this often, incrementally: each chain from its
    # checkpoint; 0: never. Once the last full pass recorded (the beat's or a person's) is this old, that run is a
    # full pass instead (every chain from its start: the only pass that sees an edit below a checkpoint); 0: never.
    audit_verify_interval_seconds: float = Field(default=3600.0, ge=0)
    audit_verify_full_interval_seconds: float = Field(default=86400.0, ge=0)
    # Chains a verify walks per transaction: each chunk's snapshot ends with it, so vacuum is held back for one chunk.
    audit_verify_chunk_chains: int = Field(default=500, ge=1, le=100_000)
    # ... and fewer when their walks would read more events than this together (a longer chain is a chunk of its own).
    audit_verify_chunk_events: int = Field(default=50_000, ge=1, le=10_000_000)
    # Shipping the journal to a separate store (agents/audit/ship.py, `keel audit ship`): sealed segments of JSON
    # Lines to s3://bucket/prefix or file:///path; unset, nothing is shipped. The leading beat ships this often
    # (0: only `keel audit ship` does).
    audit_ship_url: str | None = None
    audit_ship_interval_seconds: float = Field(default=60.0, ge=0)
    # A segment closes at this many events, or once its oldest event is this many minutes old.
    audit_segment_events: int = Field(default=1000, ge=1, le=100_000)
    audit_segment_minutes: float = Field(default=10.0, gt=0, le=7 * 24 * 60)
    # How long a shipper waits for the transactions writing the journal when it starts to end (their ids are final
    # only then); past it, the rest waits for the next run (`keel audit ship` exits 75).
    audit_settle_seconds: float = Field(default=30.0, gt=0, le=3600)
    # An S3-compatible store other than AWS (MinIO, Ceph...); credentials and region come from boto3's own
    # environment variables and config files.
    audit_s3_endpoint_url: str | None = None
    # S3 Object Lock on every shipped object: retained this many days (0: no retention headers), in this mode.
    audit_object_lock_days: int = Field(default=0, ge=0, le=36_500)
    audit_object_lock_mode: Literal["COMPLIANCE", "GOVERNANCE"] = "COMPLIANCE"
    # The journal is partitioned by month (docs/audit-retention.md): the leading beat keeps partitions for the current
    # month and this many after it (daily, and when it starts leading). The journal_partitions alert fires below 2.
    audit_partition_months_ahead: int = Field(default=3, ge=2, le=12)
    # An Ed25519 private key (PEM, PKCS#8: `openssl genpkey -algorithm ed25519`): each segment's manifest is also
    # signed with it, so a holder of the public key can check the shipped copy without any secret.
    audit_signing_key: SecretStr | None = None
    # `keel audit archive` takes a month of the journal only once it ended more than this many days ago.
    audit_archive_grace_days: int = Field(default=7, ge=0, le=3650)
    # The daily KPI report (the last 24 h) goes to KEEL_ALERT_SLACK_CHANNEL at this time of day, UTC ("HH:MM");
    # "off": no report.
    kpi_report_at: str = "08:00"

    # HTTP ingress (`keel serve`)
    api_host: str = "127.0.0.1"
    api_port: int = Field(default=8000, ge=1, le=65535)
    api_workers: int = Field(default=1, ge=1, le=64)  # uvicorn worker processes
    api_max_body_bytes: int = Field(default=256 * 1024, ge=1024)  # larger request bodies are refused with 413
    #: Live event streams (API and console) one token may hold open in one API process, and all tokens together;
    #: past either a new one is refused with 429. Each is a socket: keep the process's open-file limit above it.
    api_max_streams_per_token: int = Field(default=100, ge=1, le=100_000)
    api_max_streams_per_process: int = Field(default=1000, ge=1, le=100_000)
    #: On SIGTERM, requests in flight get this long to finish (event streams end at once); below compose's 30 s.
    api_shutdown_seconds: int = Field(default=25, ge=0, le=3600)
    #: The address people and producers reach the API at (links in Slack messages, the demo's summary);
    #: None: http://{api_host}:{api_port}.
    api_public_url: str | None = None

    # Traces (OpenTelemetry): off unless an OTLP/HTTP collector is named, e.g. http://otel-collector:4318 (spans go
    # to its /v1/traces). Unset, the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT turn
    # them on instead (agents/observability/tracing.py).
    otlp_endpoint: str | None = None
    # Prometheus metrics (every tenant's spend and alerts are in them). Each process serves /metrics on a port of its
    # own on KEEL_METRICS_HOST, 0 = not served (several on one host need distinct ports): the API's is served by `keel
    # serve`'s main process for all its workers. With a token, the API also serves /metrics on its own port to a
    # scrape that sends it; without one, never there.
    api_metrics_port: int = Field(default=0, ge=0, le=65535)
    api_metrics_token: SecretStr | None = None
    #: The proxies ``keel serve`` believes the ``X-Forwarded-For`` and ``X-Forwarded-Proto`` headers of (addresses or
    #: networks, e.g. ["10.0.0.0/8"]): the client address the console's sign-in limit counts by comes from them only
    #: when the connection comes from one of these. Empty: believe no one, the connection's own address counts.
    api_forwarded_allow_ips: list[str] = Field(default_factory=list)
    #: Signs the operator console's session cookies (at least 32 characters). None: a random key per API process,
    #: so sessions end when it restarts; required with KEEL_API_WORKERS > 1 (sessions must carry over between them).
    console_session_key: SecretStr | None = None

    # The journal's key ring (models/audit_keys.py): key id -> secret (at least 32 bytes), as JSON, e.g.
    # {"2025-06": "…"}; every journal event is linked to the previous one with an HMAC under one of them, and stores
    # its id. KEEL_AUDIT_KEY_ID names the key new events use (optional when the ring holds one key); the others stay
    # in the ring to check older events. Unset outside production: a key generated once under KEEL_HOME.
    audit_keys: dict[str, SecretStr] = Field(default_factory=dict)
    audit_key_id: str | None = None
    #: Failed tokens (unknown or revoked, at the console's sign-in or in an API call), counted in Redis like the API's
    #: rate limits: from one client address at most ``burst`` at once, then one more every 60/``per_minute`` seconds;
    #: an address over it is refused (429) before its token is looked up, a correct one too. Over all addresses
    #: together the ``global`` pair: past it, one failure uses up its address's allowance (agents/ingress/console/
    #: signin_limits.py); it never refuses a real token by itself.
    console_signin_limit_enabled: bool = True
    console_signin_burst: int = Field(default=10, ge=1, le=1_000_000)
    console_signin_per_minute: float = Field(default=5.0, gt=0, le=1_000_000, allow_inf_nan=False)
    console_signin_global_burst: int = Field(default=100, ge=1, le=1_000_000)
    console_signin_global_per_minute: float = Field(default=60.0, gt=0, le=1_000_000, allow_inf_nan=False)
    #: Rows per page of the console's lists: the agents, the outbox's unsent messages, an agent's journal.
    console_page_size: int = Field(default=100, ge=1, le=1000)

    metrics_host: str = "127.0.0.1"
    worker_metrics_port: int = Field(default=0, ge=0, le=65535)
    beat_metrics_port: int = Field(default=0, ge=0, le=65535)

    @model_validator(mode="after")
    def _outbox_reconcile_fits_the_lease(self) -> Settings:
        # The lease is renewed right before a reconciliation and must still be live when it ends (its last page
        # may start just before the budget runs out), or the relay backs off instead of sending.
        budget = self.outbox_reconcile_seconds
        if budget is not None and budget + self.http_timeout_seconds >= self.outbox_lease_seconds:
            raise ValueError(
                "KEEL_OUTBOX_RECONCILE_SECONDS + KEEL_HTTP_TIMEOUT_SECONDS must be less than KEEL_OUTBOX_LEASE_SECONDS"
            )
        return self

    # Field validators say the rule only: the variable's name is added from the error's location. Model
    # validators compare settings and start their message with the variable to change ("KEEL_X: …"). Values that
    # may hold a password (URLs, tokens) are never echoed.

    @field_validator("retry_policy")
    @classmethod
    def _retry_policy_is_complete_and_sane(cls, value: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        known = {"transient", "rate_limited", "invalid", "budget", "unknown"}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"unknown error classes {sorted(unknown)}; known: {sorted(known)}")
        for name, fields in value.items():
            odd = set(fields) - _RETRY_FIELDS
            if odd:
                raise ValueError(f"{name}: unknown fields {sorted(odd)}; known: {sorted(_RETRY_FIELDS)}")
            attempts = fields.get("max_attempts", 1)
            if attempts != int(attempts) or attempts < 1:
                raise ValueError(f"{name}.max_attempts must be a whole number of at least 1, got {attempts}")
            for seconds in ("base_seconds", "max_seconds"):
                if seconds in fields and not fields[seconds] > 0:
                    raise ValueError(f"{name}.{seconds} must be greater than 0, got {fields[seconds]}")
            if fields.get("max_seconds", float("inf")) < fields.get("base_seconds", 0):
                raise ValueError(f"{name}.max_seconds must not be below {name}.base_seconds")
            if not 0 <= fields.get("jitter", 0) <= 1:
                raise ValueError(f"{name}.jitter must be between 0 and 1, got {fields['jitter']}")
        for never in ("invalid", "budget"):
            if value.get(never, {}).get("max_attempts", 1) != 1:
                raise ValueError(f"{never} failures are never retried: its max_attempts must stay 1")
        return value

    @field_validator("api_rate_limits")
    @classmethod
    def _rate_limits_are_per_known_scope(cls, value: dict[str, ScopeRateLimit]) -> dict[str, ScopeRateLimit]:
        unknown = set(value) - set(SCOPES)
        if unknown:
            raise ValueError(f"unknown scopes {sorted(unknown)}; known: {list(SCOPES)}")
        return {**DEFAULT_API_RATE_LIMITS, **value}

    @field_validator("llm_prices")
    @classmethod
    def _prices_are_per_direction(cls, value: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        for model, price in value.items():
            if not price or set(price) - {"input", "output"}:
                raise ValueError(f"{model}: give prices as {{'input': …, 'output': …}} (USD per million tokens)")
            if any(p < 0 for p in price.values()):
                raise ValueError(f"{model}: prices must not be negative")
        return value

    @field_validator("imports")
    @classmethod
    def _imports_are_module_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if not _MODULE_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a module name (dotted Python identifiers, e.g. myapp.handlers)")
        return value

    @field_validator(
        "notify_slack_channel",
        "alert_slack_channel",
        "approval_slack_channel",
        "approval_escalation_slack_channel",
        "slack_token",
        "github_token",
        "llm_api_key",
        "otlp_endpoint",
        "api_metrics_token",
        "console_session_key",
        "audit_key_id",
        "migration_database_url",
        "db_app_password",
        "db_auditor_password",
        "audit_key_id",
        "audit_ship_url",
        "audit_s3_endpoint_url",
        "audit_signing_key",
        mode="before",
    )
    @classmethod
    def _empty_means_unset(cls, value: object) -> object:
        # compose passes an unset variable on as "" (`${KEEL_SLACK_TOKEN:-}`): that is "none", not an empty token
        # every send would fail with.
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("api_metrics_token")
    @classmethod
    def _metrics_token_is_long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 16:
            raise ValueError("must be at least 16 characters (Prometheus sends it as a Bearer token)")
        return value

    @field_validator("api_forwarded_allow_ips")
    @classmethod
    def _forwarded_allow_ips_are_addresses(cls, value: list[str]) -> list[str]:
        for entry in value:
            if entry.strip() == "*":
                raise ValueError(
                    "name the proxies' addresses or networks (e.g. 10.0.0.0/8), not '*': with '*' any client could"
                    " claim any address"
                )
            try:
                ipaddress.ip_network(entry.strip(), strict=True)
            except ValueError:
                raise ValueError(
                    f"{entry[:60]!r} is not an IP address or network (e.g. 10.0.0.7, 10.0.0.0/8, fd00::/8; a network"
                    " without host bits set)"
                ) from None
        return [entry.strip() for entry in value]

    @model_validator(mode="after")
    def _signin_limits_fit_together(self) -> Settings:
        if self.console_signin_global_burst < self.console_signin_burst:
            raise ValueError(
                "KEEL_CONSOLE_SIGNIN_GLOBAL_BURST: must not be below KEEL_CONSOLE_SIGNIN_BURST (the ceiling over every"
                " address would be lower than one address's own limit)"
            )
        return self

    @model_validator(mode="after")
    def _api_metrics_port_is_its_own(self) -> Settings:
        if self.api_metrics_port == self.api_port:
            raise ValueError(
                f"KEEL_API_METRICS_PORT: {self.api_metrics_port} is the API's own port (KEEL_API_PORT or keel serve"
                " --port): metrics are served on a port of their own"
            )
        return self

    @model_validator(mode="after")
    def _several_api_processes_share_a_session_key(self) -> Settings:
        # `keel serve --workers N` is held to this too: it loads the settings with api_workers=N.
        if self.api_workers > 1 and self.console_session_key is None:
            raise ValueError(
                "KEEL_CONSOLE_SESSION_KEY: required when KEEL_API_WORKERS is above 1 (or keel serve --workers): each"
                " process would sign console sessions with a random key of its own, so signing in would fail on"
                " alternate requests"
            )
        return self

    @field_validator("console_session_key")
    @classmethod
    def _session_key_is_long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 32:
            raise ValueError("must be at least 32 characters (it signs the console's session cookies)")
        return value

    @field_validator("audit_keys")
    @classmethod
    def _audit_keys_are_named_and_long_enough(cls, value: dict[str, SecretStr]) -> dict[str, SecretStr]:
        # Ids are not secret (every event stores one); secrets are never echoed, not even their length's digits.
        for key_id, secret in value.items():
            if not AUDIT_KEY_ID.fullmatch(key_id):
                raise ValueError(
                    f"key id {key_id[:70]!r}: use 1 to 64 letters, digits and . _ - (e.g. 2025-06); it is stored on"
                    " every event the key links"
                )
            if len(secret.get_secret_value().encode()) < MIN_AUDIT_SECRET_BYTES:
                raise ValueError(
                    f"key {key_id!r}: its secret must be at least {MIN_AUDIT_SECRET_BYTES} bytes, e.g. the output of"
                    ' python3 -c "import secrets; print(secrets.token_urlsafe(48))"'
                )
        return value

    @model_validator(mode="after")
    def _audit_key_id_is_in_the_ring(self) -> Settings:
        ring = sorted(self.audit_keys)
        if self.audit_key_id is not None and not self.audit_keys:
            raise ValueError(
                "KEEL_AUDIT_KEY_ID: set, but KEEL_AUDIT_KEYS is empty: give the key ring as JSON, key id -> secret"
            )
        if self.audit_key_id is not None and self.audit_key_id not in self.audit_keys:
            raise ValueError(
                f"KEEL_AUDIT_KEY_ID: {self.audit_key_id[:70]!r} is not a key of KEEL_AUDIT_KEYS"
                f" (its keys: {', '.join(ring)})"
            )
        if self.audit_key_id is None and len(ring) > 1:
            raise ValueError(
                f"KEEL_AUDIT_KEY_ID: required when KEEL_AUDIT_KEYS holds several keys ({', '.join(ring)}): name the one"
                " new journal events are linked with"
            )
        if self.environment == "production" and not self.audit_keys:
            raise ValueError(
                "KEEL_AUDIT_KEYS: production needs the journal's key ring (key id -> secret of at least"
                f" {MIN_AUDIT_SECRET_BYTES} bytes, as JSON), kept outside the database: without it anyone who can"
                " write the database could rewrite the journal undetected"
            )
        return self

    @property
    def current_audit_key_id(self) -> str | None:
        """The id of the key new journal events are linked with: KEEL_AUDIT_KEY_ID, or the ring's only key."""
        if self.audit_key_id is not None:
            return self.audit_key_id
        return next(iter(self.audit_keys), None)

    @field_validator(
        "notify_slack_channel", "alert_slack_channel", "approval_slack_channel", "approval_escalation_slack_channel"
    )
    @classmethod
    def _notify_channel_is_a_conversation_id(cls, value: str | None) -> str | None:
        if value is not None and not SLACK_CONVERSATION_ID.fullmatch(value):
            raise ValueError(
                f"must be a Slack conversation id like C0123ABCD (C…, G… or D…), not {value[:40]!r}:"
                " channel names cannot be read back to reconcile a send"
            )
        return value

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

    @field_validator("llm_base_url", "slack_api_url", "github_api_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        return value

    @field_validator("otlp_endpoint", "api_public_url")
    @classmethod
    def _optional_http_url(cls, value: str | None) -> str | None:
        # OTLP over HTTP only (the gRPC exporter is not shipped); the URL may carry credentials: never echoed. The
        # API's public address ends up in the links of Slack notices: a wrong one is refused at start, not sent.
        return None if value is None else cls._http_url(value)

    @field_validator("slack_api_url")
    @classmethod
    def _slack_api_url_ends_with_slash(cls, value: str) -> str:
        # The Slack SDK appends method names to it as they are ("…/api/" + "chat.postMessage").
        return value if value.endswith("/") else value + "/"

    @model_validator(mode="after")
    def _outbox_lease_outlives_a_send(self) -> Settings:
        # A send (and the reconciliation before it) must end well inside the lease, or a second relay could
        # take the message over while the first is still talking to the receiver.
        if self.outbox_lease_seconds < 3 * self.http_timeout_seconds:
            raise ValueError("KEEL_OUTBOX_LEASE_SECONDS: must be at least 3 x KEEL_HTTP_TIMEOUT_SECONDS")
        return self

    @model_validator(mode="after")
    def _lease_fits_visibility(self) -> Settings:
        if self.job_lease_seconds >= self.visibility_timeout_seconds:
            raise ValueError(
                "KEEL_JOB_LEASE_SECONDS: must be shorter than KEEL_VISIBILITY_TIMEOUT_SECONDS, so a dead worker's"
                " job is recovered from Postgres before Redis redelivers its message"
            )
        return self

    @model_validator(mode="after")
    def _intervals_fit_together(self) -> Settings:
        if self.enqueue_timeout_seconds <= self.dispatch_interval_seconds:
            raise ValueError(
                "KEEL_ENQUEUE_TIMEOUT_SECONDS: must be longer than KEEL_DISPATCH_INTERVAL_SECONDS, or every"
                " dispatcher pass re-publishes every job still waiting in the queue"
            )
        if self.beat_lease_seconds < 3 * self.dispatch_interval_seconds:
            raise ValueError(
                "KEEL_BEAT_LEASE_SECONDS: must be at least three times KEEL_DISPATCH_INTERVAL_SECONDS, or one slow"
                " tick hands leadership to another beat"
            )
        if self.outbox_backoff_max_seconds < self.outbox_backoff_seconds:
            raise ValueError("KEEL_OUTBOX_BACKOFF_MAX_SECONDS: must not be below KEEL_OUTBOX_BACKOFF_SECONDS")
        return self

    @model_validator(mode="after")
    def _openai_needs_a_key(self) -> Settings:
        # Other OpenAI-compatible endpoints (a local server) may need none; OpenAI's own always does.
        if self.llm_provider == "openai" and self.llm_api_key is None and "api.openai.com" in self.llm_base_url:
            raise ValueError("KEEL_LLM_API_KEY: required when KEEL_LLM_PROVIDER=openai calls api.openai.com")
        return self

    @field_validator("*")
    @classmethod
    def _seconds_are_finite(cls, value: Any, info: ValidationInfo) -> Any:
        # An interval, timeout or lease of inf (or 1e300) passes a bare lower bound, then fails in timedelta() or a
        # sleep on every tick of whatever uses it.
        if (
            info.field_name is not None
            and info.field_name.endswith("_seconds")
            and isinstance(value, float)
            and not (math.isfinite(value) and value <= MAX_SECONDS)
        ):
            raise ValueError(f"must be a finite number of seconds, at most {MAX_SECONDS:.0f} (ten years), got {value}")
        return value

    @field_validator("db_owner_role", "db_app_role", "db_auditor_role")
    @classmethod
    def _role_name_is_plain(cls, value: str) -> str:
        if not _ROLE_NAME.fullmatch(value):
            raise ValueError(
                f"{value[:70]!r} is not a role name Keel uses: lower-case letters, digits and _ (at most 63,"
                " not starting with a digit), e.g. keel_app"
            )
        return value

    @model_validator(mode="after")
    def _roles_are_three(self) -> Settings:
        names = [self.db_owner_role, self.db_app_role, self.db_auditor_role]
        if len(set(names)) != 3:
            raise ValueError(
                "KEEL_DB_APP_ROLE: the owner, application and auditor roles must be three different roles"
                f" (KEEL_DB_OWNER_ROLE={names[0]}, KEEL_DB_APP_ROLE={names[1]}, KEEL_DB_AUDITOR_ROLE={names[2]})"
            )
        return self

    @model_validator(mode="after")
    def _pooler_needs_a_direct_url(self) -> Settings:
        if self.database_pooler == "transaction" and self.database_direct_url is None:
            raise ValueError(
                "KEEL_DATABASE_DIRECT_URL: required with KEEL_DATABASE_POOLER=transaction (the API's live events"
                " and the audit shipper's lock need a session of their own, which a transaction pooler does not keep)"
            )
        if self.database_pooler == "transaction" and self.database_direct_url == self.database_url:
            raise ValueError(
                "KEEL_DATABASE_DIRECT_URL: must reach PostgreSQL itself, not the pooler KEEL_DATABASE_URL goes through"
                " (KEEL_DATABASE_POOLER=transaction)"
            )
        return self

    @field_validator("database_url", "migration_database_url", "database_direct_url")
    @classmethod
    def _database_url_is_postgres(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return sqlalchemy_url(value)
        except ValueError as exc:
            if "Keel needs PostgreSQL" in str(exc):
                raise
            raise ValueError("not a database URL (expected postgresql://user@host:port/database)") from None

    @field_validator("broker_url")
    @classmethod
    def _broker_url_is_redis(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("redis://", "rediss://", "redis+socket://")):
            raise ValueError(f"must be a redis:// URL, got scheme {value.split(':', 1)[0][:20]!r}")
        return value

    @field_validator("audit_ship_url")
    @classmethod
    def _ship_url_is_a_store(cls, value: str | None) -> str | None:
        if value is not None:
            parse_store_url(value)  # ValueError names the rule
        return value

    @field_validator("audit_signing_key")
    @classmethod
    def _signing_key_is_ed25519(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            load_signing_key(value.get_secret_value())  # ValueError names the rule, never the key
        return value

    @field_validator("broker_prefix")
    @classmethod
    def _broker_prefix_is_plain(cls, value: str) -> str:
        if not _BROKER_PREFIX.fullmatch(value):
            raise ValueError("may hold only letters, digits and . _ : / - (at most 100 characters), e.g. keel-staging:")
        return value

    @model_validator(mode="after")
    def _production_needs_real_servers(self) -> Settings:
        if self.environment == "production" and (self.database_url is None or self.broker_url is None):
            raise ValueError(
                "KEEL_ENVIRONMENT: production needs KEEL_DATABASE_URL and KEEL_BROKER_URL: "
                "the embedded development servers are not for production"
            )
        return self

    @property
    def uses_embedded(self) -> bool:
        return self.database_url is None or self.broker_url is None


def load_settings(**overrides: Any) -> Settings:
    """Read the settings, or raise :class:`BadConfiguration` with one line naming the variable and the rule.
    Every process and ``keel`` command starts here, so a bad value stops it at once instead of breaking later."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise BadConfiguration(describe(exc)) from None
    except SettingsError as exc:  # a complex value (list, dict) that is not JSON
        found = re.search(r'field "(\w+)"', str(exc))
        variable = f"KEEL_{found.group(1).upper()}" if found else "KEEL_*"
        raise BadConfiguration(f"bad configuration: {variable}: must be JSON (a list or an object)") from None


def describe(exc: ValidationError) -> str:
    """``bad configuration: KEEL_X: rule`` for every error in ``exc``, on one line."""
    problems = []
    for error in exc.errors(include_url=False, include_input=False):
        message = " ".join(str(error["msg"]).removeprefix("Value error, ").split())
        location = [str(part) for part in error["loc"]]
        if not location:  # a model validator: its message names the variable
            problems.append(message)
            continue
        variable = f"KEEL_{location[0].upper()}"
        inner = ".".join(location[1:])
        problems.append(f"{variable}: {inner + ': ' if inner else ''}{message}")
    return "bad configuration: " + "; ".join(problems)


def check_imports(settings: Settings) -> None:
    """Import every ``KEEL_IMPORTS`` module now (a worker's start), so a missing or broken one stops the worker
    with :class:`BadConfiguration` instead of failing each job that needs its handlers."""
    for module in settings.imports:
        try:
            importlib.import_module(module)
        except Exception as exc:  # whatever the module raises, the worker would die on it later
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
            raise BadConfiguration(
                f"bad configuration: KEEL_IMPORTS: module {module!r} cannot be imported ({reason})"
            ) from None
