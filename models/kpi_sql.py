"""The KPIs, computed from the tables (for `keel demo` and `keel kpi`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from uuid import UUID

from psycopg.rows import dict_row

from models.db import Database

#: The demo's agents are named with this prefix, so that `keel kpi` can leave them out of a user's figures.
DEMO_PREFIX = "demo-"

# Every figure can be narrowed to some agents (%(ids)s; NULL: all of them), leaving out those whose name starts
# with %(skip)s (NULL: none). Deleted agents' work counts too: their jobs, events and deliveries are kept.
_KPIS = """
WITH all_agents AS (SELECT id, name FROM agents UNION ALL SELECT agent_id, name FROM audit.deleted_agents),
     mine_agents AS (SELECT id FROM all_agents WHERE (%(ids)s::uuid[] IS NULL OR id = ANY(%(ids)s::uuid[]))
                     AND (%(skip)s::text IS NULL OR NOT starts_with(name, %(skip)s::text))),
     mine_jobs AS (SELECT * FROM jobs WHERE agent_id IN (SELECT id FROM mine_agents)),
     mine_events AS (SELECT * FROM audit.journal WHERE agent_id IN (SELECT id FROM mine_agents)),
     mine_log AS (SELECT d.* FROM delivery_log d JOIN outbox o ON o.key = d.key
                  WHERE o.agent_id IN (SELECT id FROM mine_agents))
SELECT
  (SELECT count(*) FROM mine_events WHERE kind = 'suppressed')
  + (SELECT coalesce(sum(json_array_length(details->'jobs_suppressed')), 0) FROM mine_events
     WHERE details->'jobs_suppressed' IS NOT NULL)
  + (SELECT coalesce(sum(json_array_length(details->'messages_suppressed')), 0) FROM mine_events
     WHERE details->'messages_suppressed' IS NOT NULL)                                   AS suppressed_duplicates,
  (SELECT count(*) FROM (SELECT key FROM mine_log GROUP BY key HAVING count(*) > 1) d)   AS keys_confirmed_twice,
  (SELECT count(*) FROM mine_log)                                                        AS deliveries,
  (SELECT coalesce(sum(attempts), 0) FROM mine_jobs WHERE operation = 'plan')           AS model_calls,
  (SELECT coalesce(sum(attempts), 0) FROM mine_jobs WHERE operation = 'tool')           AS tool_calls,
  (SELECT percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - run_at))
     FROM mine_jobs WHERE status = 'succeeded')                                         AS p95_step_seconds,
  (SELECT count(*) FILTER (WHERE status = 'succeeded')::float / nullif(count(*), 0) FROM mine_jobs
     WHERE error_attempts <> '{}'::jsonb)                                               AS recovery_rate,
  (SELECT count(*) FROM mine_jobs WHERE error_attempts <> '{}'::jsonb)                  AS jobs_that_failed_once,
  (SELECT coalesce(sum(failed_tokens), 0)::bigint FROM mine_jobs)                       AS retry_tokens,
  (SELECT coalesce(sum(failed_cost), 0) FROM mine_jobs)                                 AS retry_cost,
  (SELECT count(*) FILTER (WHERE phase = 'failed')::float / nullif(count(*), 0) FROM agents
     WHERE request_id IS NOT NULL AND id IN (SELECT id FROM mine_agents))               AS failure_rate
"""


def kpis(db: Database, agent_ids: Sequence[UUID] | None = None, *, skip_prefix: str | None = None) -> dict[str, Any]:
    """The KPIs over all agents, or over ``agent_ids`` only; without agents named ``skip_prefix``…"""
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(_KPIS, {"ids": None if agent_ids is None else list(agent_ids), "skip": skip_prefix})
        row = cur.fetchone() or {}
        conn.rollback()
    return dict(row)


def request_outcomes(db: Database) -> list[dict[str, Any]]:
    """Each agent's current request: how it ended and why (the last transition's policy decision)."""
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(
            "SELECT a.name, a.request_id, a.phase, a.spent_tokens, a.spent_cost,"
            " (SELECT j.decision FROM audit.journal j WHERE j.agent_id = a.id AND j.kind = 'transition'"
            "  ORDER BY j.seq DESC LIMIT 1) AS why"
            " FROM agents a WHERE a.request_id IS NOT NULL ORDER BY a.name"
        )
        rows = cur.fetchall()
        conn.rollback()
    return rows
