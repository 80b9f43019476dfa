"""A keyed journal: every new event's link is an HMAC under an audit key kept outside the database.

``audit.journal.key_id`` names the key an event's ``hash`` is an HMAC-SHA256 under (agents/core/journal/chain.py); NULL
marks a legacy event, written before this migration, whose ``hash`` stays the plain sha256 it was written with (the
journal is immutable: nothing is re-hashed).

``audit.legacy_chains`` records, for every chain that has events now, its length and head, sealed with an HMAC under
the current audit key. Only those events may be unkeyed: an unkeyed event anywhere else — a chain re-forged with plain
sha256 after the upgrade — is a break, and so is a legacy part that no longer ends at its sealed head. Sealing needs
the key, so upgrading a database whose journal has events needs ``KEEL_AUDIT_KEYS`` (or, outside production, the
development key under ``KEEL_HOME``). The table is written here only; triggers refuse every change after.

Downgrading is refused once an event was linked with a key: Keel before this migration would call every keyed
event tampered, and the journal is append-only, so they cannot go.

Revision ID: 0015
Revises: 0014
Create Date: 2027-01-10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op
from models.audit_keys import AuditKeys, audit_keys_for, legacy_seal_parts
from models.migrations import DowngradeRefused
from models.settings import load_settings

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

_FROZEN = """
CREATE FUNCTION audit.keel_legacy_chains_frozen() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'audit.legacy_chains is written once, by migration 0015: % refused', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END;
$$;
CREATE TRIGGER legacy_chains_frozen BEFORE INSERT OR UPDATE OR DELETE ON audit.legacy_chains
    FOR EACH ROW EXECUTE FUNCTION audit.keel_legacy_chains_frozen();
CREATE TRIGGER legacy_chains_no_truncate BEFORE TRUNCATE ON audit.legacy_chains
    FOR EACH STATEMENT EXECUTE FUNCTION audit.keel_legacy_chains_frozen();
"""

# Every chain's head, a live agent's or a deleted one's tombstone's, taken while no one can move one.
_HEADS = """
SELECT id AS agent_id, journal_seq AS seq, journal_head AS head FROM agents WHERE journal_seq > 0
UNION ALL SELECT agent_id, journal_seq, journal_head FROM audit.deleted_agents WHERE journal_seq > 0
ORDER BY agent_id
"""


def _keys() -> AuditKeys:
    given = context.config.attributes.get("audit_keys")
    return given if isinstance(given, AuditKeys) else audit_keys_for(load_settings())


def upgrade() -> None:
    op.add_column("journal", sa.Column("key_id", sa.Text(), nullable=True), schema="audit")
    legacy = op.create_table(
        "legacy_chains",
        sa.Column("agent_id", sa.UUID(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("head", sa.Text(), nullable=False),
        sa.Column("key_id", sa.Text(), nullable=False),
        sa.Column("seal", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("agent_id", name=op.f("pk_legacy_chains")),
        schema="audit",
    )
    bind = op.get_bind()
    bind.execute(sa.text("LOCK TABLE agents, audit.deleted_agents IN SHARE MODE"))
    heads = bind.execute(sa.text(_HEADS)).mappings().all()
    if heads:
        keys = _keys()
        op.bulk_insert(
            legacy,
            [
                {
                    "agent_id": h["agent_id"],
                    "seq": h["seq"],
                    "head": h["head"],
                    "key_id": keys.current,
                    "seal": keys.mac(keys.current, legacy_seal_parts(str(h["agent_id"]), h["seq"], h["head"])),
                }
                for h in heads
            ],
        )
    op.execute(_FROZEN)


def downgrade() -> None:
    keyed = op.get_bind().execute(sa.text("SELECT count(*) FROM audit.journal WHERE key_id IS NOT NULL")).scalar_one()
    if keyed:
        raise DowngradeRefused(
            f"cannot downgrade below 0015: the journal holds {keyed} events linked with an audit key, which Keel"
            " before 0015 cannot check (its keel audit verify would report each one as tampered) and which cannot be"
            " removed (the journal is append-only); stay on 0015 or later"
        )
    op.execute("DROP TABLE audit.legacy_chains")
    op.execute("DROP FUNCTION audit.keel_legacy_chains_frozen()")
    op.drop_column("journal", "key_id", schema="audit")
