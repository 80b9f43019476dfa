"""API tokens: who may do what, to which agents, over HTTP. A token has a name, one or more :class:`Scope` values and
optionally an agent-name prefix (it then sees only the agents whose name starts with it); :data:`GRANTS` says what each
scope grants, and :meth:`ApiToken.can` and :meth:`ApiToken.sees` are the two questions the ingress asks. The secret
(``keel_…``) is shown once, by :func:`create_token`; only its sha256 is stored."""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Collection, Iterable, Mapping
from datetime import datetime
from enum import StrEnum
from uuid import UUID

from pydantic import BaseModel, ConfigDict, field_validator

from agents.core.commands import MAX_ACTOR_CHARS, check_text
from agents.core.errors import InvalidInput, TokenExists, TokenNotFound, quoted
from agents.core.transition import store_errors
from models import tokens_sql
from models.db import Database
from models.schemas import MAX_NAME_CHARS, NAME_PATTERN
from models.tokens_sql import TokenRow


class Scope(StrEnum):
    """What a token is for. A token has one or more."""

    PRODUCER = "producer"
    APPROVER = "approver"
    OPERATOR = "operator"
    AUDITOR = "auditor"


class Permission(StrEnum):
    """One thing the HTTP API lets a caller do. Every endpoint needs exactly one."""

    READ_STATE = "read_state"  # an agent's state, the list of agents
    READ_EVENTS = "read_events"  # an agent's live events (Server-Sent Events)
    CREATE_AGENT = "create_agent"
    SUBMIT = "submit"
    APPROVE = "approve"
    REJECT = "reject"
    CANCEL = "cancel"
    READ_JOURNAL = "read_journal"  # an agent's journal events
    READ_STORY = "read_story"  # a request's whole story: its jobs, journal events and outbox messages
    READ_JOB = "read_job"  # one job by its key
    READ_OUTBOX = "read_outbox"  # outbox messages
    RETRY_OUTBOX = "retry_outbox"  # send a dead outbox message again
    READ_APPROVALS = "read_approvals"  # the inbox: every call waiting for approval across agents


_PRODUCER = frozenset({Permission.READ_STATE, Permission.READ_EVENTS, Permission.CREATE_AGENT, Permission.SUBMIT})
# The live events are the journal's, as they commit (a reconnect replays them from the journal): whoever may read
# an agent's journal may watch it too.
_READ_ONLY = frozenset(
    {
        Permission.READ_STATE,
        Permission.READ_EVENTS,
        Permission.READ_JOURNAL,
        Permission.READ_STORY,
        Permission.READ_JOB,
        Permission.READ_OUTBOX,
        Permission.READ_APPROVALS,
    }
)

#: What each scope grants. A token with several scopes may do what any of them grants.
GRANTS: Mapping[Scope, frozenset[Permission]] = {
    Scope.PRODUCER: _PRODUCER,
    Scope.APPROVER: frozenset(
        {
            Permission.READ_STATE,
            Permission.READ_EVENTS,
            Permission.READ_JOURNAL,
            Permission.READ_APPROVALS,
            Permission.APPROVE,
            Permission.REJECT,
        }
    ),
    Scope.OPERATOR: _PRODUCER | _READ_ONLY | {Permission.CANCEL, Permission.RETRY_OUTBOX},
    Scope.AUDITOR: _READ_ONLY,
}


def grants(scopes: Iterable[Scope]) -> frozenset[Permission]:
    """Everything a token with these scopes may do."""
    granted: frozenset[Permission] = frozenset()
    return granted.union(*(GRANTS[Scope(s)] for s in scopes))


#: What a token's agent prefix ends in, so that ``acme-`` never covers ``acmecorp-…`` (agent names hold letters,
#: digits and these three only).
PREFIX_DELIMITERS = ("-", ".", "_")


def scope_prefix(stored: str | None) -> str | None:
    """The prefix a token's reach is checked with: as stored, if it ends in a delimiter (every prefix made since the
    rule does). One stored before the rule without one (``acme``) reaches only ``acme-…``: never ``acmecorp-…``, never
    more than it was given (re-create the token for ``acme.…`` or ``acme_…`` names)."""
    if stored is None or stored.endswith(PREFIX_DELIMITERS):
        return stored
    return stored + "-"


def covers(prefix: str | None, agent_name: str) -> bool:
    """Whether a token with this (checked) prefix reaches the agent called ``agent_name``: the one prefix-match rule.
    The lists filter with ``starts_with(name, prefix)`` in SQL on the same prefix, which is this rule since the
    prefix ends in a delimiter."""
    return prefix is None or agent_name.startswith(prefix)


class ApiToken(BaseModel):
    """An API token as Keel knows it: never its secret. ``agent_prefix``: the token sees only agents whose name
    starts with it (None: every agent)."""

    model_config = ConfigDict(frozen=True)

    id: UUID
    name: str
    scopes: tuple[Scope, ...]
    agent_prefix: str | None
    created_at: datetime
    created_by: str
    #: At most a minute behind: a token's use is noted at most once a minute.
    last_used_at: datetime | None
    revoked_at: datetime | None
    revoked_by: str | None = None

    @field_validator("agent_prefix")
    @classmethod
    def _reach(cls, value: str | None) -> str | None:
        return scope_prefix(value)  # however the token was read: every scope check gets the checked prefix

    def can(self, permission: Permission) -> bool:
        """Whether this token may do ``permission`` (never, once revoked)."""
        return self.revoked_at is None and permission in grants(self.scopes)

    def sees(self, agent_name: str) -> bool:
        """Whether the agent called ``agent_name`` is within this token's reach (its name starts with the prefix).
        The ingress answers for an agent it does not see exactly as for one that does not exist."""
        return covers(self.agent_prefix, agent_name)

    @classmethod
    def of(cls, row: TokenRow) -> ApiToken:
        return cls(
            id=row.id,
            name=row.name,
            scopes=tuple(Scope(s) for s in row.scopes),
            agent_prefix=row.agent_prefix,
            created_at=row.created_at,
            created_by=row.created_by,
            last_used_at=row.last_used_at,
            revoked_at=row.revoked_at,
            revoked_by=row.revoked_by,
        )


#: Every secret starts with this, so one is recognisable (and masked) wherever it turns up.
SECRET_PREFIX = "keel_"
_SECRET_BYTES = 32
# token_urlsafe(32): 43 characters of the URL-safe base64 alphabet, unpadded.
_SECRET = re.compile(rf"{SECRET_PREFIX}[A-Za-z0-9_\-]{{43}}")
_NAME = re.compile(NAME_PATTERN)


def secret_hash(secret: str) -> str:
    """What is stored of a secret: its sha256, hex. A fast hash is right here, unlike for a password: the secret is
    32 random bytes, so there is no dictionary to try and guessing it is hopeless however fast each guess is; a slow
    hash would only make every authenticated request slower."""
    return hashlib.sha256(secret.encode()).hexdigest()


def _check_name(field: str, value: object) -> str:
    text = check_text(field, value)
    if not 1 <= len(text) <= MAX_NAME_CHARS:
        raise InvalidInput(f"{field} must be 1-{MAX_NAME_CHARS} characters, got {len(text)}")
    if _NAME.fullmatch(text) is None:
        raise InvalidInput(
            f"{field} {quoted(text)} must start with a letter or digit and hold only letters, digits, '.', '_' and '-'"
        )
    return text


def _check_prefix(value: object) -> str:
    prefix = _check_name("agent prefix", value)
    if not prefix.endswith(PREFIX_DELIMITERS):
        raise InvalidInput(
            f"agent prefix {quoted(prefix)} must end in '-', '.' or '_', so that it covers no other tenant's names"
            f" (as {prefix}corp-… would be): e.g. {quoted(prefix + '-')}"
        )
    return prefix


def _check_scopes(scopes: Iterable[Scope | str]) -> tuple[Scope, ...]:
    if isinstance(scopes, str):  # one scope given bare would otherwise be read letter by letter
        scopes = [scopes]
    known = ", ".join(Scope)
    given: set[Scope] = set()
    for scope in scopes:
        try:
            given.add(Scope(scope))
        except ValueError:
            raise InvalidInput(f"unknown scope {quoted(scope)} (scopes: {known})") from None
    if not given:
        raise InvalidInput(f"a token needs at least one scope ({known})")
    return tuple(s for s in Scope if s in given)


def create_token(
    db: Database, name: str, scopes: Iterable[Scope | str], *, agent_prefix: str | None = None, actor: str
) -> tuple[ApiToken, str]:
    """Create the token ``name`` with ``scopes`` (and, given ``agent_prefix``, limited to the agents whose name
    starts with it). Returns the token and its secret, which is not kept and cannot be shown again. Bad input raises
    :class:`InvalidInput` naming the problem, a taken name :class:`TokenExists`; nothing is written either way."""
    name = _check_name("token name", name)
    try:
        UUID(name)
    except ValueError:
        pass
    else:
        raise InvalidInput("token name must not look like a UUID: tokens are revoked by id or name")
    checked = _check_scopes(scopes)
    if agent_prefix is not None:
        agent_prefix = _check_prefix(agent_prefix)
    if isinstance(actor, str) and not actor:
        raise InvalidInput(f"actor must be 1-{MAX_ACTOR_CHARS} characters: every change names who made it")
    check_text("actor", actor, limit=MAX_ACTOR_CHARS)
    secret = SECRET_PREFIX + secrets.token_urlsafe(_SECRET_BYTES)
    with store_errors():
        row = tokens_sql.insert_token(
            db,
            name=name,
            scopes=[s.value for s in checked],
            agent_prefix=agent_prefix,
            secret_hash=secret_hash(secret),
            created_by=actor,
        )
    if row is None:
        raise TokenExists(name)
    return ApiToken.of(row), secret


def authenticate(db: Database, secret: str) -> ApiToken | None:
    """The live token whose secret this is; None for an unknown, revoked or malformed secret (no error says which,
    and a malformed one costs no query). Notes the token's use, at most once a minute.

    Safe against timing attacks without a constant-time comparison: the database looks the token up by the hash of
    what was presented, and how long that takes says something only about the hash, which does not help to guess a
    secret."""
    if not isinstance(secret, str) or _SECRET.fullmatch(secret) is None:
        return None
    with store_errors():
        row = tokens_sql.authenticate_hash(db, secret_hash(secret))
    return None if row is None else ApiToken.of(row)


def live_token_ids(db: Database, token_ids: Collection[UUID]) -> set[UUID]:
    """Which of these tokens are still live: what the open event streams of a process ask, for all their tokens at
    once (:class:`agents.ingress.streams.Streams`)."""
    with store_errors():
        return tokens_sql.live_token_ids(db, token_ids)


def live_token(db: Database, token_id: UUID) -> ApiToken | None:
    """The token with this id if it is live (not revoked): what a console session asks on every request."""
    with store_errors():
        row = tokens_sql.token_by_id(db, token_id)
    return None if row is None or row.revoked_at is not None else ApiToken.of(row)


def list_tokens(db: Database) -> list[ApiToken]:
    """Every token, revoked ones included, oldest first."""
    with store_errors():
        return [ApiToken.of(row) for row in tokens_sql.list_tokens(db)]


def revoke_token(db: Database, name_or_id: UUID | str, *, actor: str) -> ApiToken:
    """Revoke a token (by name or id) for good: from now on :func:`authenticate` refuses its secret. Revoking a
    revoked token changes nothing and returns it as it is (its first revocation kept). No such token:
    :class:`TokenNotFound`."""
    if isinstance(actor, str) and not actor:
        raise InvalidInput(f"actor must be 1-{MAX_ACTOR_CHARS} characters: every change names who made it")
    check_text("actor", actor, limit=MAX_ACTOR_CHARS)
    token_id: UUID | None
    if isinstance(name_or_id, UUID):
        token_id, name = name_or_id, None
    else:
        check_text("token", name_or_id)
        try:
            token_id, name = UUID(name_or_id), None
        except ValueError:
            token_id, name = None, name_or_id
    with store_errors():
        found = tokens_sql.revoke_token(db, token_id=token_id, name=name, actor=actor)
    if found is None:
        raise TokenNotFound(name_or_id)
    return ApiToken.of(found)
