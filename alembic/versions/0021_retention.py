"""Retention: finished jobs, delivered outbox messages (with their confirmations) and old requests' inputs may be
pruned (``keel db prune``, the leading beat's ``prune`` chore; models/retention_sql.py), without giving up a key.

- ``pruned_keys``: one small row per job or message key pruned (kind, key, agent), written by a trigger on the
  DELETE itself, so no prune can forget it. A BEFORE INSERT trigger on ``jobs`` and ``outbox`` skips a row whose
  key is there: the insert's ``ON CONFLICT DO NOTHING`` answer, so a late duplicate (a redelivered or replayed job, a
  re-emitted message) counts as a suppressed duplicate and never runs or goes out again. The trigger first waits for
  a prune of that very key still in flight (a ``FOR KEY SHARE`` on its row), then looks with a fresh snapshot.
- Only finished work can be deleted: a trigger refuses the DELETE of a job that is not final, of a message that is
  not sent (dead letters stay for an operator's retry).
- ``delivery_log``: its foreign key cascades (the cascade runs as the table's owner: the application role gets no
  DELETE on it), and its guard lets a confirmation go only with its message; UPDATE and TRUNCATE stay refused.
- ``requests``: ``pruned_at`` and ``input_sha256``. Its guard allows one UPDATE only, setting ``pruned_at``: the
  trigger then replaces the input with JSON ``null`` and keeps its digest (a repeated submit is compared with it),
  and changes nothing else — a request id stays its agent's forever.
- Indexes for the prune's batches, oldest first: ``ix_jobs_finished``, ``ix_outbox_sent``,
  ``ix_requests_unpruned`` (each partial: what may still be pruned).

Built without CONCURRENTLY: the upgrade blocks writes to jobs, outbox and requests while the three indexes build.
Downgrading drops the tombstones: keys pruned before it could then be inserted again.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

FINAL = "'succeeded', 'failed', 'cancelled', 'dead'"

GUARDS = f"""
CREATE FUNCTION keel_pruned_key_skip() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- A prune of this very key in flight holds its row: wait for it to end, then look for its tombstone.
    IF TG_TABLE_NAME = 'jobs' THEN
        PERFORM 1 FROM jobs WHERE key = NEW.key FOR KEY SHARE;
    ELSE
        PERFORM 1 FROM outbox WHERE key = NEW.key FOR KEY SHARE;
    END IF;
    IF EXISTS (SELECT 1 FROM pruned_keys WHERE kind = TG_ARGV[0] AND key = NEW.key) THEN
        RETURN NULL;
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER jobs_pruned_key_skip BEFORE INSERT ON jobs
    FOR EACH ROW EXECUTE FUNCTION keel_pruned_key_skip('job');
CREATE TRIGGER outbox_pruned_key_skip BEFORE INSERT ON outbox
    FOR EACH ROW EXECUTE FUNCTION keel_pruned_key_skip('message');

CREATE FUNCTION keel_prune_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (TG_TABLE_NAME = 'jobs' AND OLD.status NOT IN ({FINAL}))
       OR (TG_TABLE_NAME = 'outbox' AND OLD.status <> 'sent') THEN
        RAISE EXCEPTION '%: % is %: only finished jobs and sent messages are pruned', TG_TABLE_NAME, OLD.key,
            OLD.status USING ERRCODE = 'insufficient_privilege';
    END IF;
    INSERT INTO pruned_keys (kind, key, agent_id, pruned_at) VALUES (TG_ARGV[0], OLD.key, OLD.agent_id, now())
        ON CONFLICT DO NOTHING;
    RETURN OLD;
END;
$$;
CREATE TRIGGER jobs_prune_guard BEFORE DELETE ON jobs FOR EACH ROW EXECUTE FUNCTION keel_prune_guard('job');
CREATE TRIGGER outbox_prune_guard BEFORE DELETE ON outbox FOR EACH ROW EXECUTE FUNCTION keel_prune_guard('message');

CREATE FUNCTION keel_delivery_log_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- The foreign key's cascade, as its message is pruned: the message is gone already.
    IF TG_OP = 'DELETE' AND NOT EXISTS (SELECT 1 FROM outbox WHERE key = OLD.key) THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'delivery_log is append-only: % refused (a confirmation goes only with its pruned message)',
        TG_OP USING ERRCODE = 'insufficient_privilege';
END;
$$;
DROP TRIGGER delivery_log_no_update_delete ON delivery_log;
CREATE TRIGGER delivery_log_guard BEFORE UPDATE OR DELETE ON delivery_log
    FOR EACH ROW EXECUTE FUNCTION keel_delivery_log_guard();

CREATE FUNCTION keel_requests_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.pruned_at IS NULL AND NEW.pruned_at IS NOT NULL AND NEW.request_id = OLD.request_id
       AND NEW.agent_id = OLD.agent_id AND NEW.actor = OLD.actor AND NEW.submitted_at = OLD.submitted_at
       AND NEW.traceparent IS NOT DISTINCT FROM OLD.traceparent THEN
        NEW.input_sha256 := encode(sha256(convert_to(OLD.input::text, 'UTF8')), 'hex');
        NEW.input := 'null'::jsonb;
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'requests: % may only be pruned (its input replaced by its digest), once', OLD.request_id
        USING ERRCODE = 'insufficient_privilege';
END;
$$;
CREATE TRIGGER requests_guard BEFORE UPDATE ON requests FOR EACH ROW EXECUTE FUNCTION keel_requests_guard();
"""

UNDO_GUARDS = """
DROP TRIGGER requests_guard ON requests;
DROP FUNCTION keel_requests_guard();
DROP TRIGGER delivery_log_guard ON delivery_log;
DROP FUNCTION keel_delivery_log_guard();
CREATE TRIGGER delivery_log_no_update_delete BEFORE UPDATE OR DELETE ON delivery_log
    FOR EACH ROW EXECUTE FUNCTION keel_refuse_change();
DROP TRIGGER outbox_prune_guard ON outbox;
DROP TRIGGER jobs_prune_guard ON jobs;
DROP FUNCTION keel_prune_guard();
DROP TRIGGER outbox_pruned_key_skip ON outbox;
DROP TRIGGER jobs_pruned_key_skip ON jobs;
DROP FUNCTION keel_pruned_key_skip();
"""


def upgrade() -> None:
    op.create_table(
        "pruned_keys",
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("agent_id", sa.UUID(), nullable=True),
        sa.Column("pruned_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("kind IN ('job', 'message')", name=op.f("ck_pruned_keys_kind")),
        sa.PrimaryKeyConstraint("kind", "key", name=op.f("pk_pruned_keys")),
    )
    op.add_column("requests", sa.Column("input_sha256", sa.Text(), nullable=True))
    op.add_column("requests", sa.Column("pruned_at", sa.DateTime(timezone=True), nullable=True))
    op.create_check_constraint(
        op.f("ck_requests_pruned_keeps_digest"), "requests", "pruned_at IS NULL OR input_sha256 IS NOT NULL"
    )
    op.drop_constraint("fk_delivery_log_key_outbox", "delivery_log", type_="foreignkey")
    op.create_foreign_key(
        op.f("fk_delivery_log_key_outbox"), "delivery_log", "outbox", ["key"], ["key"], ondelete="CASCADE"
    )
    op.create_index(
        "ix_jobs_finished", "jobs", ["finished_at"], postgresql_where=sa.text(f"status IN ({FINAL})")
    )
    op.create_index("ix_outbox_sent", "outbox", ["sent_at"], postgresql_where=sa.text("status = 'sent'"))
    op.create_index(
        "ix_requests_unpruned", "requests", ["submitted_at"], postgresql_where=sa.text("pruned_at IS NULL")
    )
    op.execute(GUARDS)


def downgrade() -> None:
    op.execute(UNDO_GUARDS)
    op.drop_index("ix_requests_unpruned", table_name="requests", postgresql_where=sa.text("pruned_at IS NULL"))
    op.drop_index("ix_outbox_sent", table_name="outbox", postgresql_where=sa.text("status = 'sent'"))
    op.drop_index("ix_jobs_finished", table_name="jobs", postgresql_where=sa.text(f"status IN ({FINAL})"))
    op.drop_constraint("fk_delivery_log_key_outbox", "delivery_log", type_="foreignkey")
    op.create_foreign_key(op.f("fk_delivery_log_key_outbox"), "delivery_log", "outbox", ["key"], ["key"])
    op.drop_constraint(op.f("ck_requests_pruned_keeps_digest"), "requests", type_="check")
    op.drop_column("requests", "pruned_at")
    op.drop_column("requests", "input_sha256")
    op.drop_table("pruned_keys")
