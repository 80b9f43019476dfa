"""The settings of the servers Keel stands on: where PostgreSQL and Redis are, the database roles, and how
connections to them are pooled and kept alive. A part of :class:`models.settings.Settings`."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, field_validator

from models.urls import sqlalchemy_url

#: What a broker prefix may hold: no spaces, and none of Redis's glob characters (``*?[]\\``), so that
#: ``SCAN MATCH <prefix>*`` finds exactly one deployment's keys.
_BROKER_PREFIX = re.compile(r"^[A-Za-z0-9_.:/-]{0,100}$")
#: A database role name Keel creates and names in SQL: lower case, so that it reads the same quoted or not.
_ROLE_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class ServerFields(BaseModel):
    """``KEEL_DATABASE_*``, ``KEEL_DB_*``, ``KEEL_BROKER_*`` and ``KEEL_STATEMENT_TIMEOUT_MS``."""

    database_url: str | None = Field(
        default=None,
        description=(
            "PostgreSQL URL; a plain `postgresql://user@host:port/db` works, the driver is chosen for you. In "
            "production: the application role's credentials (`keel_app`). Unset: the embedded development server "
            "under `KEEL_HOME`."
        ),
    )
    broker_url: str | None = Field(
        default=None,
        description="Redis URL for Celery (`redis://…`). Unset: the embedded development server under `KEEL_HOME`.",
    )
    migration_database_url: str | None = Field(
        default=None,
        description=(
            "What `keel db upgrade`, `keel db downgrade` and `keel db roles` (and `--migrate`) connect with: a "
            "superuser, or for migrations a member of the owner role. Unset: `KEEL_DATABASE_URL` "
            "(`KEEL_DATABASE_DIRECT_URL` with `KEEL_DATABASE_POOLER=transaction`)."
        ),
    )
    # The database roles: models/roles.py.
    db_owner_role: str = Field(
        default="keel_owner",
        description=(
            "The database role that owns Keel's schema (no login; migrations act as it). Lower-case letters, digits "
            "and `_`; roles are the PostgreSQL cluster's, so give each deployment sharing a cluster names of its own."
        ),
    )
    db_app_role: str = Field(
        default="keel_app",
        description=(
            "The database role Keel's processes log in as (on the journal: SELECT and INSERT, no more); not the "
            "owner's or the auditor's name."
        ),
    )
    db_auditor_role: str = Field(
        default="keel_auditor",
        description="The read-only auditor's database role; not the owner's or the application's name.",
    )
    db_app_password: SecretStr | None = Field(
        default=None,
        description=(
            "The password `keel db roles` gives the application role (and sets again when changed). Unset: the role "
            "gets none (set one with `ALTER ROLE … PASSWORD`, or log in another way, e.g. a client certificate)."
        ),
    )
    db_auditor_password: SecretStr | None = Field(
        default=None,
        description=(
            "The password `keel db roles` gives the auditor role (and sets again when changed). Unset: the role gets "
            "none."
        ),
    )
    # kombu's ``global_keyprefix``.
    broker_prefix: str = Field(
        default="",
        description=(
            "Put before every Redis key and pub/sub channel Keel's Celery uses (queues, bindings, unacked messages, "
            "revoke and other broadcasts, events), e.g. `keel-staging:`, so that deployments sharing one Redis "
            "database never see each other's messages; letters, digits and `. _ : / -`. Give every worker, beat, "
            "Flower and producer of one deployment the same value."
        ),
    )
    # Above kombu's 1 s BRPOP wait, which a consumer's read spans.
    broker_socket_timeout_seconds: float = Field(
        default=10.0,
        ge=2.0,
        le=300,
        description=(
            "How long a connection to Redis waits to connect or for an answer before it is given up on and retried (a"
            " Redis that accepts connections but never answers otherwise hangs a worker's publish for ever). The beat"
            " waits a tenth of `KEEL_BEAT_LEASE_SECONDS` (0.2 s to 1 s) per attempt, so a hung Redis neither costs it"
            " its leadership nor stops its passes."
        ),
    )

    database_pooler: Literal["none", "transaction"] = Field(
        default="none",
        description=(
            "`transaction`: `KEEL_DATABASE_URL` goes through a pooler in transaction mode (PgBouncer `pool_mode = "
            "transaction`): no prepared statements, no startup options, and what needs a session of its own on "
            "`KEEL_DATABASE_DIRECT_URL`."
        ),
    )
    database_direct_url: str | None = Field(
        default=None,
        description=(
            "PostgreSQL itself, not the pooler: the API's live events (LISTEN) and the audit shipper's and the demo's"
            " session locks connect here; required with `KEEL_DATABASE_POOLER=transaction`. Unset: "
            "`KEEL_DATABASE_URL`."
        ),
    )
    db_pool_size: int = Field(
        default=10,
        ge=1,
        le=200,
        description=(
            "Database connections an API process keeps (and any process without a setting of its own below); a burst "
            "may open as many again."
        ),
    )
    db_pool_size_worker: int = Field(
        default=20,
        ge=2,
        le=200,
        description=(
            "Database connections per worker process (each prefork child): at most this many (no burst above it), "
            "however many jobs run in it; one is its lease keeper's own."
        ),
    )
    db_pool_size_beat: int = Field(
        default=4,
        ge=1,
        le=200,
        description=(
            "Database connections per beat, besides its one lease connection: its dispatch, its pass threads and its "
            "chores share them."
        ),
    )
    db_pool_size_cli: int = Field(
        default=2,
        ge=1,
        le=200,
        description="Database connections per `keel` command.",
    )
    statement_timeout_ms: int = Field(
        default=30_000,
        ge=0,
        description=(
            "Server-side statement timeout, sent at connect; behind a transaction pooler set it on the role instead. "
            "Workers, beat and the API check at start that the server has it."
        ),
    )
    # TCP keepalives (models/keepalives.py): a server that vanished without a word (a partition, a host powered
    # off) is given up on in about a minute, not after the kernel's two hours.
    db_keepalives_idle_seconds: int = Field(
        default=30,
        ge=0,
        le=86_400,
        description=(
            "TCP keepalives on every connection to PostgreSQL over TCP (not a Unix socket's, and not the beat's lease"
            " connection, which has fixed tighter ones): the first probe after this much silence; `0`: the OS default"
            " (2 h on Linux)."
        ),
    )
    db_keepalives_interval_seconds: int = Field(
        default=10,
        ge=0,
        le=3_600,
        description="Seconds between TCP keepalive probes; `0`: the OS default.",
    )
    db_keepalives_count: int = Field(
        default=3,
        ge=0,
        le=100,
        description=(
            "Unanswered keepalive probes before the connection is given up (a server that vanished without a word: "
            "after about 60 s, not 2 h); `0`: the OS default."
        ),
    )
    db_tcp_user_timeout_ms: int = Field(
        default=30_000,
        ge=0,
        le=3_600_000,
        description=(
            "libpq's `tcp_user_timeout`: a write the server does not acknowledge for this long fails the connection; "
            "`0`: the OS default."
        ),
    )

    @property
    def uses_embedded(self) -> bool:
        return self.database_url is None or self.broker_url is None

    @field_validator("db_owner_role", "db_app_role", "db_auditor_role")
    @classmethod
    def _role_name_is_plain(cls, value: str) -> str:
        if not _ROLE_NAME.fullmatch(value):
            raise ValueError(
                f"{value[:70]!r} is not a role name Keel uses: lower-case letters, digits and _ (at most 63,"
                " not starting with a digit), e.g. keel_app"
            )
        return value

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

    @field_validator("broker_prefix")
    @classmethod
    def _broker_prefix_is_plain(cls, value: str) -> str:
        if not _BROKER_PREFIX.fullmatch(value):
            raise ValueError("may hold only letters, digits and . _ : / - (at most 100 characters), e.g. keel-staging:")
        return value
