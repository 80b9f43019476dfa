"""Request ids are each agent's own: one tenant can neither occupy, block nor learn of another's.

- ``requests``: the primary key is ``(agent_id, request_id)`` (was ``request_id``); ``ix_requests_request_id`` serves
  a read by id alone (``GET /v1/requests/{id}``, which keeps the agents its token sees); ``ix_requests_agent_id`` is
  dropped (the key leads with the agent).
- ``agents.request_key``: the first segment of the keys of the request in flight (``agents.core.keys.request_key``:
  the agent's id as 32 hex digits, ``~``, the request id: no request id has a ``~``, so
  these keys never meet the bare ones of requests submitted before). A request in flight at the upgrade keeps the bare id its
  jobs and messages were keyed by, so its steps go on finding each other.
- ``keel_kpi_journal()`` reads a finished request's submit time by agent and id; the agents' revision guard refuses a
  change of ``request_key`` that does not bump the revision, as of the request id.

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


def _rewrite(function: str, *swaps: tuple[str, str]) -> None:
    """Swap expressions of ``function`` as it is defined now (by earlier migrations) and define it again."""
    bind = op.get_bind()
    body = bind.exec_driver_sql(f"SELECT pg_get_functiondef('{function}'::regprocedure)").scalar_one()
    for old, new in swaps:
        if old not in body:
            raise RuntimeError(f"{function} does not read {old!r}: migration 0028 cannot rewrite it")
        body = body.replace(old, new)
    bind.exec_driver_sql(body.replace("%", "%%"))


# The request's key changes only with a revision, like the request id (0014's guard, whose list ends at waiting_since).
_GUARDED = (("NEW.waiting_since)", "NEW.waiting_since, NEW.request_key)"), ("OLD.waiting_since)", "OLD.waiting_since, OLD.request_key)"))


def upgrade() -> None:
    op.execute("ALTER TABLE requests DROP CONSTRAINT pk_requests")
    op.execute("ALTER TABLE requests ADD CONSTRAINT pk_requests PRIMARY KEY (agent_id, request_id)")
    op.execute("DROP INDEX ix_requests_agent_id")
    op.execute("CREATE INDEX ix_requests_request_id ON requests (request_id)")
    op.execute("ALTER TABLE agents ADD COLUMN request_key text")
    op.execute("UPDATE agents SET request_key = request_id WHERE request_id IS NOT NULL")
    _rewrite("keel_kpi_journal()", (_GLOBAL, _SCOPED))
    _rewrite("keel_agents_revision_guard()", *_GUARDED)


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
    _rewrite("keel_kpi_journal()", (_SCOPED, _GLOBAL))
    _rewrite("keel_agents_revision_guard()", *((new, old) for old, new in _GUARDED))
    op.execute("ALTER TABLE agents DROP COLUMN request_key")
    op.execute("DROP INDEX ix_requests_request_id")
    op.execute("CREATE INDEX ix_requests_agent_id ON requests (agent_id)")
    op.execute("ALTER TABLE requests DROP CONSTRAINT pk_requests")
    op.execute("ALTER TABLE requests ADD CONSTRAINT pk_requests PRIMARY KEY (request_id)")
