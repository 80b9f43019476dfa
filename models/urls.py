"""Database URLs: accept what psql accepts, pick the driver for the user."""

from __future__ import annotations

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

_POSTGRES_SCHEMES = {"postgres", "postgresql", "postgresql+psycopg"}


def sqlalchemy_url(url: str) -> str:
    """Return ``url`` with the psycopg 3 driver, refusing anything that is not PostgreSQL."""
    try:
        parsed = make_url(url.replace("postgres://", "postgresql://", 1) if url.startswith("postgres://") else url)
    except ArgumentError as exc:
        raise ValueError(f"not a database URL: {exc}") from None
    if parsed.drivername not in _POSTGRES_SCHEMES:
        raise ValueError(f"Keel needs PostgreSQL; the URL's scheme is {parsed.drivername!r}")
    return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def libpq_url(url: str) -> str:
    """The same database as a libpq conninfo URL, for psycopg and psql."""
    parsed: URL = make_url(sqlalchemy_url(url))
    return parsed.set(drivername="postgresql").render_as_string(hide_password=False)


def with_database(url: str, database: str) -> str:
    """``url`` pointing at another database on the same server."""
    return make_url(sqlalchemy_url(url)).set(database=database).render_as_string(hide_password=False)
