"""Keel's one settings object: every knob is an environment variable prefixed ``KEEL_``. Its fields are grouped by
concern in the ``models/settings_*.py`` modules (servers, jobs, services, API, audit, observability); the rules that
tie several settings together live here, on :class:`Settings` itself."""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from models.errors import KeelError
from models.settings_api import DEFAULT_API_RATE_LIMITS, SCOPES, ApiFields, ScopeRateLimit
from models.settings_audit import AUDIT_KEY_ID, MIN_AUDIT_SECRET_BYTES, AuditFields
from models.settings_jobs import JobFields
from models.settings_observability import ALERT_NAMES, ObservabilityFields
from models.settings_servers import ServerFields
from models.settings_services import ServiceFields

__all__ = [
    "ALERT_NAMES",
    "AUDIT_KEY_ID",
    "DEFAULT_API_RATE_LIMITS",
    "MAX_SECONDS",
    "MIN_AUDIT_SECRET_BYTES",
    "SCOPES",
    "SLACK_CONVERSATION_ID",
    "BadConfiguration",
    "ScopeRateLimit",
    "Settings",
    "check_imports",
    "describe",
    "load_settings",
]

#: A Slack conversation id (C…, G…, D…). Names like "#ops" are refused: the relay reconciles by reading the
#: channel's history, which takes ids only (agents.core.commands.MessageSpec applies the same rule to every message).
SLACK_CONVERSATION_ID = re.compile(r"^[CGD][A-Z0-9]{1,20}$")

#: The longest interval, timeout, lease or age in seconds a setting may name: ten years.
MAX_SECONDS = 10 * 365 * 86400.0


class BadConfiguration(KeelError, ValueError):
    """A ``KEEL_*`` setting is missing, malformed or unsafe. The message is one line naming the variable and the
    rule: ``bad configuration: KEEL_X: …``."""


# The groups are listed last to first: pydantic takes fields from the last base first, so errors list servers first.
class Settings(ObservabilityFields, AuditFields, ApiFields, ServiceFields, JobFields, ServerFields, BaseSettings):
    """Configuration read from ``KEEL_*`` environment variables (and an optional ``.env`` file)."""

    model_config = SettingsConfigDict(env_prefix="KEEL_", env_file=".env", extra="ignore")

    environment: Literal["development", "test", "production"] = Field(
        default="development",
        description=(
            "`production` refuses to start without `KEEL_DATABASE_URL` and `KEEL_BROKER_URL` (no embedded servers), "
            "without `KEEL_AUDIT_KEYS`, and as a database role that could rewrite the journal."
        ),
    )
    home: Path = Field(
        default=Path(".keel"),
        description=(
            "Where the embedded development servers keep their data, and the generated development audit key "
            "(`audit-key.json`)."
        ),
    )
    log_format: Literal["json", "console"] | None = Field(
        default=None,
        description=(
            "`json`: one JSON object per log line; `console`: readable lines. Unset: readable when stderr is a "
            "terminal, JSON otherwise (a file, a pipe, a container's log); `keel up` and `keel demo` give their "
            "processes readable lines."
        ),
    )
    max_input_bytes: int = Field(
        default=64 * 1024,
        ge=1,
        description="Largest request input accepted, as canonical JSON.",
    )

    # Field validators say the rule only: the variable's name is added from the error's location. Model
    # validators compare settings and start their message with the variable to change ("KEEL_X: …"). Values that
    # may hold a password (URLs, tokens) are never echoed. The rules of one group's fields are in its module.

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

    # --- rules across settings ---------------------------------------------------------------------------------

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

    @model_validator(mode="after")
    def _production_needs_real_servers(self) -> Settings:
        if self.environment == "production" and (self.database_url is None or self.broker_url is None):
            raise ValueError(
                "KEEL_ENVIRONMENT: production needs KEEL_DATABASE_URL and KEEL_BROKER_URL: "
                "the embedded development servers are not for production"
            )
        return self


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


def import_handler_module(name: str) -> ModuleType:
    """Import a ``KEEL_IMPORTS`` module: the one rule every process follows. A module in the current directory is
    found as ``python -m`` finds it, without ``PYTHONPATH=.``; the directory is searched after every installed
    package, so it shadows none."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)
    return importlib.import_module(name)


def check_imports(settings: Settings) -> None:
    """Import every ``KEEL_IMPORTS`` module now (a worker's start), so a missing or broken one stops the worker
    with :class:`BadConfiguration` instead of failing each job that needs its handlers."""
    for module in settings.imports:
        try:
            import_handler_module(module)
        except Exception as exc:  # whatever the module raises, the worker would die on it later
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
            raise BadConfiguration(
                f"bad configuration: KEEL_IMPORTS: module {module!r} cannot be imported ({reason})"
            ) from None
