"""A chain found broken stays reported; the application can neither forge a pruned key nor put a chore off.

- ``audit_verified_chains.broken_seq``: a verify that finds a chain broken marks its checkpoint with the first broken
  event (sealed with the rest), so the incremental passes after it walk that chain from its start and keep failing,
  instead of starting from a checkpoint below an edit only the full pass could see. A guard refuses every UPDATE of a
  marked row (the application has no DELETE): only the owner clears a mark, by deleting the row once the chain has
  been looked at (docs/runbook.md).
- ``keel_prune_guard`` becomes SECURITY DEFINER (the owner's): the tombstone of a pruned job or message is written by
  the guard as the owner, so the application role loses INSERT on ``pruned_keys`` (models/roles.py) and can no longer
  make a key look pruned, which would silently swallow the job or message inserted under it later.
- ``beat_chores``: a guard refuses a ``last_run_at`` after the database's clock. A chore stamped in the future (the
  audit verify, the full verify) would not be due again until then.

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None

FINAL = "'succeeded', 'failed', 'cancelled', 'dead'"


def _prune_guard(definer: bool) -> str:
    # As 0021 wrote it; with ``definer``, the owner's, with names qualified for its pinned search_path.
    header = "SECURITY DEFINER SET search_path = pg_catalog, pg_temp" if definer else ""
    return f"""
CREATE OR REPLACE FUNCTION public.keel_prune_guard() RETURNS trigger LANGUAGE plpgsql {header} AS $$
BEGIN
    IF (TG_TABLE_NAME = 'jobs' AND OLD.status NOT IN ({FINAL}))
       OR (TG_TABLE_NAME = 'outbox' AND OLD.status <> 'sent') THEN
        RAISE EXCEPTION '%: % is %: only finished jobs and sent messages are pruned', TG_TABLE_NAME, OLD.key,
            OLD.status USING ERRCODE = 'insufficient_privilege';
    END IF;
    INSERT INTO public.pruned_keys (kind, key, agent_id, pruned_at) VALUES (TG_ARGV[0], OLD.key, OLD.agent_id, now())
        ON CONFLICT DO NOTHING;
    RETURN OLD;
END;
$$;
"""


GUARDS = """
CREATE FUNCTION keel_verified_chain_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit_verified_chains: agent %''s chain was found broken at event %: its checkpoint stays as it'
        ' is until the owner deletes it', OLD.agent_id, OLD.broken_seq USING ERRCODE = 'insufficient_privilege';
END;
$$;
CREATE TRIGGER audit_verified_chains_guard BEFORE UPDATE ON audit_verified_chains
    FOR EACH ROW WHEN (OLD.broken_seq IS NOT NULL) EXECUTE FUNCTION keel_verified_chain_guard();

CREATE FUNCTION keel_beat_chores_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.last_run_at > clock_timestamp() THEN
        RAISE EXCEPTION 'beat_chores: chore % may not be stamped % (after the database''s clock)', NEW.name,
            NEW.last_run_at USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER beat_chores_guard BEFORE INSERT OR UPDATE ON beat_chores
    FOR EACH ROW EXECUTE FUNCTION keel_beat_chores_guard();
"""

UNDO_GUARDS = """
DROP TRIGGER beat_chores_guard ON beat_chores;
DROP FUNCTION keel_beat_chores_guard();
DROP TRIGGER audit_verified_chains_guard ON audit_verified_chains;
DROP FUNCTION keel_verified_chain_guard();
"""


def upgrade() -> None:
    op.add_column("audit_verified_chains", sa.Column("broken_seq", sa.BigInteger(), nullable=True))
    op.execute(GUARDS)
    op.execute(_prune_guard(definer=True))


def downgrade() -> None:
    op.execute(_prune_guard(definer=False))
    op.execute(UNDO_GUARDS)
    op.drop_column("audit_verified_chains", "broken_seq")
