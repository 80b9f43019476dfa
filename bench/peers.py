"""Benchmark: Keel beside its peers — bare Celery, procrastinate and DBOS Transact — on the same servers, in one run
(``make bench-peers``; :data:`DESCRIPTION`, its ``--help``, says how it measures).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import redis

import bench.handlers  # noqa: F401 - registers bench_noop here too: submits are checked against it
from agents.cli.progress import Progress
from agents.client import Client
from models import migrations
from models.audit_keys import audit_keys_for
from models.db import Database
from models.embedded import broker_url_for, database_url_for
from models.settings import Settings
from models.urls import libpq_url, with_database

#: The benchmark's ``--help``: what it measures and how.
DESCRIPTION = """\
Benchmark: Keel beside its peers — bare Celery, procrastinate and DBOS Transact — on the same servers, in one run.

Each system gets a backlog of N no-op jobs on a fresh database of the same PostgreSQL server (Keel's cloned from a
migrated template), then its workers start (1, then 2 processes) and take the backlog. Runs alternate between the
systems, so drift on the machine hits all of them alike; each figure is the median of ``--rounds`` runs:

  jobs/s          first completion to last (completion times: Keel's ``jobs.finished_at``, the others' own record)
  first done      seconds from starting the workers to the first completion (boot, leadership, first poll)
  commits/job     ``pg_stat_database.xact_commit`` of the run's database while the workers took the backlog, per job
                  (Keel's include its beat's chores; the benchmark's own polling queries are not counted)

Then the delay from submit to start of the first job of a burst of 20 (Keel, a worker and a beat already running,
median of 5 bursts): through the dispatcher, and published at submit (``Client(publisher=…)``).

Keel's backlog is published at submit, as by default (KEEL_PUBLISH_AT_SUBMIT): it waits on the broker, as bare
Celery's does. Keel and bare Celery run under Keel's Celery configuration (acks_late, prefetch 1), prefork (a process
per job: --keel-threads runs Keel's as threads); procrastinate
and DBOS with their defaults, one process per worker. The peers come from the ``bench`` extra: ``make bench-peers``
installs it (``pip install -e '.[bench]'``) and runs ``python -m bench.peers``. Uses KEEL_DATABASE_URL /
KEEL_BROKER_URL's servers, else the embedded ones; on the broker it touches only keys under a prefix of its own, and
deletes them afterwards. ``--systems`` runs only some of them.
"""

OUT = Progress()
ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SYSTEMS = ("keel", "celery", "procrastinate", "dbos")
BURST = 20


@dataclass(frozen=True, slots=True)
class Run:
    rate: float  # jobs/s, first completion to last
    first_done: float  # seconds from starting the workers to the first completion
    commits_per_job: float


def median_run(runs: list[Run]) -> Run:
    return Run(
        statistics.median(r.rate for r in runs),
        statistics.median(r.first_done for r in runs),
        statistics.median(r.commits_per_job for r in runs),
    )


@contextmanager
def processes(argvs: list[list[str]], env: dict[str, str], log: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start the processes for the block; stop them (by pid: they are ours) afterwards."""
    procs: list[subprocess.Popen[bytes]] = []
    with open(log, "ab") as out:
        for argv in argvs:
            procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=out, cwd=ROOT))
    try:
        yield procs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_for(what: str, done: Callable[[], bool], procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{what}: {proc.args!r} exited with status {proc.returncode}; see the logs")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


class Peers:
    def __init__(self, args: argparse.Namespace) -> None:
        settings = Settings()
        self.n: int = args.jobs
        self.server = database_url_for(settings)
        self.broker_url = broker_url_for(settings)
        self.prefix = f"keel-bench-{uuid.uuid4().hex[:8]}:"
        self.done_key = self.prefix + "bench:done"
        self.redis = redis.Redis.from_url(self.broker_url)
        self.logs = Path(args.logs)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.run_id = uuid.uuid4().hex[:8]
        self.created: list[str] = []
        self.seq = 0
        self.template = self.create_database("template")
        migrations.upgrade(with_database(self.server, self.template))
        base = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "BENCH_"))}
        base["PYTHONPATH"] = str(ROOT)
        self.base_env = {**base, "BENCH_BROKER_URL": self.broker_url, "BENCH_BROKER_PREFIX": self.prefix}
        self.audit_keys = audit_keys_for(settings)
        self.keel_threads: int = args.keel_threads

    # -- databases ---------------------------------------------------------------------------------------------
    def admin(self) -> psycopg.Connection[Any]:
        return psycopg.connect(libpq_url(with_database(self.server, "postgres")), autocommit=True)

    def create_database(self, what: str, template: str | None = None) -> str:
        self.seq += 1
        name = f"keel_bench_peers_{self.run_id}_{what}_{self.seq}"
        clause = f' TEMPLATE "{template}"' if template else ""
        with self.admin() as admin:
            admin.execute(f'CREATE DATABASE "{name}"{clause}')
        self.created.append(name)
        return name

    def drop_database(self, name: str) -> None:
        with self.admin() as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.created.remove(name)

    def commits(self, name: str) -> int:
        """Commits so far in database ``name``, asked from another database (so the asking is not counted)."""
        time.sleep(1.2)  # backends report their counts at most once a second; exited ones have reported already
        with self.admin() as admin:
            row = admin.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (name,)).fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        for name in list(self.created):
            with suppress(psycopg.Error):
                self.drop_database(name)
        keys = list(self.redis.scan_iter(match=self.prefix + "*", count=1000))
        for start in range(0, len(keys), 500):
            self.redis.delete(*keys[start : start + 500])
        self.redis.close()

    # -- completions recorded in Redis (bare Celery, procrastinate, DBOS) --------------------------------------
    def redis_run(self, system: str, db: str | None, workers: list[list[str]], env: dict[str, str]) -> Run:
        before = self.commits(db) if db else 0
        started = time.time()
        with processes(workers, env, self.logs / f"{system}.log") as procs:
            wait_for(f"the {system} backlog", lambda: self.redis.llen(self.done_key) >= self.n, procs, 600)
        after = self.commits(db) if db else 0
        times = sorted(float(t) for t in self.redis.lrange(self.done_key, 0, -1))
        self.redis.delete(self.done_key)
        return Run((len(times) - 1) / (times[-1] - times[0]), times[0] - started, (after - before) / self.n)

    def celery(self, n_processes: int) -> Run:
        from bench.bare import app, noop

        self.redis.delete(self.done_key)
        with app.producer_or_acquire() as producer:
            for i in range(self.n):
                noop.apply_async((i,), producer=producer)
        node = f"bare{n_processes}-{self.run_id}@{socket.gethostname()}"
        worker = [str(BIN / "celery"), "-A", "bench.bare", "worker", "-c", str(n_processes), "-Q", "bare"]
        worker += ["-n", node, "-l", "warning", "--without-mingle", "--without-gossip"]  # as `keel worker` runs
        return self.redis_run("celery", None, [worker], self.base_env)

    def peer(self, system: str, n_processes: int) -> Run:
        from bench import peer_apps

        db = self.create_database(system)
        env = {**self.base_env, "BENCH_DATABASE_URL": libpq_url(with_database(self.server, db))}
        try:
            self.redis.delete(self.done_key)
            subprocess.run([sys.executable, "-m", "bench.peer_worker", system, "setup"], env=env, check=True, cwd=ROOT)
            # The backlog, through the peer's own producer API, in this process.
            os.environ.update({k: env[k] for k in ("BENCH_DATABASE_URL", "BENCH_BROKER_URL", "BENCH_BROKER_PREFIX")})
            peer_apps.DATABASE = env["BENCH_DATABASE_URL"]
            (peer_apps.enqueue_procrastinate if system == "procrastinate" else peer_apps.enqueue_dbos)(self.n)
            worker = [sys.executable, "-m", "bench.peer_worker", system, "worker"]
            return self.redis_run(system, db, [worker] * n_processes, env)
        finally:
            self.drop_database(db)

    # -- Keel ----------------------------------------------------------------------------------------------------
    def keel_env(self, db: str) -> dict[str, str]:
        return {
            **self.base_env,
            "KEEL_DATABASE_URL": with_database(self.server, db),
            "KEEL_BROKER_URL": self.broker_url,
            "KEEL_BROKER_PREFIX": self.prefix,
            "KEEL_IMPORTS": json.dumps(["bench.handlers"]),
        }

    def keel(self, n_processes: int) -> Run:
        """Keel as deployed by default: each submit publishes its job at once (KEEL_PUBLISH_AT_SUBMIT), so the
        backlog waits on the broker, as bare Celery's does; the beat runs beside the worker (its dispatcher, the
        safety net, finds nothing to publish)."""
        from tasks.app import make_app, publisher

        db = self.create_database("keel", template=self.template)
        database = Database(with_database(self.server, db), pool_size=2, audit_keys=self.audit_keys)
        celery = make_app(Settings(broker_url=self.broker_url, broker_prefix=self.prefix))
        try:
            client = Client(database, publisher=publisher(celery))
            ids = [client.create_agent(f"bench-{i}").id for i in range(self.n)]
            for agent_id in ids:
                client.submit(agent_id, f"r{uuid.uuid4().hex[:12]}", None, operation="bench_noop")
            database.dispose()  # its connections would count as idle commits otherwise
            celery.close()
            before = self.commits(db)
            node = f"keel{n_processes}-{self.run_id}@{socket.gethostname()}"
            env = self.keel_env(db)
            if self.keel_threads:  # n_processes workers, each a pool of threads (as DBOS runs its workflows)
                env["KEEL_DB_POOL_SIZE_WORKER"] = str(self.keel_threads)
                pool = ["--pool", "threads", "-c", str(self.keel_threads)]
                workers = [
                    [str(BIN / "keel"), "worker", *pool, "-n", f"{i}-{node}", "-l", "warning"]
                    for i in range(n_processes)
                ]
            else:
                prefork = ["-P", "prefork", "-c", str(n_processes)]  # as bare Celery runs: a process per job
                workers = [[str(BIN / "keel"), "worker", *prefork, "-n", node, "-l", "warning"]]
            beat = [str(BIN / "keel"), "beat", "-l", "warning"]
            started = time.time()
            polls = 0
            with (
                psycopg.connect(libpq_url(with_database(self.server, db)), autocommit=True) as poll,
                processes([*workers, beat], env, self.logs / "keel.log") as procs,
            ):

                def finished() -> bool:
                    nonlocal polls
                    polls += 1
                    row = poll.execute("SELECT count(*) FROM jobs WHERE status = 'succeeded'").fetchone()
                    return bool(row and row[0] >= self.n)

                wait_for("the Keel backlog", finished, procs, 600)
                span = poll.execute(
                    "SELECT extract(epoch FROM min(finished_at)) AS first, extract(epoch FROM max(finished_at)) AS last"
                    " FROM jobs WHERE status = 'succeeded'"
                ).fetchone()
                polls += 1
            after = self.commits(db) - polls
            assert span is not None
            first, last = float(span[0]), float(span[1])
            return Run((self.n - 1) / (last - first), first - started, (after - before) / self.n)
        finally:
            celery.close()
            database.dispose()
            self.drop_database(db)

    def keel_burst(self, publish_at_submit: bool, bursts: int = 5) -> list[float]:
        """With a worker and a beat running and idle, submit a burst of jobs: seconds from the first job's submit
        (its row's ``created_at``) to its start, per burst."""
        from tasks.app import make_app, publisher

        db = self.create_database("burst", template=self.template)
        env = self.keel_env(db)
        database = Database(env["KEEL_DATABASE_URL"], pool_size=2, audit_keys=self.audit_keys)
        celery = None
        try:
            client = Client(database)
            if publish_at_submit:
                celery = make_app(Settings(broker_url=self.broker_url, broker_prefix=self.prefix))
                client = Client(database, publisher=publisher(celery))
            ids = [client.create_agent(f"burst-{i}").id for i in range(BURST * bursts)]
            node = f"burst-{self.run_id}@{socket.gethostname()}"
            worker = [str(BIN / "keel"), "worker", "-n", node, "-l", "warning"]  # as it starts by default
            beat = [str(BIN / "keel"), "beat", "-l", "warning"]
            delays: list[float] = []
            with processes([worker, beat], env, self.logs / "keel-burst.log") as procs:
                with psycopg.connect(libpq_url(env["KEEL_DATABASE_URL"]), autocommit=True) as poll:
                    # Warm: one job through, so the worker and the beat are up and leading.
                    client.submit(ids[0], "warm", None, operation="bench_noop")
                    wait_for("the warm-up job", lambda: succeeded(poll) >= 1, procs, 120)
                    time.sleep(1.0)
                    for b in range(bursts):
                        burst = ids[b * BURST : (b + 1) * BURST] if b else ids[1:BURST]
                        before = succeeded(poll)
                        for agent_id in burst:
                            client.submit(agent_id, f"r{uuid.uuid4().hex[:12]}", None, operation="bench_noop")
                        wait_for("a burst", lambda: succeeded(poll) - before >= len(burst), procs, 120)  # noqa: B023
                        row = poll.execute(
                            "SELECT extract(epoch FROM started_at - created_at) FROM jobs WHERE agent_id = ANY(%s)"
                            " ORDER BY created_at LIMIT 1",
                            (burst,),
                        ).fetchone()
                        assert row is not None
                        delays.append(float(row[0]))
                        time.sleep(1.0)
            return delays
        finally:
            if celery is not None:
                celery.close()
            database.dispose()
            self.drop_database(db)


def succeeded(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM jobs WHERE status = 'succeeded'").fetchone()
    return int(row[0]) if row else 0


def missing_peers() -> list[str]:
    return [name for name in ("procrastinate", "dbos") if importlib.util.find_spec(name) is None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=1000, help="no-op jobs per run (default 1000)")
    parser.add_argument("--rounds", type=int, default=4, help="runs of each system per setting (default 4)")
    parser.add_argument("--processes", default="1,2", help="worker process counts, comma-separated (default 1,2)")
    parser.add_argument("--logs", default=".keel/bench-logs", help="where the workers' logs go")
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"which systems, comma-separated (default {','.join(SYSTEMS)})"
    )
    parser.add_argument("--no-burst", action="store_true", help="skip the burst measures")
    parser.add_argument(
        "--keel-threads",
        type=int,
        default=0,
        metavar="N",
        help="run each Keel worker process as a pool of N threads (`keel worker --pool threads -c N`) instead of"
        " prefork's one job per process, as bare Celery's run (default: prefork)",
    )
    args = parser.parse_args(argv)
    systems = tuple(s for s in args.systems.split(",") if s)
    if unknown := [s for s in systems if s not in SYSTEMS]:
        parser.error(f"--systems: unknown {', '.join(unknown)} (known: {', '.join(SYSTEMS)})")
    if args.jobs < 2 or args.rounds < 1:
        parser.error("--jobs must be at least 2 and --rounds at least 1")
    if not 0 <= args.keel_threads <= 200:
        parser.error("--keel-threads must be 0 (prefork) to 200")
    try:
        counts = [int(p) for p in args.processes.split(",")]
    except ValueError:
        parser.error(f"--processes: expected comma-separated whole numbers, got {args.processes!r}")
    if missing := [name for name in missing_peers() if name in systems]:
        print(
            f"bench-peers needs {', '.join(missing)}: pip install -e '.[bench]' (make bench-peers does)",
            file=sys.stderr,
        )
        return 2
    os.environ["BENCH_BROKER_URL"] = broker_url_for(Settings())  # read by bench.bare at import
    peers = Peers(args)
    os.environ["BENCH_BROKER_PREFIX"] = peers.prefix
    try:
        OUT.line(f"peers benchmark: {args.jobs} no-op jobs per run, {args.rounds} rounds, server {peers.server}")
        if args.keel_threads:
            OUT.line(f"Keel's worker processes each run a pool of {args.keel_threads} threads")
        table: dict[tuple[str, int], Run] = {}
        for n_processes in counts:
            runs: dict[str, list[Run]] = {s: [] for s in systems}
            for r in range(args.rounds):
                order = systems[r % len(systems) :] + systems[: r % len(systems)]  # who goes first rotates
                for system in order:
                    with OUT.task(f"{system}, {n_processes} process(es), round {r + 1}"):
                        run = (
                            peers.keel(n_processes)
                            if system == "keel"
                            else (peers.celery(n_processes) if system == "celery" else peers.peer(system, n_processes))
                        )
                    runs[system].append(run)
            for system in systems:
                table[system, n_processes] = median_run(runs[system])
            OUT.line(f"\n{n_processes} worker process{'es' if n_processes > 1 else ''}, median of {args.rounds}:")
            OUT.line(f"  {'system':<14}{'jobs/s':>8}{'first done':>12}{'commits/job':>13}   runs (jobs/s)")
            for system in systems:
                m = table[system, n_processes]
                each = ", ".join(f"{x.rate:.0f}" for x in runs[system])
                OUT.line(f"  {system:<14}{m.rate:8.0f}{m.first_done:11.2f}s{m.commits_per_job:13.1f}   {each}")
            if "keel" in systems:
                keel = table["keel", n_processes].rate
                for system in systems:
                    if system != "keel":
                        OUT.line(f"  keel / {system:<14}{keel / table[system, n_processes].rate:6.2f}x")
        bursts = (
            ()
            if args.no_burst or "keel" not in systems
            else (("through the dispatcher", False), ("published at submit", True))
        )
        for label, at_submit in bursts:
            delays = peers.keel_burst(at_submit)
            OUT.line(
                f"\nKeel, first job of a burst of {BURST}, submit -> start, {label}: median"
                f" {statistics.median(delays) * 1000:.0f} ms, max {max(delays) * 1000:.0f} ms (target: 100 ms)"
            )
        if {"keel", "celery", "procrastinate"} <= set(systems):
            # DBOS pays no broker on a backlog: it stays in the table as a reference, not a target.
            ahead = all(table["keel", p].rate > table["procrastinate", p].rate for p in counts)
            close = all(table["keel", p].rate >= 0.5 * table["celery", p].rate for p in counts)
            OUT.line(
                "\ntarget: Keel ahead of procrastinate at every process count -> "
                + ("met" if ahead else "NOT MET")
                + "\ntarget: Keel at least 0.5x bare Celery at every process count -> "
                + ("met" if close else "NOT MET")
            )
    finally:
        peers.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
