"""A token's name prefix is served by an index; reconciled deliveries are counted, not recounted.

- ``ix_agents_name_prefix`` and ``ix_deleted_agents_name_prefix`` (``text_pattern_ops``): a list scoped to an API
  token's agent prefix (``starts_with(name, …)``: the agent list, the console's pages, the approvals inbox, the outbox
  of a tenant) reads the agents whose name starts with it, not every agent. The planner turns ``starts_with`` with a
  known prefix into a range on this index (a prepared statement keeps planning it per value: the generic plan costs
  a scan).
- ``side_effect_reconciled``: the delivery log's KPI trigger counts confirmations that the relay found already applied
  by the receiver (``how = 'reconciled'``), so ``keel outbox stats`` still counts them after retention removed their
  messages with their delivery log rows. Backfilled from the delivery log as it is. ``ix_delivery_log_reconciled``
  (0023), which counted them, is read by nothing now: dropped.

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None

# As 0009 wrote it, plus the reconciled count.
_DELIVERIES = """
CREATE OR REPLACE FUNCTION keel_kpi_deliveries() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO kpi_deltas (name, label, value)
    SELECT 'side_effect_confirmations', 'channel=' || o.channel, count(*)
        FROM confirmed n JOIN outbox o ON o.key = n.key GROUP BY o.channel
    UNION ALL
    SELECT 'side_effect_duplicates', 'channel=' || o.channel, count(*)
        FROM confirmed n JOIN outbox o ON o.key = n.key
        WHERE EXISTS (SELECT 1 FROM delivery_log d WHERE d.key = n.key AND d.id < n.id) GROUP BY o.channel{reconciled};
    RETURN NULL;
END;
$$;
"""
_RECONCILED = """
    UNION ALL
    SELECT 'side_effect_reconciled', 'channel=' || o.channel, count(*)
        FROM confirmed n JOIN outbox o ON o.key = n.key WHERE n.how = 'reconciled' GROUP BY o.channel"""


def upgrade() -> None:
    op.execute("CREATE INDEX ix_agents_name_prefix ON agents (name text_pattern_ops)")
    op.execute("CREATE INDEX ix_deleted_agents_name_prefix ON audit.deleted_agents (name text_pattern_ops)")
    op.execute(_DELIVERIES.format(reconciled=_RECONCILED))
    op.execute(
        "INSERT INTO kpi_deltas (name, label, value)"
        " SELECT 'side_effect_reconciled', 'channel=' || o.channel, count(*)"
        " FROM delivery_log d JOIN outbox o ON o.key = d.key WHERE d.how = 'reconciled' GROUP BY o.channel"
    )
    op.drop_index("ix_delivery_log_reconciled", table_name="delivery_log")


def downgrade() -> None:
    op.create_index(
        "ix_delivery_log_reconciled", "delivery_log", ["id"], postgresql_where=sa.text("how = 'reconciled'")
    )
    op.execute(_DELIVERIES.format(reconciled=""))
    op.execute("DROP INDEX audit.ix_deleted_agents_name_prefix")
    op.execute("DROP INDEX ix_agents_name_prefix")
