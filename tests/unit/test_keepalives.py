"""Which URLs get TCP keepalive options: every TCP one, never a Unix socket (the embedded server's)."""

from __future__ import annotations

import pytest

from models.keepalives import Keepalives, over_unix_socket


@pytest.mark.parametrize(
    ("url", "socket"),
    [
        ("postgresql://keel@db.internal:5432/keel", False),
        ("postgresql+psycopg://keel@127.0.0.1/keel", False),
        ("postgresql://keel@/keel?host=/home/keel/.keel/pg", True),
        ("postgresql://keel@/keel?host=db.internal", False),
        ("postgresql://keel@/keel?host=@abstract", True),
        ("postgresql://keel@/keel", True),
    ],
)
def test_tcp_or_unix_socket(url: str, socket: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGHOST", raising=False)
    assert over_unix_socket(url) is socket


def test_a_url_without_a_host_follows_pghost(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGHOST", "db.internal")
    assert not over_unix_socket("postgresql://keel@/keel")
    monkeypatch.setenv("PGHOST", "/run/postgresql")
    assert over_unix_socket("postgresql://keel@/keel")


def test_the_options_name_libpqs_parameters() -> None:
    assert Keepalives().options("postgresql://keel@db.internal/keel") == {
        "keepalives": 1,
        "keepalives_idle": 30,
        "keepalives_interval": 10,
        "keepalives_count": 3,
        "tcp_user_timeout": 30_000,
    }
    assert Keepalives().options("postgresql://keel@/keel?host=/run/postgresql") == {}


@pytest.mark.parametrize(
    ("name", "value"),
    [("KEEL_IMPORTS", "not-json"), ("KEEL_STATEMENT_TIMEOUT_MS", "soon"), ("KEEL_AUDIT_SETTLE_SECONDS", "-1")],
)
def test_another_settings_error_leaves_the_default_keepalives(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wrong setting is reported by the command that reads it, in its own words: a connection opened before that
    (a migration's) gets the default keepalives, not a traceback from here."""
    from models.keepalives import tcp_options

    monkeypatch.setenv(name, value)
    assert tcp_options("postgresql://keel@db.internal/keel") == Keepalives().options(
        "postgresql://keel@db.internal/keel"
    )


@pytest.mark.parametrize(
    ("name", "value"), [("KEEL_DB_KEEPALIVES_IDLE_SECONDS", "-1"), ("KEEL_DB_TCP_USER_TIMEOUT_MS", "soon")]
)
def test_a_wrong_keepalive_setting_is_said_not_replaced_by_the_defaults(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pydantic import ValidationError

    from models.keepalives import tcp_options

    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError, match=name.removeprefix("KEEL_").lower()):
        tcp_options("postgresql://keel@db.internal/keel")
