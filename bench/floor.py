"""Benchmark: the floor of a job's cost in the worker — what the two transactions every Keel job needs (the claim, and
the outcome under the agent row's lock) cost a Python process in psycopg 3 alone, with no Keel code around them.

``make bench-peers`` prints it after the I/O workload, so the worker CPU per job measured there for Keel and bare
Celery can be read against it (docs/benchmarks.md#the-floor): Keel's worker CPU per job cannot go below bare
Celery's plus this, whatever Keel's own code does.

The statements are the least the guarantees need, on tables of their own: an ``UPDATE … RETURNING`` that claims the
job (its own transaction, durable before the handler starts), then one pipelined transaction that locks the agent row,
writes the job's outcome under its fencing token and moves the row. No journal event, no HMAC, no trigger, no pool
checkout, no span, no handler thread: each of those is Keel's on top. Prepared statements, ``--threads`` connections
(one per thread), ``--jobs`` jobs. Uses KEEL_DATABASE_URL's server, else the embedded one, in a database of its own
that it drops.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import uuid
from typing import Any

import psycopg

from models.embedded import database_url_for
from models.settings import Settings
from models.urls import libpq_url, with_database

_CLAIM = (
    "UPDATE f_jobs SET status = 'running', token = nextval('f_token'), lease = clock_timestamp() + interval '5 min'"
    " WHERE key = %s AND status = 'enqueued' RETURNING agent_id, token"
)
_LOCK = "SELECT revision FROM f_agents WHERE id = %s FOR UPDATE"
_FINISH = "UPDATE f_jobs SET status = 'succeeded', result = %s, lease = NULL WHERE key = %s AND token = %s"
_MOVE = "UPDATE f_agents SET revision = revision + 1, head = %s WHERE id = %s"


def _setup(url: str, jobs: int) -> list[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE SEQUENCE f_token")
        conn.execute("CREATE TABLE f_agents (id uuid PRIMARY KEY, revision int NOT NULL, head text NOT NULL)")
        conn.execute(
            "CREATE TABLE f_jobs (key text PRIMARY KEY, agent_id uuid NOT NULL REFERENCES f_agents, status text NOT"
            " NULL, token bigint NOT NULL DEFAULT 0, lease timestamptz, result jsonb)"
        )
        agents = [uuid.uuid4() for _ in range(jobs)]
        keys = [f"r{i}:floor:t" for i in range(jobs)]
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO f_agents VALUES (%s, 0, '')", [(a,) for a in agents])
            rows = list(zip(keys, agents, strict=True))
            cur.executemany("INSERT INTO f_jobs (key, agent_id, status) VALUES (%s, %s, 'enqueued')", rows)
        conn.execute("VACUUM ANALYZE f_agents, f_jobs")
    return keys


def _work(url: str, keys: list[str], failures: list[BaseException]) -> None:
    try:
        with psycopg.connect(url, prepare_threshold=0) as conn:
            for key in keys:
                with conn.transaction():
                    claimed = conn.execute(_CLAIM, (key,)).fetchone()
                assert claimed is not None, key
                agent_id, token = claimed
                with conn.pipeline(), conn.transaction():
                    conn.execute(_LOCK, (agent_id,))
                    finished = conn.execute(_FINISH, ('{"ok": true}', key, token))
                    conn.execute(_MOVE, ("head", agent_id))
                assert finished.rowcount == 1, key
    except BaseException as exc:  # reported by the main thread
        failures.append(exc)


def measure(url: str, jobs: int, threads: int) -> tuple[float, float]:
    """(worker CPU ms per job, wall ms per job) over ``jobs`` jobs on ``threads`` connections."""
    keys = _setup(url, jobs)
    failures: list[BaseException] = []
    workers = [threading.Thread(target=_work, args=(url, keys[i::threads], failures)) for i in range(threads)]
    cpu, wall = time.process_time(), time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    if failures:
        raise failures[0]
    return cpu * 1000 / jobs, wall * 1000 / jobs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=4000, help="jobs (default 4000)")
    parser.add_argument("--threads", type=int, default=8, help="threads, each with its connection (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="runs; the median is printed (default 3)")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.threads < 1 or args.rounds < 1:
        parser.error("--jobs, --threads and --rounds must be at least 1")
    server = database_url_for(Settings())
    admin: Any = libpq_url(with_database(server, "postgres"))
    results = []
    for r in range(args.rounds):
        name = f"keel_bench_floor_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        try:
            results.append(measure(libpq_url(with_database(server, name)), args.jobs, args.threads))
        finally:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        print(f"floor, round {r + 1}: {results[-1][0]:.3f} ms worker CPU, {results[-1][1]:.3f} ms wall per job")
    cpu = sorted(c for c, _ in results)[len(results) // 2]
    print(
        f"floor: a job's two transactions in psycopg alone ({args.threads} threads, median of {args.rounds}):"
        f" {cpu:.2f} ms of worker CPU per job. Keel's worker CPU per job is at least bare Celery's plus this."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
