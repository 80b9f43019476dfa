"""The history `make bench-scale` measures against: agents that each finished one request of ten steps, written with
COPY and generate_series instead of Keel's per-row code, yet exactly as Keel would have left them (what each agent
holds, and which guards the seed bypasses:
docs/explanation/runtime-outbox-and-workers.md#the-benchmarks-seeded-history).
"""

from __future__ import annotations

import io
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import psycopg
from psycopg.rows import dict_row

from agents.core import journal
from agents.core.keys import step_message_key
from models.audit_keys import AuditKeys
from models.db import Database
from models.tables import GENESIS_HASH

#: Bumped whenever what a seed writes changes: a database seeded by another version is seeded again.
SEED_VERSION = 2
#: The bench's own audit key: its journals are linked with it (only bench databases ever hold such events).
BENCH_KEY_ID = "bench-scale-1"
BENCH_KEYS = AuditKeys.of({BENCH_KEY_ID: "keel-bench-scale-audit-key-for-bench-databases-only"}, BENCH_KEY_ID)
JOBS_PER_AGENT = 10
EVENTS_PER_AGENT = 2 + JOBS_PER_AGENT
ROUNDS = JOBS_PER_AGENT // 2
#: The round whose tool posted to Slack: its outcome's transition emitted the agent's one outbox message.
POSTING_ROUND = 3
DESTINATIONS = 100  # Slack channels the messages went to
STEP = timedelta(milliseconds=1)  # between one agent's events
PLAN_TOKENS = 300
PLAN_COST = "0.000300"
ACTOR = "bench"
WORKER = "worker:bench-seed"
COPY_CHUNK = 5_000  # agents per COPY write


@dataclass(frozen=True, slots=True)
class Sizes:
    """What a seed of ``agents`` agents holds."""

    agents: int

    @property
    def jobs(self) -> int:
        return self.agents * JOBS_PER_AGENT

    @property
    def outbox(self) -> int:
        return self.agents

    @property
    def events(self) -> int:
        return self.agents * EVENTS_PER_AGENT

    def marker(self) -> str:
        """The database comment a finished seed leaves: what it holds, under which seed version and key."""
        return (
            f"keel bench-scale seed v{SEED_VERSION}: agents={self.agents} jobs={self.jobs} outbox={self.outbox}"
            f" delivery_log={self.outbox} journal={self.events} key={BENCH_KEY_ID}"
        )


def agent_id(k: int) -> UUID:
    # Deterministic, so a check (or a person) can find agent k again; version-4 bits, as gen_random_uuid() gives.
    return UUID(int=(0x5CA1E << 108) | k, version=4)


def request_id(k: int) -> str:
    return f"req-{k:07d}"


def job_key(k: int, n: int) -> str:
    """Job ``n`` (1..10) of agent ``k``'s request: odd ones plan round (n+1)/2, even ones run its tool."""
    round_ = (n + 1) // 2
    if n % 2:
        return f"{request_id(k)}:plan:{round_}"
    return f"{request_id(k)}:tool:{_tool(round_)}:{round_}.call_{round_}"


def _tool(round_: int) -> str:
    return "slack_post" if round_ == POSTING_ROUND else "lookup"


def message_key(k: int) -> str:
    """The message the posting round's tool step emits, keyed from that step's key as the runtime keys it."""
    return step_message_key(job_key(k, 2 * POSTING_ROUND), "slack", "post")


def destination(k: int) -> str:
    return f"C{k % DESTINATIONS:06d}"


# The same names, in SQL (for generate_series): held equal to the functions above by check().
_SQL_REQUEST = "'req-' || lpad(k::text, 7, '0')"
_SQL_ROUND = "((n + 1) / 2)"
_SQL_TOOL = f"CASE WHEN {_SQL_ROUND} = {POSTING_ROUND} THEN 'slack_post' ELSE 'lookup' END"


def _copy_text(value: Any) -> str:
    if value is None:
        return "\\N"
    text = value.isoformat() if isinstance(value, datetime) else str(value)
    if "\\" in text or "\t" in text or "\n" in text:
        text = text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")
    return text


def _line(values: tuple[Any, ...]) -> str:
    return "\t".join(_copy_text(v) for v in values) + "\n"


def _history(k: int, t0: datetime, first_id: int) -> tuple[list[tuple[Any, ...]], str]:
    """Agent ``k``'s journal rows (with ids from ``first_id``) and the hash of its last event."""
    rid = request_id(k)
    aid = agent_id(k)
    rows: list[tuple[Any, ...]] = []
    prev = GENESIS_HASH

    def append(seq: int, kind: str, event: str, req: str | None, src: str, dst: str, rev: int, det: Any) -> None:
        nonlocal prev
        at = t0 + (seq - 1) * STEP
        details = journal.canonical_json(det)
        fields = {
            "agent_id": aid, "seq": seq, "kind": kind, "event": event, "actor": ACTOR if seq <= 2 else WORKER,
            "request_id": req, "from_phase": src, "to_phase": dst, "revision": rev, "decision": "accepted",
            "details_json": details, "at": at,
        }  # fmt: skip
        digest = journal.event_mac(BENCH_KEYS, BENCH_KEY_ID, prev_hash=prev, **fields)
        rows.append(
            (first_id + seq - 1, aid, seq, kind, event, fields["actor"], req, src, dst, rev, "accepted", details, at,
             prev, digest, BENCH_KEY_ID)
        )  # fmt: skip
        prev = digest

    append(1, "created", "create", None, "idle", "idle", 0, {"budget_cost": None, "budget_tokens": None})
    none = {"hard_deadline": None, "soft_deadline": None}
    append(2, "transition", "submit", rid, "idle", "planning", 1, {"as_given": none, **none, "jobs": [job_key(k, 1)]})
    for n in range(1, JOBS_PER_AGENT + 1):
        plan = n % 2 == 1
        details: dict[str, Any] = {"attempt": 1, "job": job_key(k, n), "job_status": "succeeded"}
        if plan:
            details["spend"] = {"tokens": PLAN_TOKENS, "cost": PLAN_COST}
            event, src, dst = "plan", "planning", "executing"
        elif n < JOBS_PER_AGENT:
            event, src, dst = "observe", "executing", "planning"
        else:
            event, src, dst = "finish", "executing", "done"
        if n < JOBS_PER_AGENT:
            details["jobs"] = [job_key(k, n + 1)]
        if not plan and (n + 1) // 2 == POSTING_ROUND:
            details["messages"] = [message_key(k)]
        append(n + 2, "transition", event, rid, src, dst, n + 1, details)
    return rows, prev


_AGENT_COLUMNS = (
    "id, name, phase, request_id, revision, spent_tokens, spent_cost, created_at, updated_at, journal_seq, journal_head"
)
_REQUEST_COLUMNS = "request_id, agent_id, input, actor, submitted_at"
_JOURNAL_COLUMNS = (
    "id, agent_id, seq, kind, event, actor, request_id, from_phase, to_phase, revision, decision, details, at,"
    " prev_hash, hash, key_id"
)


def _chunks(sizes: Sizes, base: datetime, progress: Any) -> Iterator[tuple[str, str, str]]:
    agents, requests, events = io.StringIO(), io.StringIO(), io.StringIO()
    spent_cost = f"{float(PLAN_COST) * ROUNDS:.6f}"
    for k in range(sizes.agents):
        t0 = base + k * EVENTS_PER_AGENT * STEP
        rows, head = _history(k, t0, k * EVENTS_PER_AGENT + 1)
        last = t0 + (EVENTS_PER_AGENT - 1) * STEP
        agents.write(
            _line((agent_id(k), f"scale-{k:07d}", "done", request_id(k), JOBS_PER_AGENT + 1, PLAN_TOKENS * ROUNDS,
                   spent_cost, t0, last, EVENTS_PER_AGENT, head))
        )  # fmt: skip
        requests.write(_line((request_id(k), agent_id(k), f'{{"text": "look up item {k} and tell #ops"}}', ACTOR,
                              t0 + STEP)))  # fmt: skip
        events.write("".join(_line(r) for r in rows))
        if (k + 1) % COPY_CHUNK == 0 or k + 1 == sizes.agents:
            yield agents.getvalue(), requests.getvalue(), events.getvalue()
            progress(k + 1)
            agents, requests, events = io.StringIO(), io.StringIO(), io.StringIO()


# Job n of agent k was scheduled by event n+1 (at t0 + n ms) and recorded by event n+2 (t0 + (n+1) ms).
_JOBS = f"""
INSERT INTO jobs (key, agent_id, request_id, operation, target, payload, status, queue, priority, run_at, attempts,
                  fencing_token, lease_until, worker, result, tokens, cost, created_at, updated_at, enqueued_at,
                  started_at, finished_at)
SELECT {_SQL_REQUEST} || CASE WHEN n %% 2 = 1 THEN ':plan:' || {_SQL_ROUND}
                              ELSE ':tool:' || {_SQL_TOOL} || ':' || {_SQL_ROUND} || '.call_' || {_SQL_ROUND} END,
       a.id, a.request_id,
       CASE WHEN n %% 2 = 1 THEN 'plan' ELSE 'tool' END,
       CASE WHEN n %% 2 = 1 THEN {_SQL_ROUND}::text
            ELSE {_SQL_TOOL} || ':' || {_SQL_ROUND} || '.call_' || {_SQL_ROUND} END,
       CASE WHEN n %% 2 = 1 THEN '{{}}'::jsonb
            ELSE jsonb_build_object('name', {_SQL_TOOL}, 'round', {_SQL_ROUND}, 'call_id', 'call_' || {_SQL_ROUND},
                                    'arguments', jsonb_build_object('query', 'item ' || k)) END,
       'succeeded', 'keel.jobs', 5, t.scheduled, 1, k::bigint * {JOBS_PER_AGENT} + n,
       t.scheduled + interval '5 minutes', '{WORKER.removeprefix("worker:")}',
       CASE WHEN n %% 2 = 1 THEN jsonb_build_object('reply', jsonb_build_object('role', 'assistant', 'content', NULL,
                 'tool_calls', jsonb_build_array(jsonb_build_object('id', 'call_' || {_SQL_ROUND}, 'type', 'function',
                 'function', jsonb_build_object('name', {_SQL_TOOL}, 'arguments', '{{"query": "item ' || k || '"}}')))))
            ELSE jsonb_build_object('content', 'found item ' || k || ' in round ' || {_SQL_ROUND}) END,
       CASE WHEN n %% 2 = 1 THEN {PLAN_TOKENS} ELSE 0 END,
       CASE WHEN n %% 2 = 1 THEN {PLAN_COST} ELSE 0 END,
       t.scheduled, t.recorded, t.scheduled, t.scheduled + interval '200 microseconds', t.recorded
FROM (SELECT substr(name, 7)::bigint AS k, * FROM agents
      WHERE name >= 'scale-' || lpad(%(lo)s::text, 7, '0') AND name < 'scale-' || lpad(%(hi)s::text, 7, '0')) a
CROSS JOIN generate_series(1, {JOBS_PER_AGENT}) n
CROSS JOIN LATERAL (SELECT a.created_at + n * interval '1 millisecond' AS scheduled,
                           a.created_at + (n + 1) * interval '1 millisecond' AS recorded) t
"""

# The message was emitted by the event recording the posting round's tool, sent and confirmed half a ms later.
_OUTBOX = f"""
INSERT INTO outbox (key, seq, agent_id, request_id, channel, destination, payload, status, attempts, next_attempt_at,
                    claim_token, external_id, created_at, updated_at, sent_at)
OVERRIDING SYSTEM VALUE
SELECT a.request_id || ':slack:tool.slack_post:{POSTING_ROUND}.call_{POSTING_ROUND}@post', k + 1, a.id,
       a.request_id, 'slack',
       'C' || lpad((k %% {DESTINATIONS})::text, 6, '0'), jsonb_build_object('text', 'item ' || k || ' is in stock'),
       'sent', 1, t.emitted, 1, '1700000000.' || lpad(k::text, 6, '0'), t.emitted, t.sent, t.sent
FROM (SELECT substr(name, 7)::bigint AS k, * FROM agents
      WHERE name >= 'scale-' || lpad(%(lo)s::text, 7, '0') AND name < 'scale-' || lpad(%(hi)s::text, 7, '0')) a
CROSS JOIN LATERAL (SELECT a.created_at + {2 * POSTING_ROUND + 1} * interval '1 millisecond' AS emitted,
                           a.created_at + {2 * POSTING_ROUND + 1} * interval '1 millisecond'
                           + interval '500 microseconds' AS sent) t
"""

_DELIVERIES = """
INSERT INTO delivery_log (id, key, external_id, attempt, how, confirmed_at) OVERRIDING SYSTEM VALUE
SELECT seq, key, external_id, 1, 'sent', sent_at FROM outbox WHERE seq BETWEEN %(lo)s + 1 AND %(hi)s
"""

_KPI_TOTALS = f"""
INSERT INTO kpi_rollups (name, label, bucket, value) VALUES
    ('jobs_finished', 'operation=plan,status=succeeded', '-infinity', %(plans)s),
    ('jobs_finished', 'operation=tool,status=succeeded', '-infinity', %(tools)s),
    ('side_effect_confirmations', 'channel=slack', '-infinity', %(messages)s),
    ('spent_tokens', '', '-infinity', %(tokens)s),
    ('spent_cost', '', '-infinity', %(plans)s * {PLAN_COST})
"""


def seed(conn: psycopg.Connection[Any], sizes: Sizes, progress: Any = lambda done: None) -> None:
    """Write ``sizes``' history into the migrated, empty database ``conn`` is on (a superuser's connection), in one
    transaction."""
    with conn.cursor() as cur:
        cur.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        row = cur.fetchone()
        if row is None or not row[0]:
            raise SystemExit("bench-scale seeds as a superuser (it switches the journal's guards off): connect as one")
        cur.execute("SELECT count(*) FROM agents")
        existing = cur.fetchone()
        if existing is None or existing[0]:
            raise SystemExit("bench-scale seeds an empty database only")
        cur.execute("SET session_replication_role = replica")
        cur.execute("SELECT clock_timestamp() AS now")
        now = cur.fetchone()[0]  # type: ignore[index]
        base = now - timedelta(minutes=1) - sizes.events * STEP
        for agents_text, requests_text, events_text in _chunks(sizes, base, progress):
            for table, columns, text in (
                ("agents", _AGENT_COLUMNS, agents_text),
                ("requests", _REQUEST_COLUMNS, requests_text),
                ("audit.journal", _JOURNAL_COLUMNS, events_text),
            ):
                with cur.copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
                    copy.write(text)
        cur.execute("ANALYZE agents")
        step = 100_000
        for lo in range(0, sizes.agents, step):
            bounds = {"lo": lo, "hi": min(lo + step, sizes.agents)}
            cur.execute(_JOBS, bounds)
            cur.execute(_OUTBOX, bounds)
            cur.execute(_DELIVERIES, bounds)
        cur.execute(_KPI_TOTALS, {
            "plans": sizes.agents * ROUNDS, "tools": sizes.agents * ROUNDS, "messages": sizes.outbox,
            "tokens": sizes.agents * ROUNDS * PLAN_TOKENS,
        })  # fmt: skip
        # Sequences and identities go on after the seeded history, as if Keel had drawn every value.
        cur.execute("SELECT setval('audit.journal_id_seq', %s)", (sizes.events,))
        cur.execute("SELECT setval('job_fencing_token_seq', %s)", (sizes.jobs,))
        cur.execute(f"ALTER TABLE outbox ALTER COLUMN seq RESTART WITH {sizes.outbox + 1}")
        cur.execute(f"ALTER TABLE delivery_log ALTER COLUMN id RESTART WITH {sizes.outbox + 1}")
        cur.execute("SET session_replication_role = origin")
    conn.commit()


def check(db: Database, sizes: Sizes, sample: int = 200) -> list[str]:
    """What the guards would have refused had they been on: counts, each chain's head on its agent row, the links
    of a sample of chains under the bench's key (Keel's own verify), the seeded names as the SQL wrote them.
    Returns the problems (empty: the seed is sound)."""
    problems = []
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        for table, expected in (
            ("agents", sizes.agents),
            ("requests", sizes.agents),
            ("jobs", sizes.jobs),
            ("outbox", sizes.outbox),
            ("delivery_log", sizes.outbox),
            ("audit.journal", sizes.events),
        ):
            cur.execute(f"SELECT count(*) AS n FROM {table}")
            n = cur.fetchone()["n"]  # type: ignore[index]
            if n != expected:
                problems.append(f"{table} holds {n} rows, not {expected}")
        ks = sorted(random.Random(15).sample(range(sizes.agents), min(sample, sizes.agents)))
        cur.execute(
            "SELECT a.name, j.key FROM agents a JOIN jobs j ON j.agent_id = a.id WHERE a.id = ANY(%s) ORDER BY 1, 2",
            ([agent_id(k) for k in ks],),
        )
        found = {(r["name"], r["key"]) for r in cur.fetchall()}
        wanted = {(f"scale-{k:07d}", job_key(k, n)) for k in ks for n in range(1, JOBS_PER_AGENT + 1)}
        if found != wanted:
            problems.append(f"jobs of sampled agents differ from the journal's keys: {sorted(found ^ wanted)[:3]}")
        cur.execute("SELECT key, destination FROM outbox WHERE agent_id = ANY(%s)", ([agent_id(k) for k in ks],))
        if {(r["key"], r["destination"]) for r in cur.fetchall()} != {(message_key(k), destination(k)) for k in ks}:
            problems.append("outbox keys of sampled agents differ from the journal's")
        conn.rollback()
    for k in ks:
        checked = journal.verify_chain(db, agent_id(k))
        if not checked.ok or checked.events != EVENTS_PER_AGENT:
            problems.append(f"agent scale-{k:07d}'s chain does not verify: {checked.broken or checked.unchecked}")
    return problems
