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
    # How long a connection to Redis waits to connect or for an answer before it is given up on (and retried): a
    # broker that accepts connections but never answers (hung, paused, a lost route) must not hang a worker's publish
    # or the beat for ever. Above kombu's 1 s BRPOP wait, which a consumer's read spans.
    broker_socket_timeout_seconds: float = Field(default=10.0, ge=2.0, le=300)

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
    # Each worker process (a prefork child): at most this many connections, however many jobs it runs (one of them
    # its lease keeper's own).
    db_pool_size_worker: int = Field(default=20, ge=2, le=200)
    # The beat's, besides its lease connection: dispatch, its 3 passes, verify, ship and prune threads.
    db_pool_size_beat: int = Field(default=4, ge=1, le=200)
    db_pool_size_cli: int = Field(default=2, ge=1, le=200)
    statement_timeout_ms: int = Field(default=30_000, ge=0)
    # TCP keepalives and the TCP user timeout on every connection to PostgreSQL over TCP (models/keepalives.py): a
    # server that vanished without a word (a partition, a host powered off) is given up on in about a minute, not
    # after the kernel's two hours. 0: the operating system's default.
    db_keepalives_idle_seconds: int = Field(default=30, ge=0, le=86_400)
    db_keepalives_interval_seconds: int = Field(default=10, ge=0, le=3_600)
    db_keepalives_count: int = Field(default=3, ge=0, le=100)
    db_tcp_user_timeout_ms: int = Field(default=30_000, ge=0, le=3_600_000)

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
