"""When an agent's wait for approval began: ``agents.waiting_since``, set by the transition into waiting_approval and
cleared by the one out of it; moves within the wait (an escalation, another step of the round finishing) leave it.
The console lists waiting agents by it, longest waiting first (``ix_agents_waiting_since``, now on
``coalesce(waiting_since, updated_at)``: a wait that began before this migration has no ``waiting_since`` — only a
transition writes agent rows — and is placed by its last move, as before, until it ends).

The agents guard now counts ``waiting_since`` as state: it changes only with a revision, like the phase.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

_WAITING = "phase = 'waiting_approval' AND archived_at IS NULL"

# 0005's guard (kept verbatim for the downgrade), with {state} the columns that change only with a revision.
_GUARD = """
CREATE OR REPLACE FUNCTION keel_agents_revision_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.id <> OLD.id OR NEW.name <> OLD.name OR NEW.created_at <> OLD.created_at THEN
        RAISE EXCEPTION 'agents: id, name and created_at never change';
    END IF;
    IF NEW.revision = OLD.revision THEN
        IF (NEW.phase, NEW.request_id, NEW.soft_deadline, NEW.hard_deadline, NEW.priority, NEW.spent_tokens, NEW.spent_cost, NEW.budget_tokens, NEW.budget_cost{new})
           IS DISTINCT FROM (OLD.phase, OLD.request_id, OLD.soft_deadline, OLD.hard_deadline, OLD.priority, OLD.spent_tokens, OLD.spent_cost, OLD.budget_tokens, OLD.budget_cost{old}) THEN
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
    IF NEW.archived_at IS DISTINCT FROM OLD.archived_at AND NEW.journal_seq = OLD.journal_seq THEN
        RAISE EXCEPTION 'agents: archiving agent % must be journaled', OLD.id;
    END IF;
    RETURN NEW;
END;
$$;
"""


def upgrade() -> None:
    op.add_column("agents", sa.Column("waiting_since", sa.DateTime(timezone=True), nullable=True))
    op.create_check_constraint(
        op.f("ck_agents_waiting_since_only_while_waiting"), "agents", "waiting_since IS NULL OR phase = 'waiting_approval'"
    )
    op.drop_index("ix_agents_waiting_since", table_name="agents")
    op.create_index(
        "ix_agents_waiting_since",
        "agents",
        [sa.text("coalesce(waiting_since, updated_at)"), "id"],
        unique=False,
        postgresql_where=sa.text(_WAITING),
    )
    op.execute(_GUARD.format(new=", NEW.waiting_since", old=", OLD.waiting_since"))


def downgrade() -> None:
    op.execute(_GUARD.format(new="", old=""))
    op.drop_index("ix_agents_waiting_since", table_name="agents")
    op.create_index(
        "ix_agents_waiting_since", "agents", ["updated_at", "id"], unique=False, postgresql_where=sa.text(_WAITING)
    )
    op.drop_constraint(op.f("ck_agents_waiting_since_only_while_waiting"), "agents", type_="check")
    op.drop_column("agents", "waiting_since")
