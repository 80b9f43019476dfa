from __future__ import annotations

import pytest
from pydantic import ValidationError

from models.settings import BadConfiguration, Settings, load_settings
from models.urls import libpq_url, sqlalchemy_url


def test_plain_psql_url_gets_the_psycopg_driver() -> None:
    assert sqlalchemy_url("postgresql://root@127.0.0.1:5432/test") == "postgresql+psycopg://root@127.0.0.1:5432/test"
    assert sqlalchemy_url("postgres://u:p@h/db") == "postgresql+psycopg://u:p@h/db"
    assert libpq_url("postgresql+psycopg://u@h:1/db") == "postgresql://u@h:1/db"


def test_settings_read_keel_prefixed_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_DATABASE_URL", "postgresql://root@127.0.0.1:5432/test")
    monkeypatch.setenv("KEEL_BROKER_URL", "redis://127.0.0.1:6379/3")
    settings = Settings()
    assert settings.database_url == "postgresql+psycopg://root@127.0.0.1:5432/test"
    assert settings.broker_url == "redis://127.0.0.1:6379/3"
    assert not settings.uses_embedded


def test_nothing_set_means_embedded() -> None:
    assert Settings().uses_embedded


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"database_url": "mysql://root@localhost/db"}, "Keel needs PostgreSQL"),
        ({"broker_url": "amqp://guest@localhost//"}, "must be a redis:// URL"),
        ({"environment": "production"}, "production needs KEEL_DATABASE_URL and KEEL_BROKER_URL"),
        ({"db_pool_size": 0}, "greater than or equal to 1"),
        ({"migration_database_url": "mysql://root@localhost/db"}, "Keel needs PostgreSQL"),
        ({"db_app_role": "Keel App"}, "not a role name Keel uses"),
        ({"db_owner_role": "keel; DROP TABLE agents"}, "not a role name Keel uses"),
        ({"db_auditor_role": "keel_app"}, "must be three different roles"),
        ({"prune_interval_seconds": "inf"}, "must be a finite number of seconds"),
        ({"audit_verify_interval_seconds": 1e300}, "must be a finite number of seconds"),
        ({"job_lease_seconds": "-inf"}, "greater than 0"),
    ],
)
def test_unsafe_or_malformed_settings_are_refused(env: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Settings(**env)  # type: ignore[arg-type]


def test_an_infinite_interval_from_the_environment_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_PRUNE_INTERVAL_SECONDS", "inf")
    with pytest.raises(BadConfiguration, match="KEEL_PRUNE_INTERVAL_SECONDS: must be a finite number of seconds"):
        load_settings()


def test_roles_have_defaults_and_empty_passwords_mean_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_DB_APP_PASSWORD", "")  # compose passes an unset variable on as ""
    monkeypatch.setenv("KEEL_MIGRATION_DATABASE_URL", " ")
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    assert (settings.db_owner_role, settings.db_app_role, settings.db_auditor_role) == (
        "keel_owner",
        "keel_app",
        "keel_auditor",
    )
    assert settings.db_app_password is None and settings.db_auditor_password is None
    assert settings.migration_database_url is None
    monkeypatch.setenv("KEEL_MIGRATION_DATABASE_URL", "postgresql://postgres@db/keel")
    assert Settings(_env_file=None).migration_database_url == "postgresql+psycopg://postgres@db/keel"  # type: ignore[call-arg]
