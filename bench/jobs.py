"""Benchmark: end-to-end Keel jobs/s beside bare Celery on the same broker, in the same run, then the delay from a
job's due time to its start (``make bench-jobs``; :data:`DESCRIPTION`, its ``--help``, says how it measures).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import redis

import bench.handlers  # noqa: F401 - registers bench_noop here too: submits are checked against it
from agents.cli.progress import Progress
from agents.cli.progress import Step as ProgressStep
from agents.client import Client
from models import migrations
from models.audit_keys import audit_keys_for
from models.db import Database
from models.embedded import broker_url_for, database_url_for
from models.settings import Settings
from models.urls import libpq_url, with_database

#: The benchmark's ``--help``: what it measures and how.
DESCRIPTION = """\
Benchmark: end-to-end Keel jobs/s beside bare Celery on the same broker, in the same run.

Keel: a backlog of N jobs (one per agent, each from a submit) is dispatched by a real beat, claimed by a real
worker, run by a no-op handler and finished through the outcome transition. Bare Celery: N no-op tasks with the
same reliability settings (acks_late, prefetch 1) on the same Redis. Both with 1 and with 2 worker processes,
throughput measured from the first completion to the last. Then the delay from a job's due time to its start at a
light load (one job every 50 ms), through the dispatcher and through the client's publish-at-once path.

Run with ``make bench-jobs`` (or ``python -m bench.jobs``). Uses KEEL_DATABASE_URL / KEEL_BROKER_URL's servers,
else the embedded ones; it creates and drops a database of its own and, on the broker's Redis database, uses (and
then deletes) only keys under a prefix of its own (``KEEL_BROKER_PREFIX=keel-bench-…:``).
"""

OUT = Progress()  # live on a terminal, plain lines in a pipe or a file

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@contextmanager
def process(argv: list[str], env: dict[str, str], log: Path, node: str | None = None) -> Iterator[None]:
    """Run a process for the block; with ``node``, wait until that Celery worker answers a ping."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=out, cwd=ROOT)
    try:
        if node is not None:
            from bench.bare import app

            deadline = time.monotonic() + 60
            while not app.control.ping(destination=[node], timeout=0.5):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"{argv[0]} did not start; see {log}")
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_for(what: str, predicate: Any, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        settings = Settings()
        self.n = args.jobs
        server = database_url_for(settings)
        self.db_name = f"keel_bench_jobs_{uuid.uuid4().hex[:8]}"
        self.server = server
        with psycopg.connect(libpq_url(with_database(server, "postgres")), autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{self.db_name}"')
        self.db_url = with_database(server, self.db_name)
        migrations.upgrade(self.db_url)
        # The configured broker, shared with whoever else uses it: this run touches only keys under its own prefix,
        # and deletes only those afterwards.
        self.broker_url = broker_url_for(settings)
        self.prefix = f"keel-bench-{uuid.uuid4().hex[:8]}:"
        self.done_key = self.prefix + "bench:done"
        os.environ["BENCH_BROKER_URL"] = self.broker_url  # read by bench.bare at import
        os.environ["BENCH_BROKER_PREFIX"] = self.prefix
        self.redis = redis.Redis.from_url(self.broker_url)
        self.logs = Path(args.logs)
        self.logs.mkdir(parents=True, exist_ok=True)
        base = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
        base["PYTHONPATH"] = str(ROOT)
        self.keel_env = {
            **base,
            "KEEL_DATABASE_URL": self.db_url,
            "KEEL_BROKER_URL": self.broker_url,
            "KEEL_BROKER_PREFIX": self.prefix,
            "KEEL_IMPORTS": json.dumps(["bench.handlers"]),
        }
        self.bare_env = {**base, "BENCH_BROKER_URL": self.broker_url, "BENCH_BROKER_PREFIX": self.prefix}
        self.db = Database(self.db_url, pool_size=4, audit_keys=audit_keys_for(Settings()))
        self.poll = psycopg.connect(libpq_url(self.db_url), autocommit=True)
        self.client = Client(self.db)
        self.agent_seq = 0

    def close(self) -> None:
        self.poll.close()
        self.db.dispose()
        keys = list(self.redis.scan_iter(match=self.prefix + "*", count=1000))
        for start in range(0, len(keys), 500):
            self.redis.delete(*keys[start : start + 500])
        self.redis.close()
        with psycopg.connect(libpq_url(with_database(self.server, "postgres")), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)')

    def new_agents(self, n: int) -> list[Any]:
        ids = []
        with OUT.task(f"seeding {n} agents", total=n) as step:
            for _ in range(n):
                self.agent_seq += 1
                ids.append(self.client.create_agent(f"bench-{self.agent_seq}").id)
                step.advance()
        return ids

    def submit_all(self, ids: list[Any], client: Client | None = None, spacing: float = 0.0) -> None:
        client = client or self.client
        with OUT.task(f"submitting {len(ids)} requests", total=len(ids)) as step:
            for agent_id in ids:
                client.submit(agent_id, f"r{uuid.uuid4().hex[:12]}", None, operation="bench_noop")
                step.advance()
                if spacing:
                    time.sleep(spacing)

    def done(self, step: ProgressStep, before: int, n: int) -> bool:
        finished = self.succeeded() - before
        step.update(completed=finished)
        return finished >= n

    def succeeded(self) -> int:
        # One long-lived connection, polled gently: the measurement must not load the 2 cores it measures.
        time.sleep(0.2)
        row = self.poll.execute("SELECT count(*) FROM jobs WHERE status = 'succeeded'").fetchone()
        return int(row[0]) if row else 0

    def finished_span(self, since: float) -> tuple[int, float]:
        with psycopg.connect(libpq_url(self.db_url)) as conn:
            row = conn.execute(
                "SELECT count(*), extract(epoch FROM max(finished_at) - min(finished_at)) FROM jobs"
                " WHERE status = 'succeeded' AND extract(epoch FROM finished_at) >= %s",
                (since,),
            ).fetchone()
        assert row is not None
        return int(row[0]), float(row[1])

    def keel_throughput(self, processes: int) -> float:
        """N jobs scheduled while no beat runs; then beat and worker take the backlog."""
        ids = self.new_agents(self.n)
        self.submit_all(ids)
        since = time.time()
        before = self.succeeded()
        node = f"bench{processes}@{socket.gethostname()}"
        worker = [str(BIN / "keel"), "worker", "-c", str(processes), "-n", node, "-l", "warning"]
        log = self.logs / f"keel-worker-{processes}.log"
        with (
            process(worker, self.keel_env, log, node),
            process([str(BIN / "keel"), "beat", "-l", "warning"], self.keel_env, self.logs / "keel-beat.log"),
        ):
            with OUT.task(f"keel, {processes} worker process(es): the backlog", total=self.n) as step:
                wait_for("the Keel backlog", lambda: self.done(step, before, self.n))
        count, span = self.finished_span(since)
        return (count - 1) / span

    def bare_throughput(self, processes: int) -> float:
        self.redis.delete(self.done_key)
        node = f"bare{processes}@{socket.gethostname()}"
        worker = [
            str(BIN / "celery"),
            "-A",
            "bench.bare",
            "worker",
            "-c",
            str(processes),
            "-Q",
            "bare",
            "-n",
            node,
            "-l",
            "warning",
            "--without-mingle",
            "--without-gossip",
        ]
        log = self.logs / f"bare-worker-{processes}.log"
        with process(worker, self.bare_env, log, node):
            from bench.bare import app, noop

            with app.producer_or_acquire() as producer:
                for i in range(self.n):
                    noop.apply_async((i,), producer=producer)
            with OUT.task(f"bare Celery, {processes} worker process(es): the backlog", total=self.n) as step:
                wait_for("the bare backlog", lambda: self.bare_done(step))
        times = sorted(float(t) for t in self.redis.lrange(self.done_key, 0, -1))
        return (len(times) - 1) / (times[-1] - times[0])

    def bare_done(self, step: ProgressStep) -> bool:
        time.sleep(0.2)
        finished = int(self.redis.llen(self.done_key))
        step.update(completed=finished)
        return finished >= self.n

    def due_to_start(self, publish_at_once: bool) -> list[float]:
        """Jobs submitted one every 50 ms to an idle worker: seconds from due (run_at) to start."""
        from tasks.app import make_app, publisher

        ids = self.new_agents(200)
        client = self.client
        celery = None
        if publish_at_once:
            os.environ["KEEL_BROKER_URL"] = self.broker_url
            os.environ["KEEL_BROKER_PREFIX"] = self.prefix
            celery = make_app()
            client = Client(self.db, publisher=publisher(celery))
        node = f"lat{int(publish_at_once)}@{socket.gethostname()}"
        worker = [str(BIN / "keel"), "worker", "-c", "2", "-n", node, "-l", "warning"]
        with (
            process(worker, self.keel_env, self.logs / "keel-latency-worker.log", node),
            process([str(BIN / "keel"), "beat", "-l", "warning"], self.keel_env, self.logs / "keel-beat.log"),
        ):
            time.sleep(2)  # let beat become the leader
            before = self.succeeded()
            self.submit_all(ids, client, spacing=0.05)
            wait_for("the latency run", lambda: self.succeeded() - before >= len(ids))
        if celery is not None:
            celery.close()
        with psycopg.connect(libpq_url(self.db_url)) as conn:
            rows = conn.execute(
                "SELECT extract(epoch FROM started_at - run_at) FROM jobs WHERE agent_id = ANY(%s)", (ids,)
            ).fetchall()
        return [float(r[0]) for r in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=1000, help="jobs per throughput run (default 1000)")
    parser.add_argument("--rounds", type=int, default=3, help="bare/keel alternations per setting (default 3)")
    parser.add_argument("--logs", default=".keel/bench-logs", help="where worker and beat logs go")
    args = parser.parse_args(argv)
    bench = Bench(args)
    try:
        OUT.line(f"job benchmark: {args.jobs} jobs per run, database {bench.db_name}, broker {bench.broker_url}")
        ratios = []
        for processes in (1, 2):
            bares, keels = [], []
            for _ in range(args.rounds):  # alternating, so drift on the machine hits both sides alike
                bares.append(bench.bare_throughput(processes))
                keels.append(bench.keel_throughput(processes))
            bare, keel = statistics.median(bares), statistics.median(keels)
            ratios.append(keel / bare)
            runs = lambda xs: ", ".join(f"{x:.0f}" for x in xs)  # noqa: E731
            OUT.line(f"\n{processes} worker process{'es' if processes > 1 else ''} (median of {args.rounds} runs each)")
            OUT.line(f"  bare Celery no-op      {bare:8.0f} tasks/s   runs: {runs(bares)}")
            OUT.line(f"  keel end-to-end        {keel:8.0f} jobs/s    runs: {runs(keels)}")
            OUT.line("                         (dispatch, claim, no-op handler, outcome transition, journal)")
            OUT.line(f"  ratio keel/bare        {keel / bare:8.2f}x")
        for label, at_once in (("through the dispatcher", False), ("published at submit", True)):
            delays = bench.due_to_start(at_once)
            OUT.line(
                f"\ndue -> start, {label} (200 jobs, one per 50 ms): p50 {pct(delays, 50) * 1000:.0f} ms,"
                f" p95 {pct(delays, 95) * 1000:.0f} ms, max {max(delays) * 1000:.0f} ms"
            )
        worst = min(ratios)
        OUT.line(
            f"\ntarget: at least 0.50x bare Celery throughput -> {worst:.2f}x {'met' if worst >= 0.5 else 'NOT MET'}"
        )
    finally:
        bench.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
