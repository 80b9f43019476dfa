"""Agents can be deleted, through Keel only: journaled, with a tombstone that keeps the head of their chain.

Deleting an agent removes its row (its name is free again) and its schedules. Its journal, requests, jobs and outbox
messages stay, so the foreign keys from those tables to ``agents`` become a trigger that checks the agent exists when
a row is written (nothing new can refer to a deleted agent; a deleted agent's chain gets no event after its delete).

``audit.deleted_agents`` holds one tombstone per deleted agent, written in the deletion's transaction: the agent as
it was (name, phase, revision, request) and the head of its chain (seq and hash of its ``operator``/``delete``
event), so `keel audit verify` still notices events cut off the end. It is insert-only, like the journal. The
database accepts a deletion only with its tombstone, and a tombstone only for an archived agent at rest, with no live
jobs, whose last event is its delete event — and only together with the deletion.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-15
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

#: The tables whose rows outlive their agent; their foreign key to agents becomes the trigger below.
_KEPT = (("audit", "journal"), (None, "requests"), (None, "jobs"), (None, "outbox"))

# What the foreign keys did when a row is written: the agent must exist, and it cannot be deleted meanwhile.
_AGENT_EXISTS = """
CREATE FUNCTION keel_agent_exists() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM agents WHERE id = NEW.agent_id FOR KEY SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION '%: agent % does not exist (or was deleted)', TG_TABLE_NAME, NEW.agent_id
            USING ERRCODE = 'foreign_key_violation';
    END IF;
    RETURN NEW;
END;
$$;
"""

# A tombstone records the agent exactly as it is, only for an archived agent at rest without live jobs, whose last
# journal event is its delete event by the same actor at the same time.
_TOMBSTONE_CHECK = """
CREATE FUNCTION audit.keel_tombstone_check() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    a agents%ROWTYPE;
BEGIN
    SELECT * INTO a FROM agents WHERE id = NEW.agent_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'deleted_agents: agent % does not exist', NEW.agent_id;
    END IF;
    IF a.archived_at IS NULL OR a.phase NOT IN ('idle', 'done', 'failed') THEN
        RAISE EXCEPTION 'deleted_agents: agent % is not archived and at rest: it cannot be deleted', a.id;
    END IF;
    IF EXISTS (SELECT 1 FROM jobs WHERE agent_id = a.id AND status IN ('pending', 'enqueued', 'running')) THEN
        RAISE EXCEPTION 'deleted_agents: agent % has live jobs: it cannot be deleted', a.id;
    END IF;
    IF (NEW.name, NEW.created_at, NEW.phase, NEW.revision, NEW.request_id, NEW.journal_seq, NEW.journal_head)
       IS DISTINCT FROM (a.name, a.created_at, a.phase, a.revision, a.request_id, a.journal_seq, a.journal_head) THEN
        RAISE EXCEPTION 'deleted_agents: the tombstone of agent % must record the agent as it is', a.id;
    END IF;
    IF NOT EXISTS (
        SELECT 1 FROM audit.journal j WHERE j.agent_id = a.id AND j.seq = a.journal_seq AND j.hash = a.journal_head
           AND j.kind = 'operator' AND j.event = 'delete' AND j.actor = NEW.deleted_by AND j.at = NEW.deleted_at) THEN
        RAISE EXCEPTION 'deleted_agents: the last journal event of agent % must be its delete event', a.id;
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER deleted_agents_checked BEFORE INSERT ON audit.deleted_agents
    FOR EACH ROW EXECUTE FUNCTION audit.keel_tombstone_check();
"""

# A tombstone comes with the deletion, in the same transaction: checked at commit.
_TOMBSTONE_WITH_DELETION = """
CREATE FUNCTION audit.keel_tombstone_with_deletion() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM agents WHERE id = NEW.agent_id) THEN
        RAISE EXCEPTION 'deleted_agents: agent % has a tombstone but was not deleted', NEW.agent_id;
    END IF;
    RETURN NULL;
END;
$$;
CREATE CONSTRAINT TRIGGER deleted_agents_with_deletion AFTER INSERT ON audit.deleted_agents
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION audit.keel_tombstone_with_deletion();
"""

# Tombstones are insert-only, as the journal is (keel_refuse_change is 0003's).
_TOMBSTONES_APPEND_ONLY = """
CREATE TRIGGER deleted_agents_no_update_delete BEFORE UPDATE OR DELETE ON audit.deleted_agents
    FOR EACH ROW EXECUTE FUNCTION keel_refuse_change();
CREATE TRIGGER deleted_agents_no_truncate BEFORE TRUNCATE ON audit.deleted_agents
    FOR EACH STATEMENT EXECUTE FUNCTION keel_refuse_change();
"""

# An agent row goes only with its tombstone (which holds its head), never by TRUNCATE.
_AGENTS_DELETE_GUARD = """
CREATE FUNCTION keel_agents_delete_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_LEVEL = 'STATEMENT' THEN
        RAISE EXCEPTION 'agents: TRUNCATE refused: agents are deleted one by one, with keel agent delete'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM audit.deleted_agents d WHERE d.agent_id = OLD.id
                   AND d.journal_seq = OLD.journal_seq AND d.journal_head = OLD.journal_head) THEN
        RAISE EXCEPTION 'agents: agent % can be deleted only with keel agent delete (journaled, with its tombstone)',
            OLD.id USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN OLD;
END;
$$;
CREATE TRIGGER agents_delete_guard BEFORE DELETE ON agents
    FOR EACH ROW EXECUTE FUNCTION keel_agents_delete_guard();
CREATE TRIGGER agents_no_truncate BEFORE TRUNCATE ON agents
    FOR EACH STATEMENT EXECUTE FUNCTION keel_agents_delete_guard();
"""

_REFUSE_DOWNGRADE = """
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM audit.deleted_agents) THEN
        RAISE EXCEPTION 'cannot downgrade below 0006: % agents were deleted and 0005 cannot hold their journal, requests, jobs and outbox messages (its foreign keys need the agents)',
            (SELECT count(*) FROM audit.deleted_agents);
    END IF;
END;
$$;
"""


def _fk(table: str) -> str:
    return op.f(f"fk_{table}_agent_id_agents")


def upgrade() -> None:
    op.create_table(
        "deleted_agents",
        sa.Column("agent_id", sa.UUID(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted_by", sa.Text(), nullable=False),
        sa.Column("phase", sa.Text(), nullable=False),
        sa.Column("revision", sa.BigInteger(), nullable=False),
        sa.Column("request_id", sa.Text(), nullable=True),
        sa.Column("journal_seq", sa.BigInteger(), nullable=False),
        sa.Column("journal_head", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("agent_id", name=op.f("pk_deleted_agents")),
        schema="audit",
    )
    op.create_index(op.f("ix_deleted_agents_name"), "deleted_agents", ["name"], unique=False, schema="audit")
    op.execute(_AGENT_EXISTS)
    for schema, table in _KEPT:
        op.drop_constraint(_fk(table), table, schema=schema, type_="foreignkey")
        qualified = f"{schema}.{table}" if schema else table
        op.execute(
            f"CREATE TRIGGER {table}_agent_exists BEFORE INSERT OR UPDATE OF agent_id ON {qualified}"
            " FOR EACH ROW EXECUTE FUNCTION keel_agent_exists()"
        )
    op.execute(_TOMBSTONE_CHECK)
    op.execute(_TOMBSTONE_WITH_DELETION)
    op.execute(_TOMBSTONES_APPEND_ONLY)
    op.execute(_AGENTS_DELETE_GUARD)


def downgrade() -> None:
    op.execute(_REFUSE_DOWNGRADE)
    op.execute("DROP TRIGGER agents_no_truncate ON agents")
    op.execute("DROP TRIGGER agents_delete_guard ON agents")
    op.execute("DROP FUNCTION keel_agents_delete_guard()")
    for schema, table in _KEPT:
        qualified = f"{schema}.{table}" if schema else table
        op.execute(f"DROP TRIGGER {table}_agent_exists ON {qualified}")
        op.create_foreign_key(_fk(table), table, "agents", ["agent_id"], ["id"], source_schema=schema)
    op.execute("DROP FUNCTION keel_agent_exists()")
    op.drop_index(op.f("ix_deleted_agents_name"), table_name="deleted_agents", schema="audit")
    op.drop_table("deleted_agents", schema="audit")  # its triggers go with it
    op.execute("DROP FUNCTION audit.keel_tombstone_check()")
    op.execute("DROP FUNCTION audit.keel_tombstone_with_deletion()")
