"""The one boundary where database driver errors become :class:`~agents.core.errors.StoreError`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import sqlalchemy.exc

from agents.core.errors import StoreError


@contextmanager
def store_errors() -> Iterator[None]:
    """The one boundary where driver errors become :class:`StoreError`."""
    try:
        yield
    except psycopg.Error as exc:
        raise StoreError(f"database error: {_message(exc)}") from exc
    except sqlalchemy.exc.DBAPIError as exc:
        raise StoreError(f"database error: {_message(exc.orig)}") from exc
    except sqlalchemy.exc.TimeoutError as exc:  # no pooled connection came free in time: as good as unreachable
        raise StoreError(f"database error: {exc}") from exc


#: A table, column or function the code needs is not in the database: its schema is missing or not this code's.
_SCHEMA_STATES = {"42P01", "42703", "42883"}


def _message(exc: BaseException | None) -> str:
    diag = getattr(exc, "diag", None)
    primary = getattr(diag, "message_primary", None)
    message = str(primary or exc).strip()
    if getattr(exc, "sqlstate", None) in _SCHEMA_STATES:
        message += " (the database schema is missing or not this version's: run 'keel db upgrade')"
    return message
