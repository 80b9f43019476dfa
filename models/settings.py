"""Keel's one settings object: every knob is an environment variable prefixed ``KEEL_``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
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
