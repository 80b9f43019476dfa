"""What a request's outcome is made of, read in one transaction so the parts agree: its latest transition, what its
steps spent, the step that answered or failed it, and its outbox messages (the choke point that reads them:
``agents.core.request_outcome``)."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from psycopg.rows import dict_row

from models.db import Database, end_read

_WHERE = "request_id = %(request_id)s AND agent_id = %(agent_id)s"
_LAST = (
    "SELECT event, actor, to_phase, revision, decision, details, at FROM audit.journal"
    # A late step's charge is journaled as a transition too; it changes no request's outcome.
    f" WHERE {_WHERE} AND kind = 'transition' AND event <> 'charge' ORDER BY seq DESC LIMIT 1"
)
# What every attempt of every step spent: the attempts that succeeded and those that failed (charged all the same).
_SPEND = (
    "SELECT coalesce(sum(tokens + failed_tokens), 0) AS tokens, coalesce(sum(cost + failed_cost), 0) AS cost,"
    f" count(*) AS steps FROM jobs WHERE {_WHERE}"
)
# And what attempts whose outcome was void (fenced off: the request was cancelled or stopped under them) spent: charged
# to the agent by a `charge` event, recorded on no job.
_VOID_SPEND = (
    "SELECT coalesce(sum((details -> 'spend' ->> 'tokens')::numeric), 0) AS tokens,"
    " coalesce(sum((details -> 'spend' ->> 'cost')::numeric), 0) AS cost FROM audit.journal"
    f" WHERE {_WHERE} AND kind = 'transition' AND event = 'charge' AND decision = 'fenced_off'"
)
# The step that finished the request: the latest to succeed (a gate only ever waits; it answers nothing).
_ANSWERED = (
    "SELECT key, CASE WHEN jsonb_typeof(result) = 'object' AND result ? 'answer' THEN result -> 'answer'"
    f" ELSE result END AS answer FROM jobs WHERE {_WHERE} AND status = 'succeeded' AND operation <> 'gate'"
    " ORDER BY finished_at DESC NULLS LAST, key DESC LIMIT 1"
)
# The step that failed it: the one its fail event names, else the latest to fail.
_FAILED = (
    f"SELECT key, error_class, last_error FROM jobs WHERE {_WHERE} AND status IN ('failed', 'dead')"
    " ORDER BY (key = %(job)s) DESC, finished_at DESC NULLS LAST, key DESC LIMIT 1"
)
# The attempts of its steps that failed, by error class (the retries that got it here, and the last failure).
_FAILED_ATTEMPTS = (
    "SELECT e.key AS error_class, sum(e.value::bigint) AS n FROM jobs, jsonb_each_text(jobs.error_attempts) AS e"
    f" WHERE {_WHERE} GROUP BY e.key ORDER BY e.key"
)
_MESSAGES = (
    "SELECT key, channel, destination, status, attempts, last_error, external_url, sent_at FROM outbox"
    f" WHERE {_WHERE} ORDER BY seq"
)
_DEAD = "SELECT count(*) AS n FROM outbox WHERE agent_id = %s AND status = 'dead'"


def request_outcome_parts(db: Database, agent_id: UUID, request_id: str) -> dict[str, Any] | None:
    """The parts of agent ``agent_id``'s request's outcome (None: the agent has no such request): ``last`` (its latest
    transition), ``spend`` (tokens, cost, and how many steps are left), ``failed_attempts`` (by error class),
    ``answered`` (the latest step to succeed, when done), ``failed`` (the failed step, when failed) and ``messages``."""
    params: dict[str, Any] = {"agent_id": agent_id, "request_id": request_id, "job": None}
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(_LAST, params)
        last = cur.fetchone()
        if last is None:
            end_read(conn)
            return None
        cur.execute(_SPEND, params)
        spend = dict(cur.fetchone() or {})
        cur.execute(_VOID_SPEND, params)
        void = cur.fetchone() or {}
        spend["tokens"] = spend.get("tokens", 0) + void.get("tokens", 0)
        spend["cost"] = spend.get("cost", 0) + void.get("cost", 0)
        answered = failed = None
        if last["to_phase"] == "done":
            cur.execute(_ANSWERED, params)
            answered = cur.fetchone()
        elif last["to_phase"] == "failed":
            cur.execute(_FAILED, {**params, "job": (last["details"] or {}).get("job")})
            failed = cur.fetchone()
        cur.execute(_FAILED_ATTEMPTS, params)
        failed_attempts = {row["error_class"]: int(row["n"]) for row in cur.fetchall()}
        cur.execute(_MESSAGES, params)
        messages = cur.fetchall()
        end_read(conn)
    return {
        "last": last,
        "spend": spend,
        "failed_attempts": failed_attempts,
        "answered": answered,
        "failed": failed,
        "messages": messages,
    }


def dead_messages(db: Database, agent_id: UUID) -> int:
    """How many of the agent's outbox messages are dead now (``ix_outbox_dead_agent``)."""
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(_DEAD, (agent_id,))
        row = cur.fetchone()
        end_read(conn)
    return int(row["n"]) if row else 0
