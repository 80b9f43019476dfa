"""Agents can be archived: hidden from lists, refusing new requests, their row and journal kept.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-14
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


# 0002's guard (kept verbatim for the downgrade), plus: archiving or unarchiving is journaled (the chain moves with it).
_GUARD = """
CREATE OR REPLACE FUNCTION keel_agents_revision_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.id <> OLD.id OR NEW.name <> OLD.name OR NEW.created_at <> OLD.created_at THEN
        RAISE EXCEPTION 'agents: id, name and created_at never change';
    END IF;
    IF NEW.revision = OLD.revision THEN
        IF (NEW.phase, NEW.request_id, NEW.soft_deadline, NEW.hard_deadline, NEW.priority, NEW.spent_tokens, NEW.spent_cost, NEW.budget_tokens, NEW.budget_cost)
           IS DISTINCT FROM (OLD.phase, OLD.request_id, OLD.soft_deadline, OLD.hard_deadline, OLD.priority, OLD.spent_tokens, OLD.spent_cost, OLD.budget_tokens, OLD.budget_cost) THEN
            RAISE EXCEPTION 'agents: a change of state must bump the revision (agent %, revision %)',
                OLD.id, OLD.revision;
        END IF;
    ELSIF NEW.revision <> OLD.revision + 1 THEN
        RAISE EXCEPTION 'agents: revision must go from % to %, not to %', OLD.revision, OLD.revision + 1,
            NEW.revision;
    END IF;
    IF NEW.journal_seq < OLD.journal_seq THEN
        RAISE EXCEPTION 'agents: the journal chain never moves back (% to %)', OLD.journal_seq, NEW.journal_seq;
    END IF;
    IF NEW.journal_seq <> OLD.journal_seq AND NEW.journal_seq <> OLD.journal_seq + 1 THEN
        RAISE EXCEPTION 'agents: the journal head of agent % must move to its next event', NEW.id;
    END IF;
    IF NEW.revision <> OLD.revision AND NEW.journal_seq = OLD.journal_seq THEN
        RAISE EXCEPTION 'agents: revision % of agent % has no transition event in audit.journal', NEW.revision, NEW.id;
    END IF;
    {archived}
    RETURN NEW;
END;
$$;
"""
_ARCHIVED_CHECK = """IF NEW.archived_at IS DISTINCT FROM OLD.archived_at AND NEW.journal_seq = OLD.journal_seq THEN
        RAISE EXCEPTION 'agents: archiving agent % must be journaled', OLD.id;
    END IF;"""


def upgrade() -> None:
    op.add_column("agents", sa.Column("archived_at", sa.DateTime(timezone=True), nullable=True))
    # `keel agent list`: newest first, keyset-paginated, archived agents apart.
    op.create_index("ix_agents_listing", "agents", ["created_at", "id"])
    op.execute(_GUARD.replace("{archived}", _ARCHIVED_CHECK))


def downgrade() -> None:
    op.execute(_GUARD.replace("    {archived}\n", ""))
    op.drop_index("ix_agents_listing", table_name="agents")
    op.drop_column("agents", "archived_at")
