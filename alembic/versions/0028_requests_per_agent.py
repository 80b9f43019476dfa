"""Request ids are each agent's own: one tenant can neither occupy, block nor learn of another's.

- ``requests``: the primary key is ``(agent_id, request_id)`` (was ``request_id``); ``ix_requests_request_id`` serves
  a read by id alone (``GET /v1/requests/{id}``, which keeps the agents its token sees); ``ix_requests_agent_id`` is
  dropped (the key leads with the agent).
- ``agents.request_key``: the first segment of the keys of the request in flight (``agents.core.keys.request_key``:
  the agent's id as 32 hex digits, ``~``, the request id: no request id has a ``~``, so
  these keys never meet the bare ones of requests submitted before). A request in flight at the upgrade keeps the bare id its
  jobs and messages were keyed by, so its steps go on finding each other.
- ``keel_kpi_journal()`` reads a finished request's submit time by agent and id.

The new primary key is built under the table's lock: submits wait while it builds (the table has a row per request).

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None

_GLOBAL = "(SELECT submitted_at FROM requests WHERE request_id = NEW.request_id)"
_SCOPED = "(SELECT submitted_at FROM requests WHERE agent_id = NEW.agent_id AND request_id = NEW.request_id)"


def _rewrite_kpi_trigger(old: str, new: str) -> None:
    """Swap one expression of ``keel_kpi_journal()`` as it is defined now (0009, as later migrations left it)."""
    bind = op.get_bind()
    body = bind.exec_driver_sql("SELECT pg_get_functiondef('keel_kpi_journal()'::regprocedure)").scalar_one()
    if old not in body:
        raise RuntimeError(f"keel_kpi_journal() does not read {old!r}: migration 0028 cannot rewrite it")
    bind.exec_driver_sql(body.replace(old, new).replace("%", "%%"))


def upgrade() -> None:
    op.execute("ALTER TABLE requests DROP CONSTRAINT pk_requests")
    op.execute("ALTER TABLE requests ADD CONSTRAINT pk_requests PRIMARY KEY (agent_id, request_id)")
    op.execute("DROP INDEX ix_requests_agent_id")
    op.execute("CREATE INDEX ix_requests_request_id ON requests (request_id)")
    op.execute("ALTER TABLE agents ADD COLUMN request_key text")
    op.execute("UPDATE agents SET request_key = request_id WHERE request_id IS NOT NULL")
    _rewrite_kpi_trigger(_GLOBAL, _SCOPED)


def downgrade() -> None:
    op.execute(
        """
DO $$
DECLARE shared bigint;
BEGIN
    SELECT count(*) INTO shared FROM (SELECT request_id FROM requests GROUP BY request_id HAVING count(*) > 1) s;
    IF shared > 0 THEN
        RAISE EXCEPTION 'cannot downgrade below 0028: % request ids are used by more than one agent', shared;
    END IF;
    SELECT count(*) INTO shared FROM agents
        WHERE phase IN ('planning', 'executing', 'waiting_approval') AND request_key IS DISTINCT FROM request_id;
    IF shared > 0 THEN
        RAISE EXCEPTION 'cannot downgrade below 0028: % agents have a request in flight keyed by agent', shared;
    END IF;
END;
$$;
"""
    )
    _rewrite_kpi_trigger(_SCOPED, _GLOBAL)
    op.execute("ALTER TABLE agents DROP COLUMN request_key")
    op.execute("DROP INDEX ix_requests_request_id")
    op.execute("CREATE INDEX ix_requests_agent_id ON requests (agent_id)")
    op.execute("ALTER TABLE requests DROP CONSTRAINT pk_requests")
    op.execute("ALTER TABLE requests ADD CONSTRAINT pk_requests PRIMARY KEY (request_id)")
