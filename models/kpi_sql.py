"""The KPIs: counters kept in the transactions that move them (triggers insert ``kpi_deltas`` rows), folded by the
leading beat into per-minute rollups, and read back cheaply as rollups plus the deltas not folded yet, exactly, in
``Decimal``. How the fold, the readers and the rows fit together: docs/explanation/storage-and-jobs.md#kpi-counters."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any
from uuid import UUID

import psycopg
from psycopg.rows import dict_row

from models.db import Database, end_read
from models.tables import CHANNELS

#: The bucket bounds the triggers sort observations into (migration 0009 holds the same numbers; a test checks).
TRANSITION_SECONDS_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
REQUEST_SECONDS_BUCKETS: tuple[float, ...] = (
    0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400,
)  # fmt: skip

#: The kinds of suppressed duplicate: a repeated submit (a producer's retry, an Idempotency-Key replay, a schedule
#: fired twice), a second delivery of a job the claim refused, a job key or an outbox key a transition found there.
SUPPRESSED_KINDS: tuple[str, ...] = ("submit", "job_delivery", "job_insert", "message_insert")
ERROR_CLASSES: tuple[str, ...] = ("transient", "rate_limited", "invalid", "budget", "unknown")
LIVE_JOB_STATUSES: tuple[str, ...] = ("pending", "enqueued", "running")

#: Deltas folded per call of :func:`fold` at most (the next call takes the rest).
FOLD_BATCH = 50_000

#: The shortest span :func:`window` reads: the per-minute rollups make a window whole minutes.
MIN_WINDOW = timedelta(minutes=1)

#: (name, label) -> value, exact (see above).
Counters = Mapping[tuple[str, str], Decimal]


def labels(label: str) -> dict[str, str]:
    """A stored label as a dict: ``"operation=plan,status=succeeded"`` -> ``{"operation": "plan", ...}``."""
    return dict(pair.split("=", 1) for pair in label.split(",")) if label else {}


@dataclass(frozen=True)
class Kpis:
    """The KPIs over a span: since the counters began (:func:`totals`) or the last ``since`` (:func:`window`).
    Rates and times are None when there is nothing to measure yet."""

    since: timedelta | None
    #: Every counter as stored, (name, label) -> value: what the Prometheus exporter reads.
    counters: Counters = field(repr=False)
    suppressed_duplicates: dict[str, int]
    confirmations: int
    side_effect_duplicates: int
    duplicate_rate: float | None
    requests_done: int
    requests_failed: int
    failure_rate: float | None
    mean_request_seconds: float | None
    p95_request_seconds: float | None
    p95_transition_seconds: float | None
    #: Jobs whose first attempt failure happened (counted at that failure).
    jobs_first_failures: int
    #: Jobs that failed at least once and then finished: succeeded, failed or dead (a cancelled one is left out: its
    #: retries were cut short from outside). ``jobs_recovered``: of those, the ones that succeeded.
    jobs_finished_after_failure: int
    jobs_recovered: int
    #: ``jobs_recovered / jobs_finished_after_failure``: never above 1, and a job still waiting for its retry counts
    #: in neither term.
    recovery_rate: float | None
    spent_tokens: int
    spent_cost: float
    retry_tokens: int
    retry_cost: float
    retry_cost_share: float | None
    fenced_outcomes: int
    lease_takeovers: int
    budget_stops: int
    #: Requests stopped at their hard deadline; ``deadline_demotions``: agents moved to the low queue at their soft one.
    deadline_stops: int
    deadline_demotions: int
    attempt_failures: dict[str, int]


@dataclass(frozen=True)
class Gauges:
    """The live state: jobs not final by status, queue lag, the outbox per channel."""

    jobs_by_status: dict[str, int]
    #: How long the oldest job that is due (and not running under a live lease) has waited; 0 when none.
    oldest_due_job_age_seconds: float
    outbox_backlog: dict[str, int]
    outbox_oldest_age_seconds: dict[str, float]
    dead_letters: dict[str, int]


# --- folding -----------------------------------------------------------------------------------------------------

# SKIP LOCKED: two folds at once take disjoint batches, and a delta is deleted by the transaction that adds it to
# the rollups, so none is counted twice or lost. Rollup rows are upserted in key order: two folds cannot deadlock.
_FOLD = """
WITH batch AS (SELECT id FROM kpi_deltas ORDER BY id LIMIT %(limit)s FOR UPDATE SKIP LOCKED),
     gone AS (DELETE FROM kpi_deltas d USING batch WHERE d.id = batch.id RETURNING d.name, d.label, d.at, d.value),
     sums AS (SELECT name, label, date_trunc('minute', at, 'UTC') AS bucket, sum(value) AS value
              FROM gone GROUP BY 1, 2, 3
              UNION ALL
              SELECT name, label, '-infinity'::timestamptz, sum(value) FROM gone GROUP BY 1, 2),
     folded AS (INSERT INTO kpi_rollups (name, label, bucket, value)
                SELECT name, label, bucket, value FROM sums ORDER BY name, label, bucket
                ON CONFLICT (name, label, bucket) DO UPDATE SET value = kpi_rollups.value + EXCLUDED.value)
SELECT count(*) AS n FROM gone
"""
_PRUNE = "DELETE FROM kpi_rollups WHERE bucket > '-infinity' AND bucket < now() - %(keep)s"


def fold(db: Database, *, retention: timedelta = timedelta(days=35), limit: int = FOLD_BATCH) -> int:
    """Fold up to ``limit`` deltas into the rollups and delete them, and drop per-minute rollups older than
    ``retention`` (the running totals stay), in one transaction. Returns the number of deltas folded. Safe to call
    from several processes at once."""
    with db.transaction() as cur:
        cur.execute(_FOLD, {"limit": limit})
        row = cur.fetchone()
        cur.execute(_PRUNE, {"keep": retention})
    return int(row[0]) if row else 0


# --- reading -----------------------------------------------------------------------------------------------------

_TOTALS = """
SELECT name, label, sum(value) AS value FROM (
    SELECT name, label, value FROM kpi_rollups WHERE bucket = '-infinity'
    UNION ALL
    SELECT name, label, value FROM kpi_deltas) c
GROUP BY name, label
"""

# The window starts at the first whole minute after ``now() - since``: a per-minute rollup is in or out whole, and
# the deltas not folded yet are cut at the same instant, so what a reader gets does not depend on when the fold ran.
_WINDOW = """
WITH start AS (SELECT date_trunc('minute', now() - %(since)s, 'UTC')
                      + CASE WHEN date_trunc('minute', now() - %(since)s, 'UTC') < now() - %(since)s
                             THEN interval '1 minute' ELSE interval '0' END AS at)
SELECT name, label, sum(value) AS value FROM (
    SELECT name, label, value FROM kpi_rollups, start WHERE bucket >= start.at
    UNION ALL
    SELECT name, label, value FROM kpi_deltas, start WHERE kpi_deltas.at >= start.at) c
GROUP BY name, label
"""


def check_window(since: timedelta) -> None:
    """Raise :class:`ValueError` unless ``since`` is a span :func:`window` can read: at least :data:`MIN_WINDOW`
    (a shorter one would hold no whole minute, and so, most of the time, nothing)."""
    if since < MIN_WINDOW:
        raise ValueError(
            f"the window must be at least a minute, got {since}: the counters are kept per minute, and a shorter"
            " window holds no whole minute"
        )


def counters(db: Database, since: timedelta | None = None) -> dict[tuple[str, str], Decimal]:
    """Every counter, (name, label) -> exact value: since the counters began, or over the last ``since``."""
    if since is not None:
        check_window(since)
    with db.connection() as conn:
        try:
            return counters_txn(conn, since)
        finally:
            end_read(conn)


def counters_txn(conn: psycopg.Connection[Any], since: timedelta | None = None) -> dict[tuple[str, str], Decimal]:
    """:func:`counters` on the caller's connection, in its transaction."""
    with conn.cursor(row_factory=dict_row) as cur:
        if since is None:
            cur.execute(_TOTALS)
        else:
            cur.execute(_WINDOW, {"since": since})
        return {(r["name"], r["label"]): Decimal(r["value"]) for r in cur.fetchall()}


_PER_MINUTE = """
SELECT bucket, name, sum(value) AS value FROM kpi_rollups
WHERE name = ANY(%(names)s) AND bucket > '-infinity' AND bucket >= date_trunc('minute', now() - %(since)s, 'UTC')
GROUP BY bucket, name ORDER BY bucket
"""


def per_minute(db: Database, names: Iterable[str], since: timedelta) -> dict[str, list[tuple[datetime, float]]]:
    """Each counter's per-minute sums (all its labels together) over the last ``since``, oldest first: minutes in
    which nothing was counted are left out. What the console draws its charts from."""
    wanted = list(names)
    out: dict[str, list[tuple[datetime, float]]] = {name: [] for name in wanted}
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(_PER_MINUTE, {"names": wanted, "since": since})
        rows = cur.fetchall()
        end_read(conn)
    for row in rows:
        out[row["name"]].append((row["bucket"], float(row["value"])))
    return out


def totals(db: Database) -> Kpis:
    """The KPIs since the counters began."""
    return kpis_of(counters(db), None)


def window(db: Database, since: timedelta) -> Kpis:
    """The KPIs over the last ``since`` (from the first whole minute in it; per-minute history is kept
    ``KEEL_KPI_RETENTION_DAYS``). Raises :class:`ValueError` for a span under a minute (:func:`check_window`)."""
    return kpis_of(counters(db, since), since)


def snapshot(db: Database, *, statement_timeout: timedelta) -> tuple[Kpis, Gauges]:
    """The KPIs since the counters began and the live state, read in one transaction whose every statement is
    cancelled after ``statement_timeout`` (a scrape must answer soon, whatever holds a lock the read needs); raises
    the driver's error then."""
    with db.reading(statement_timeout=statement_timeout) as conn:
        values = counters_txn(conn)
        live = gauges_txn(conn)
    return kpis_of(values, None), live


def kpis_of(values: Counters, since: timedelta | None) -> Kpis:
    """The KPIs of a set of counters."""

    def total(name: str, **match: str) -> Decimal:
        return sum((exact(v) for (n, label), v in values.items() if n == name and _matches(label, match)), Decimal(0))

    def by(name: str, key: str, known: Iterable[str] = ()) -> dict[str, int]:
        out = dict.fromkeys(known, 0)
        for (n, label), v in values.items():
            if n == name:
                value = labels(label).get(key, "")
                out[value] = out.get(value, 0) + round(v)
        return out

    confirmations, duplicates = round(total("side_effect_confirmations")), round(total("side_effect_duplicates"))
    done, failed = (
        round(total("requests_finished", outcome="done")),
        round(total("requests_finished", outcome="failed")),
    )
    request_count = total("request_duration_seconds_count")
    finished_after_failure, recovered = round(total("jobs_finished_after_failure")), round(total("jobs_recovered"))
    spent_cost, retry_cost = total("spent_cost"), total("retry_cost")
    return Kpis(
        since=since,
        counters=dict(values),
        suppressed_duplicates=by("suppressed_duplicates", "kind", SUPPRESSED_KINDS),
        confirmations=confirmations,
        side_effect_duplicates=duplicates,
        # Deliveries per key - 1 (docs/reference/kpis.md): duplicates over the keys confirmed (each key's first one).
        duplicate_rate=_ratio(duplicates, confirmations - duplicates),
        requests_done=done,
        requests_failed=failed,
        failure_rate=_ratio(failed, done + failed),
        mean_request_seconds=_ratio(total("request_duration_seconds_sum"), request_count),
        p95_request_seconds=quantile(0.95, histogram(values, "request_duration_seconds", REQUEST_SECONDS_BUCKETS)),
        p95_transition_seconds=quantile(
            0.95, histogram(values, "phase_transition_seconds", TRANSITION_SECONDS_BUCKETS)
        ),
        jobs_first_failures=round(total("jobs_first_failures")),
        jobs_finished_after_failure=finished_after_failure,
        jobs_recovered=recovered,
        recovery_rate=_ratio(recovered, finished_after_failure),
        spent_tokens=round(total("spent_tokens")),
        spent_cost=float(round(spent_cost, 6)),
        retry_tokens=round(total("retry_tokens")),
        retry_cost=float(round(retry_cost, 6)),
        retry_cost_share=_ratio(retry_cost, spent_cost),
        fenced_outcomes=round(total("fenced_outcomes")),
        lease_takeovers=round(total("lease_takeovers")),
        budget_stops=round(total("budget_stops")),
        deadline_stops=round(total("deadline_stops", kind="hard")),
        deadline_demotions=round(total("deadline_stops", kind="soft")),
        attempt_failures=by("job_attempt_failures", "error_class", ERROR_CLASSES),
    )


def _matches(label: str, match: Mapping[str, str]) -> bool:
    if not match:
        return True
    have = labels(label)
    return all(have.get(k) == v for k, v in match.items())


def _ratio(part: Decimal | int, whole: Decimal | int) -> float | None:
    return round(float(Decimal(part) / Decimal(whole)), 6) if whole > 0 else None


def exact(value: Decimal | float) -> Decimal:
    """``value`` as a Decimal (a float as the shortest decimal that reads back as it: ``0.1`` is ``Decimal("0.1")``)."""
    return value if isinstance(value, Decimal) else Decimal(repr(float(value)))


def histogram(values: Counters, name: str, bounds: Iterable[float], **match: str) -> list[tuple[float, float]]:
    """The cumulative buckets of histogram ``name`` (over every other label, or those matching ``match``):
    ``[(upper bound, observations <= it), ..., (inf, all)]``, every bound of ``bounds`` present."""
    per_bucket = dict.fromkeys([*bounds, math.inf], Decimal(0))
    for (n, label), v in values.items():
        if n != f"{name}_bucket":
            continue
        have = labels(label)
        if any(have.get(k) != want for k, want in match.items()):
            continue
        upper = float(have["le"])  # "+Inf" too
        per_bucket[upper] = per_bucket.get(upper, Decimal(0)) + exact(v)
    cumulative, running = [], Decimal(0)
    for upper in sorted(per_bucket):
        running += per_bucket[upper]
        cumulative.append((upper, float(running)))
    return cumulative


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q``-quantile of cumulative ``buckets`` by linear interpolation inside the bucket it falls in, as
    Prometheus's ``histogram_quantile`` does (in the last, unbounded bucket: the highest finite bound). None when
    the histogram is empty."""
    if len(buckets) < 2 or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    index = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    if index == len(buckets) - 1:
        return buckets[-2][0]
    upper, count = buckets[index]
    lower, below = (0.0, 0.0) if index == 0 else buckets[index - 1]
    if index == 0 and upper <= 0:
        return upper
    inside = count - below
    return lower + (upper - lower) * ((rank - below) / inside if inside else 0.0)


# --- the live state ----------------------------------------------------------------------------------------------

# Each through a partial index, so a scrape costs what is live, never what is history: ix_jobs_due (jobs not final),
# ix_outbox_line (pending and sending messages), ix_outbox_dead (dead letters).
_JOBS_BY_STATUS = (
    "SELECT status, count(*) AS n FROM jobs WHERE status IN ('pending', 'enqueued', 'running') GROUP BY status"
)
_OLDEST_DUE = (
    "SELECT extract(epoch FROM clock_timestamp() - min(run_at)) AS age FROM jobs"
    " WHERE status IN ('pending', 'enqueued', 'running') AND run_at <= clock_timestamp()"
    " AND (status <> 'running' OR lease_until < clock_timestamp())"
)
_BACKLOG = (
    "SELECT channel, count(*) AS n, extract(epoch FROM clock_timestamp() - min(created_at)) AS age FROM outbox"
    " WHERE status IN ('pending', 'sending') GROUP BY channel"
)
_DEAD = "SELECT channel, count(*) AS n FROM outbox WHERE status = 'dead' GROUP BY channel"


def gauges(db: Database) -> Gauges:
    """The live state, read through partial indexes (cost grows with what is live, not with history)."""
    with db.connection() as conn:
        try:
            return gauges_txn(conn)
        finally:
            end_read(conn)


def gauges_txn(conn: psycopg.Connection[Any]) -> Gauges:
    """:func:`gauges` on the caller's connection, in its transaction."""
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(_JOBS_BY_STATUS)
        jobs = {r["status"]: int(r["n"]) for r in cur.fetchall()}
        cur.execute(_OLDEST_DUE)
        oldest = cur.fetchone()
        cur.execute(_BACKLOG)
        backlog = cur.fetchall()
        cur.execute(_DEAD)
        dead = {r["channel"]: int(r["n"]) for r in cur.fetchall()}
    age = oldest["age"] if oldest else None
    return Gauges(
        jobs_by_status={s: jobs.get(s, 0) for s in LIVE_JOB_STATUSES},
        oldest_due_job_age_seconds=max(0.0, float(age)) if age is not None else 0.0,
        outbox_backlog={c: 0 for c in CHANNELS} | {r["channel"]: int(r["n"]) for r in backlog},
        outbox_oldest_age_seconds={c: 0.0 for c in CHANNELS}
        | {r["channel"]: max(0.0, float(r["age"])) for r in backlog},
        dead_letters={c: 0 for c in CHANNELS} | dead,
    )


# --- the demo's own figures and each request's outcome -----------------------------------------------------------

# `keel demo` reports on its own few agents, which may share the database with others: the counters above are
# global, so it reads its agents' rows once, at the end of its run. Not a path anything runs repeatedly (it reads
# the jobs and the outbox without an index on agent_id: one more index on jobs would cost every job write).
_AGENT_KPIS = """
WITH mine_jobs AS (SELECT * FROM jobs WHERE agent_id = ANY(%(ids)s::uuid[])),
     mine_events AS (SELECT * FROM audit.journal WHERE agent_id = ANY(%(ids)s::uuid[])),
     mine_log AS (SELECT d.* FROM delivery_log d JOIN outbox o ON o.key = d.key WHERE o.agent_id = ANY(%(ids)s::uuid[]))
SELECT
  (SELECT count(*) FROM mine_events WHERE kind = 'suppressed' AND decision <> 'fenced_off')
  + (SELECT coalesce(sum(json_array_length(details->'jobs_suppressed')), 0) FROM mine_events
     WHERE json_typeof(details->'jobs_suppressed') = 'array')
  + (SELECT coalesce(sum(json_array_length(details->'messages_suppressed')), 0) FROM mine_events
     WHERE json_typeof(details->'messages_suppressed') = 'array')                        AS suppressed_duplicates,
  (SELECT count(*) FROM (SELECT key FROM mine_log GROUP BY key HAVING count(*) > 1) d)   AS keys_confirmed_twice,
  (SELECT count(*) FROM mine_log)                                                        AS deliveries,
  (SELECT coalesce(sum(attempts), 0) FROM mine_jobs WHERE operation = 'plan')           AS model_calls,
  (SELECT coalesce(sum(attempts), 0) FROM mine_jobs WHERE operation = 'tool')           AS tool_calls,
  (SELECT percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - run_at))
     FROM mine_jobs WHERE status = 'succeeded')                                         AS p95_step_seconds,
  (SELECT count(*) FILTER (WHERE status = 'succeeded')::float / nullif(count(*), 0) FROM mine_jobs
     WHERE error_attempts <> '{}'::jsonb AND status IN ('succeeded', 'failed', 'dead'))  AS recovery_rate,
  (SELECT count(*) FROM mine_jobs
     WHERE error_attempts <> '{}'::jsonb AND status IN ('succeeded', 'failed', 'dead'))  AS jobs_finished_after_failure,
  (SELECT coalesce(sum(failed_tokens), 0)::bigint FROM mine_jobs)                       AS retry_tokens,
  (SELECT coalesce(sum(failed_cost), 0) FROM mine_jobs)                                 AS retry_cost,
  (SELECT count(*) FILTER (WHERE phase = 'failed')::float / nullif(count(*), 0) FROM agents
     WHERE request_id IS NOT NULL AND id = ANY(%(ids)s::uuid[]))                         AS failure_rate
"""


def agent_kpis(db: Database, agent_ids: Iterable[UUID]) -> dict[str, Any]:
    """The demo's figures over ``agent_ids`` only, from their rows (see above: for a handful of agents, once)."""
    with db.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute(_AGENT_KPIS, {"ids": list(agent_ids)})
        row = cur.fetchone() or {}
        end_read(conn)
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
        end_read(conn)
    return rows
