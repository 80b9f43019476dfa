"""Keel's one settings object: every knob is an environment variable prefixed ``KEEL_``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from models.urls import sqlalchemy_url


class Settings(BaseSettings):
    """Configuration read from ``KEEL_*`` environment variables (and an optional ``.env`` file)."""

    model_config = SettingsConfigDict(env_prefix="KEEL_", env_file=".env", extra="ignore")

    environment: Literal["development", "test", "production"] = "development"
    # None means "use the embedded default under home" (development only).
    database_url: str | None = None
    broker_url: str | None = None
    home: Path = Path(".keel")

    db_pool_size: int = Field(default=10, ge=1, le=200)
    statement_timeout_ms: int = Field(default=30_000, ge=0)
    # Largest accepted request input, as canonical JSON.
    max_input_bytes: int = Field(default=64 * 1024, ge=1)

    # Jobs and the Celery side.
    imports: list[str] = Field(default_factory=list)  # modules with @handler functions, loaded by workers
    worker_concurrency: int = Field(default=2, ge=1, le=64)
    job_lease_seconds: float = Field(default=60.0, gt=0)  # a running job's lease; heartbeats renew it
    enqueue_timeout_seconds: float = Field(default=300.0, gt=0)  # enqueued but never claimed → re-published
    dispatch_interval_seconds: float = Field(default=0.5, gt=0)
    dispatch_batch: int = Field(default=500, ge=1)
    deadline_check_seconds: float = Field(default=5.0, gt=0)
    # Redis redelivers a message nobody acked after this long; every place that must agree reads this one value.
    visibility_timeout_seconds: int = Field(default=3600, ge=10)
    # Per error class overrides of the retry rules, e.g. {"transient": {"max_attempts": 3, "base_seconds": 2}}.
    retry_policy: dict[str, dict[str, float]] = Field(default_factory=dict)

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

    @field_validator("retry_policy")
    @classmethod
    def _retry_policy_names_known_classes(cls, value: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        known = {"transient", "rate_limited", "invalid", "budget", "unknown"}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"unknown error classes {sorted(unknown)}; known: {sorted(known)}")
        for never in ("invalid", "budget"):
            if value.get(never, {}).get("max_attempts", 1) != 1:
                raise ValueError(f"{never} failures are never retried: its max_attempts must stay 1")
        return value

    @model_validator(mode="after")
    def _outbox_lease_outlives_a_send(self) -> Settings:
        # A send (and the reconciliation before it) must end well inside the lease, or a second relay could
        # take the message over while the first is still talking to the receiver.
        if self.outbox_lease_seconds < 3 * self.http_timeout_seconds:
            raise ValueError("KEEL_OUTBOX_LEASE_SECONDS must be at least 3 x KEEL_HTTP_TIMEOUT_SECONDS")
        return self

    @model_validator(mode="after")
    def _lease_fits_visibility(self) -> Settings:
        if self.job_lease_seconds >= self.visibility_timeout_seconds:
            raise ValueError(
                "KEEL_JOB_LEASE_SECONDS must be shorter than KEEL_VISIBILITY_TIMEOUT_SECONDS, so a dead worker's job"
                " is recovered from Postgres before Redis redelivers its message"
            )
        return self

    @field_validator("database_url")
    @classmethod
    def _database_url_is_postgres(cls, value: str | None) -> str | None:
        if value is None:
            return None
        return sqlalchemy_url(value)

    @field_validator("broker_url")
    @classmethod
    def _broker_url_is_redis(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("redis://", "rediss://", "redis+socket://")):
            raise ValueError(f"KEEL_BROKER_URL must be a redis:// URL, got scheme of {value.split(':', 1)[0]!r}")
        return value

    @model_validator(mode="after")
    def _production_needs_real_servers(self) -> Settings:
        if self.environment == "production" and (self.database_url is None or self.broker_url is None):
            raise ValueError(
                "KEEL_ENVIRONMENT=production needs KEEL_DATABASE_URL and KEEL_BROKER_URL: "
                "the embedded development servers are not for production"
            )
        return self

    @property
    def uses_embedded(self) -> bool:
        return self.database_url is None or self.broker_url is None
