"""Sealed audit records: every row of ``audit_verifications`` (what the ``audit_verify`` alert reads) and of
``audit_shipments`` (what the shipper resumes from) carries an HMAC under the audit key ring (``key_id``, ``seal``),
as ``audit.legacy_chains`` does. The application role may still INSERT rows, but without the key it cannot make one
whose seal holds, and readers take a row whose seal fails for a forgery (models/audit_records.py).

``audit_verifications.seal`` is unique, so a genuine row cannot be inserted again under a new id (a copy of an old
"ok" in front of a later failure). ``audit_shipments``'s key becomes (destination, last_id, manifest_sha256): a forged
row claiming a segment before it is shipped cannot stand in the place of the genuine one.

Rows written before this migration are sealed by it with the current key (as 0015 sealed the legacy chains: it
vouches for what the tables hold at the upgrade), so upgrading a database that has any needs ``KEEL_AUDIT_KEYS``
(outside production, the development key under ``KEEL_HOME``). Downgrading drops the seals; of several shipment rows
for one (destination, last_id) — possible only from 0019 on — it keeps the first written (they are notes: the store
is the authority).

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op
from models.audit_keys import AuditKeys, audit_keys_for
from models.audit_records import shipment_seal_parts, verification_seal_parts
from models.settings import load_settings

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def _keys() -> AuditKeys:
    given = context.config.attributes.get("audit_keys")
    return given if isinstance(given, AuditKeys) else audit_keys_for(load_settings())


def upgrade() -> None:
    for table in ("audit_verifications", "audit_shipments"):
        op.add_column(table, sa.Column("key_id", sa.Text(), nullable=True))
        op.add_column(table, sa.Column("seal", sa.Text(), nullable=True))
    bind = op.get_bind()
    bind.execute(sa.text("LOCK TABLE audit_verifications, audit_shipments IN SHARE ROW EXCLUSIVE MODE"))
    verifications = (
        bind.execute(sa.text("SELECT id, at, source, ok, agents, events, breaks, details FROM audit_verifications"))
        .mappings()
        .all()
    )
    shipments = (
        bind.execute(
            sa.text("SELECT destination, first_id, last_id, events, segment, manifest_sha256 FROM audit_shipments")
        )
        .mappings()
        .all()
    )
    if verifications or shipments:
        keys = _keys()
        for v in verifications:
            parts = verification_seal_parts(
                at=v["at"],
                source=v["source"],
                ok=v["ok"],
                agents=v["agents"],
                events=v["events"],
                breaks=v["breaks"],
                details=v["details"],
            )
            bind.execute(
                sa.text("UPDATE audit_verifications SET key_id = :key_id, seal = :seal WHERE id = :id"),
                {"key_id": keys.current, "seal": keys.mac(keys.current, parts), "id": v["id"]},
            )
        for s in shipments:
            parts = shipment_seal_parts(**s)
            bind.execute(
                sa.text(
                    "UPDATE audit_shipments SET key_id = :key_id, seal = :seal"
                    " WHERE destination = :destination AND last_id = :last_id"
                ),
                {
                    "key_id": keys.current,
                    "seal": keys.mac(keys.current, parts),
                    "destination": s["destination"],
                    "last_id": s["last_id"],
                },
            )
    for table in ("audit_verifications", "audit_shipments"):
        op.alter_column(table, "key_id", nullable=False)
        op.alter_column(table, "seal", nullable=False)
    op.create_unique_constraint(op.f("uq_audit_verifications_seal"), "audit_verifications", ["seal"])
    op.drop_constraint("pk_audit_shipments", "audit_shipments", type_="primary")
    op.create_primary_key(
        op.f("pk_audit_shipments"), "audit_shipments", ["destination", "last_id", "manifest_sha256"]
    )


def downgrade() -> None:
    op.execute(
        "DELETE FROM audit_shipments a USING audit_shipments b WHERE a.destination = b.destination"
        " AND a.last_id = b.last_id AND (a.shipped_at, a.manifest_sha256) > (b.shipped_at, b.manifest_sha256)"
    )
    op.drop_constraint("pk_audit_shipments", "audit_shipments", type_="primary")
    op.create_primary_key(op.f("pk_audit_shipments"), "audit_shipments", ["destination", "last_id"])
    op.drop_constraint(op.f("uq_audit_verifications_seal"), "audit_verifications", type_="unique")
    for table in ("audit_verifications", "audit_shipments"):
        op.drop_column(table, "seal")
        op.drop_column(table, "key_id")
