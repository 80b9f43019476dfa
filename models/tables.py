"""The schema, as SQLAlchemy Core tables. Alembic migrations must match it (``alembic check``)."""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    ForeignKey,
    Identity,
    Index,
    MetaData,
    Numeric,
    Table,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID

AUDIT_SCHEMA = "audit"

# Kept literally here because models/ may not import agents/; a unit test holds it equal to agents.phases.Phase.
PHASES: tuple[str, ...] = ("idle", "planning", "executing", "waiting_approval", "done", "failed")
JOURNAL_KINDS: tuple[str, ...] = ("created", "transition", "rejected", "suppressed")

#: sha256 of nothing yet: the ``prev_hash`` of an agent's first journal event.
GENESIS_HASH = "0" * 64

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


Money = Numeric(18, 6)

agents = Table(
    "agents",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True, server_default=text("gen_random_uuid()")),
    Column("name", Text, nullable=False, unique=True),
    Column("phase", Text, nullable=False, server_default="idle"),
    Column("request_id", Text),
    Column("revision", BigInteger, nullable=False, server_default="0"),
    Column("soft_deadline", DateTime(timezone=True)),
    Column("hard_deadline", DateTime(timezone=True)),
    # NULL budget = unlimited.
    Column("budget_tokens", BigInteger),
    Column("budget_cost", Money),
    Column("spent_tokens", BigInteger, nullable=False, server_default="0"),
    Column("spent_cost", Money, nullable=False, server_default="0"),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    # The agent's journal chain: number and hash of its latest event.
    Column("journal_seq", BigInteger, nullable=False, server_default="0"),
    Column("journal_head", Text, nullable=False, server_default=GENESIS_HASH),
    CheckConstraint(_in("phase", PHASES), name="phase"),
    CheckConstraint("revision >= 0", name="revision_non_negative"),
    CheckConstraint("char_length(name) BETWEEN 1 AND 200", name="name_length"),
    CheckConstraint("budget_tokens IS NULL OR budget_tokens >= 0", name="budget_tokens_non_negative"),
    CheckConstraint("budget_cost IS NULL OR budget_cost >= 0", name="budget_cost_non_negative"),
    CheckConstraint("spent_tokens >= 0", name="spent_tokens_non_negative"),
    CheckConstraint("spent_cost >= 0", name="spent_cost_non_negative"),
    CheckConstraint(
        "soft_deadline IS NULL OR hard_deadline IS NULL OR soft_deadline <= hard_deadline",
        name="soft_before_hard",
    ),
)

# One row per request ever submitted: a request id belongs to one agent, forever.
requests = Table(
    "requests",
    metadata,
    Column("request_id", Text, primary_key=True),
    Column("agent_id", UUID(as_uuid=True), ForeignKey("agents.id"), nullable=False, index=True),
    Column("input", JSONB, nullable=False),
    Column("actor", Text, nullable=False),
    Column("submitted_at", DateTime(timezone=True), nullable=False),
)

journal = Table(
    "journal",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("agent_id", UUID(as_uuid=True), ForeignKey("agents.id"), nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("kind", Text, nullable=False),
    Column("event", Text, nullable=False),
    Column("actor", Text, nullable=False),
    Column("request_id", Text),
    Column("from_phase", Text),
    Column("to_phase", Text),
    Column("revision", BigInteger, nullable=False),
    Column("decision", Text, nullable=False),
    # json, not jsonb: the stored text is exactly the text that was hashed.
    Column("details", JSON, nullable=False),
    Column("at", DateTime(timezone=True), nullable=False),
    Column("prev_hash", Text, nullable=False),
    Column("hash", Text, nullable=False),
    UniqueConstraint("agent_id", "seq"),
    CheckConstraint(_in("kind", JOURNAL_KINDS), name="kind"),
    CheckConstraint("seq >= 1", name="seq_positive"),
    Index(None, "request_id"),
    schema=AUDIT_SCHEMA,
)
