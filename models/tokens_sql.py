"""API token SQL: create a token, find one by its secret's hash (noting its use), list and revoke them. Every time here
is the database's (``now()``), never a host's; the secret's hash is written once and never read back."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from psycopg.rows import class_row, dict_row

from models.db import Database, end_read

TOKEN_COLUMNS = "id, name, scopes, agent_prefix, created_at, created_by, last_used_at, revoked_at, revoked_by"


@dataclass(frozen=True, slots=True)
class TokenRow:
    """One ``api_tokens`` row without its secret's hash, mapped by column name (:data:`TOKEN_COLUMNS`)."""

    id: UUID
    name: str
    scopes: list[str]
    agent_prefix: str | None
    created_at: datetime
    created_by: str
    last_used_at: datetime | None
    revoked_at: datetime | None
    revoked_by: str | None


_INSERT = (
    "INSERT INTO api_tokens (name, scopes, agent_prefix, secret_hash, created_by)"
    " VALUES (%(name)s, %(scopes)s, %(agent_prefix)s, %(secret_hash)s, %(created_by)s)"
    f" ON CONFLICT (name) DO NOTHING RETURNING {TOKEN_COLUMNS}"
)

# One statement: find a live token by its hash and note its use, but only when the last noted use is over a minute
# old, so a busy token does not write its row on every request. Two requests racing past the minute both try the
# UPDATE; the second one waits for the first, sees the row's new last_used_at and writes nothing.
_AUTHENTICATE = (
    f"WITH found AS (SELECT {TOKEN_COLUMNS} FROM api_tokens WHERE secret_hash = %(secret_hash)s"
    " AND revoked_at IS NULL),"
    " used AS (UPDATE api_tokens SET last_used_at = now() WHERE id = (SELECT id FROM found)"
    " AND (last_used_at IS NULL OR last_used_at < now() - interval '1 minute') RETURNING last_used_at)"
    " SELECT id, name, scopes, agent_prefix, created_at, created_by,"
    " COALESCE((SELECT last_used_at FROM used), found.last_used_at) AS last_used_at, revoked_at, revoked_by"
    " FROM found"
)

_LIVE_IDS = "SELECT id FROM api_tokens WHERE id = ANY(%(ids)s) AND revoked_at IS NULL"

_LIST = f"SELECT {TOKEN_COLUMNS} FROM api_tokens ORDER BY created_at, name"

_WHICH = "(id = %(id)s OR name = %(name)s)"
_REVOKE = (
    "UPDATE api_tokens SET revoked_at = now(), revoked_by = %(actor)s"
    f" WHERE {_WHICH} AND revoked_at IS NULL RETURNING {TOKEN_COLUMNS}"
)
_FIND = f"SELECT {TOKEN_COLUMNS} FROM api_tokens WHERE {_WHICH}"
_BY_ID = f"SELECT {TOKEN_COLUMNS} FROM api_tokens WHERE id = %(id)s"


def insert_token(
    db: Database, *, name: str, scopes: Sequence[str], agent_prefix: str | None, secret_hash: str, created_by: str
) -> TokenRow | None:
    """Insert a token; None (and nothing written) when a token, live or revoked, has ``name`` already."""
    params = {
        "name": name,
        "scopes": list(scopes),
        "agent_prefix": agent_prefix,
        "secret_hash": secret_hash,
        "created_by": created_by,
    }
    with db.autocommit() as plain, plain.connection.cursor(row_factory=class_row(TokenRow)) as cur:
        cur.execute(_INSERT, params)
        return cur.fetchone()


def authenticate_hash(db: Database, secret_hash: str) -> TokenRow | None:
    """The live (not revoked) token whose secret has this hash, its use noted (at most once a minute); else None."""
    with db.autocommit() as plain, plain.connection.cursor(row_factory=class_row(TokenRow)) as cur:
        cur.execute(_AUTHENTICATE, {"secret_hash": secret_hash})
        return cur.fetchone()


def live_token_ids(db: Database, ids: Collection[UUID]) -> set[UUID]:
    """Which of these tokens exist and are not revoked: one primary-key lookup each, in one statement."""
    with db.autocommit() as plain, plain.connection.cursor(row_factory=dict_row) as cur:
        cur.execute(_LIVE_IDS, {"ids": list(ids)})
        return {row["id"] for row in cur.fetchall()}


def token_by_id(db: Database, token_id: UUID) -> TokenRow | None:
    """The token with this id, revoked or not (its use is not noted); None when there is none."""
    with db.autocommit() as plain, plain.connection.cursor(row_factory=class_row(TokenRow)) as cur:
        cur.execute(_BY_ID, {"id": token_id})
        return cur.fetchone()


def list_tokens(db: Database) -> list[TokenRow]:
    """Every token, revoked ones included, oldest first."""
    with db.connection() as conn, conn.cursor(row_factory=class_row(TokenRow)) as cur:
        cur.execute(_LIST)
        rows = cur.fetchall()
        end_read(conn)
    return rows


def revoke_token(db: Database, *, token_id: UUID | None, name: str | None, actor: str) -> TokenRow | None:
    """Revoke the token with this id (or name), by ``actor``, now, and return it; a token revoked already is
    returned as it is, its first revocation kept. None when no token has that id or name."""
    params = {"id": token_id, "name": name, "actor": actor}
    with db.transaction() as plain, plain.connection.cursor(row_factory=class_row(TokenRow)) as cur:
        cur.execute(_REVOKE, params)
        revoked = cur.fetchone()
        if revoked is not None:
            return revoked
        cur.execute(_FIND, params)
        return cur.fetchone()
