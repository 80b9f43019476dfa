"""Benchmark: the I/O workload — agent steps that wait on a model — for Keel beside bare Celery, procrastinate and
DBOS, on the same servers, in one run (``make bench-peers`` runs it after the no-op backlog; :data:`DESCRIPTION`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import psycopg

import bench.io_apps  # noqa: F401 - registers bench_wait here too: submits are checked against it
from agents.client import Client
from bench.peers import BIN, OUT, Peers, missing_peers, processes, wait_for
from models.db import Database
from models.embedded import broker_url_for
from models.settings import Settings
from models.urls import libpq_url, with_database

DESCRIPTION = """\
Benchmark: agent steps that wait on a model, Keel beside bare Celery, procrastinate and DBOS, in one run.

Each run: N jobs, each waiting T seconds — a sleep, or a real HTTP call to a local server that answers after T — taken
by ONE worker process with C jobs in flight: Keel's `keel worker -c C` (its default threads pool), bare Celery's
threads pool under Keel's Celery configuration, procrastinate's worker with concurrency C (an async task) and a DBOS
queue with worker concurrency C (the wait in a step). Systems alternate; each figure is the median of --rounds runs:

  jobs/s        completions, first to last
  worker CPU    the worker process's CPU (user + system, its children too) per job, over the run's busy window
  PG CPU        the PostgreSQL server's CPU (postmaster, its backends, those that exited) per job, same window
  connections   the most client connections the worker held on its database at once (sampled every 0.1 s)
  RSS           the worker process's peak resident memory (its children's too)

The busy window runs from T before the first completion to the last: the first jobs' claims are in it, the
workers' start-up is not. Then Keel alone with 1,000 in flight (10 s waits). Needs the bench extra (procrastinate,
DBOS): `make bench-peers` installs it. Uses KEEL_DATABASE_URL / KEEL_BROKER_URL's servers, else the embedded ones;
reads the PostgreSQL server's processes from /proc, so run it on the database's machine.
"""

SYSTEMS = ("keel", "celery", "procrastinate", "dbos")
#: The benchmark's own connection to a run's database (counting completions): not one of the worker's.
POLLER = "keel-bench-poll"


@dataclass(frozen=True, slots=True)
class IoRun:
    rate: float
    worker_cpu_ms: float
    pg_cpu_ms: float
    connections: int
    rss_mb: float


@dataclass(frozen=True, slots=True)
class Sample:
    at: float
    worker_cpu: float
    pg_cpu: float
    rss: int
    connections: int


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system + times.children_user + times.children_system)


class Postgres:
    """The PostgreSQL server's CPU, read from /proc: its postmaster (with the backends it reaped) and its live
    children."""

    def __init__(self, server_url: str) -> None:
        self.url = server_url
        with psycopg.connect(libpq_url(with_database(server_url, "postgres"))) as conn:
            row = conn.execute("SHOW data_directory").fetchone()
        assert row is not None
        pid = int((Path(str(row[0])) / "postmaster.pid").read_text().split()[0])
        self.postmaster = psutil.Process(pid)

    def cpu(self) -> float:
        total = _cpu(self.postmaster)
        for child in self.postmaster.children():
            try:
                times = child.cpu_times()
                total += times.user + times.system
            except psutil.NoSuchProcess:  # exited meanwhile: counted by its parent once it is reaped
                pass
        return total


class Sampler:
    """Samples the workers' CPU, memory and connections and the server's CPU every 0.1 s while a run goes on."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], postgres: Postgres, database: str | None) -> None:
        self.procs = [psutil.Process(p.pid) for p in procs]
        self.postgres = postgres
        self.database = database
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        conn = psycopg.connect(libpq_url(with_database(self.postgres.url, "postgres")), autocommit=True)
        try:
            while not self._stop.is_set():
                self.samples.append(self._sample(conn))
                self._stop.wait(0.1)
        finally:
            conn.close()

    def _sample(self, conn: psycopg.Connection[Any]) -> Sample:
        cpu, rss = 0.0, 0
        for proc in self.procs:
            try:
                family = [proc, *proc.children(recursive=True)]
                cpu += _cpu(proc) + sum(c.cpu_times().user + c.cpu_times().system for c in family[1:])
                rss += sum(member.memory_info().rss for member in family)
            except psutil.NoSuchProcess:
                pass
        connections = 0
        if self.database:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND backend_type = 'client backend'"
                " AND application_name <> %s",
                (self.database, POLLER),
            ).fetchone()
            connections = int(row[0]) if row else 0
        return Sample(time.time(), cpu, self.postgres.cpu(), rss, connections)

    def window(self, first: float, last: float) -> tuple[Sample, Sample]:
        before = [s for s in self.samples if s.at <= first] or self.samples[:1]
        after = [s for s in self.samples if s.at >= last] or self.samples[-1:]
        return before[-1], after[0]


class IoPeers:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.peers = Peers(argparse.Namespace(jobs=args.jobs, logs=args.logs, keel_threads=0))
        self.postgres = Postgres(self.peers.server)
        self.http_port = free_port()
        self.profiles = 0
        self.server: subprocess.Popen[bytes] | None = None

    def start_server(self) -> None:
        argv = [sys.executable, "-m", "bench.io_worker", "serve", str(self.http_port)]
        with open(Path(self.args.logs) / "slow-server.log", "ab") as out:
            self.server = subprocess.Popen(argv, env=self.peers.base_env, stdout=out, stderr=out)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.http_port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("the slow server did not start")

    def close(self) -> None:
        if self.server is not None:
            self.server.terminate()
            self.server.wait(10)
        self.peers.close()

    def url(self, mode: str) -> str | None:
        return f"http://127.0.0.1:{self.http_port}/" if mode == "http" else None

    def measure(
        self,
        system: str,
        workers: list[list[str]],
        env: dict[str, str],
        database: str | None,
        done: Any,
        *,
        n: int | None = None,
        seconds: float | None = None,
    ) -> IoRun:
        n, seconds = n or self.args.jobs, seconds or self.args.seconds
        with processes(workers, env, Path(self.args.logs) / f"io-{system}.log") as procs:
            with Sampler(procs, self.postgres, database) as sampler, self.profiled(system, procs, database):
                wait_for(f"the {system} I/O backlog", lambda: done.count() >= n, procs, 900)
                time.sleep(0.2)  # one sample past the last completion
        times = done.times()
        first, last = times[0], times[-1]
        a, b = sampler.window(first - seconds - 0.2, last)
        return IoRun(
            rate=(len(times) - 1) / (last - first),
            worker_cpu_ms=(b.worker_cpu - a.worker_cpu) * 1000 / n,
            pg_cpu_ms=(b.pg_cpu - a.pg_cpu) * 1000 / n,
            connections=max(s.connections for s in sampler.samples),
            rss_mb=max(s.rss for s in sampler.samples) / 2**20,
        )

    @contextlib.contextmanager
    def profiled(self, system: str, procs: list[subprocess.Popen[bytes]], database: str | None) -> Iterator[None]:
        """With ``--profile DIR``: py-spy samples the worker (from outside it, not slowing it: ``--nonblocking``)
        into DIR/<system>-<n>.txt (collapsed stacks, per thread), and where the server has pg_stat_statements, the
        run's statements by time go to DIR/<system>-<n>-statements.txt."""
        if not self.args.profile:
            yield
            return
        out = Path(self.args.profile)
        out.mkdir(parents=True, exist_ok=True)
        self.profiles += 1
        name = out / f"{system}-{self.profiles}"
        spy = subprocess.Popen(
            [
                str(BIN / "py-spy"),
                "record",
                "--pid",
                str(procs[0].pid),
                "--nonblocking",
                "--threads",
                "--idle",
                "--format",
                "raw",
                "--rate",
                "250",
                "-o",
                f"{name}.txt",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with psycopg.connect(libpq_url(with_database(self.postgres.url, "postgres")), autocommit=True) as conn:
            statements = bool(
                conn.execute("SELECT 1 FROM pg_extension WHERE extname = 'pg_stat_statements'").fetchone()
            )
            if statements:
                conn.execute("SELECT pg_stat_statements_reset()")
        try:
            yield
        finally:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
            if statements:
                with psycopg.connect(libpq_url(with_database(self.postgres.url, "postgres")), autocommit=True) as conn:
                    rows = conn.execute(
                        "SELECT calls, round(total_exec_time::numeric, 1), round(total_plan_time::numeric, 1),"
                        " rows, left(regexp_replace(query, '\\s+', ' ', 'g'), 300)"
                        " FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = %s"
                        " ORDER BY total_exec_time + total_plan_time DESC LIMIT 60",
                        (database,),
                    ).fetchall()
                Path(f"{name}-statements.txt").write_text(
                    "calls\texec ms\tplan ms\trows\tquery\n" + "".join("\t".join(map(str, r)) + "\n" for r in rows)
                )

    def keel(self, mode: str, concurrency: int, n: int | None = None, seconds: float | None = None) -> IoRun:
        from tasks.app import make_app, publisher

        n, seconds = n or self.args.jobs, seconds or self.args.seconds
        peers = self.peers
        db = peers.create_database("io-keel", template=peers.template)
        database = Database(with_database(peers.server, db), pool_size=2, audit_keys=peers.audit_keys)
        celery = make_app(Settings(broker_url=peers.broker_url, broker_prefix=peers.prefix))
        try:
            client = Client(database, publisher=publisher(celery))
            given = {"seconds": seconds, "url": self.url(mode)}
            for i in range(n):
                agent = client.create_agent(f"io-{i}")
                client.submit(agent.id, f"r{uuid.uuid4().hex[:12]}", given, operation="bench_wait")
            database.dispose()
            celery.close()
            env = {**peers.keel_env(db), "KEEL_IMPORTS": '["bench.io_apps"]'}
            node = f"io-{peers.run_id}@{socket.gethostname()}"
            worker = [str(BIN / "keel"), "worker", "-c", str(concurrency), "-n", node, "-l", "warning"]
            done = KeelDone(with_database(peers.server, db))
            return self.measure("keel", [worker], env, db, done, n=n, seconds=seconds)
        finally:
            celery.close()
            database.dispose()
            peers.drop_database(db)

    def celery(self, mode: str, concurrency: int) -> IoRun:
        from bench.bare import app, wait

        self.peers.redis.delete(self.peers.done_key)
        with app.producer_or_acquire() as producer:
            for _ in range(self.args.jobs):
                wait.apply_async((self.args.seconds, self.url(mode)), producer=producer)
        node = f"io-bare-{self.peers.run_id}@{socket.gethostname()}"
        worker = [str(BIN / "celery"), "-A", "bench.bare", "worker", "-P", "threads", "-c", str(concurrency)]
        worker += ["-Q", "bare", "-n", node, "-l", "warning", "--without-mingle", "--without-gossip"]
        return self.measure("celery", [worker], self.peers.base_env, None, RedisDone(self.peers))

    def peer(self, system: str, mode: str, concurrency: int) -> IoRun:
        from bench import io_apps

        peers = self.peers
        db = peers.create_database(f"io-{system}")
        env = {**peers.base_env, "BENCH_DATABASE_URL": libpq_url(with_database(peers.server, db))}
        try:
            peers.redis.delete(peers.done_key)
            setup = [sys.executable, "-m", "bench.io_worker", system, "setup", str(concurrency)]
            subprocess.run(setup, env=env, check=True, cwd=Path(__file__).parent.parent)
            io_apps.DATABASE = env["BENCH_DATABASE_URL"]
            enqueue = io_apps.enqueue_procrastinate if system == "procrastinate" else io_apps.enqueue_dbos
            enqueue(self.args.jobs, self.args.seconds, self.url(mode))
            worker = [sys.executable, "-m", "bench.io_worker", system, "worker", str(concurrency)]
            return self.measure(system, [worker], env, db, RedisDone(peers))
        finally:
            peers.drop_database(db)

    def run(self, system: str, mode: str) -> IoRun:
        c = self.args.concurrency
        if system == "keel":
            return self.keel(mode, c)
        if system == "celery":
            return self.celery(mode, c)
        return self.peer(system, mode, c)


class RedisDone:
    """Completions the peers recorded in Redis (bench.io_apps.record_done)."""

    def __init__(self, peers: Peers) -> None:
        self.peers = peers

    def count(self) -> int:
        return int(self.peers.redis.llen(self.peers.done_key))

    def times(self) -> list[float]:
        return sorted(float(t) for t in self.peers.redis.lrange(self.peers.done_key, 0, -1))


class KeelDone:
    """Keel's completions: its jobs' ``finished_at``."""

    def __init__(self, url: str) -> None:
        self.conn = psycopg.connect(libpq_url(url), autocommit=True, application_name=POLLER)

    def count(self) -> int:
        row = self.conn.execute("SELECT count(*) FROM jobs WHERE status = 'succeeded'").fetchone()
        return int(row[0]) if row else 0

    def times(self) -> list[float]:
        rows = self.conn.execute(
            "SELECT extract(epoch FROM finished_at) FROM jobs WHERE status = 'succeeded' ORDER BY finished_at"
        ).fetchall()
        self.conn.close()
        return [float(r[0]) for r in rows]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def targets(table: dict[str, IoRun]) -> list[str]:
    """The targets this workload is held to, each met or not, for the systems the run measured."""
    keel, out = table["keel"], []

    def said(what: str, ok: bool) -> None:
        out.append(f"  target: {what} -> {'met' if ok else 'NOT MET'}")

    if "celery" in table:
        celery = table["celery"]
        said(f"jobs/s at least 0.9x bare Celery ({keel.rate / celery.rate:.2f}x)", keel.rate >= 0.9 * celery.rate)
        ratio = keel.worker_cpu_ms / celery.worker_cpu_ms
        said(f"worker CPU per job within 1.5x bare Celery's ({ratio:.2f}x)", ratio <= 1.5)
    for peer in ("procrastinate", "dbos"):
        if peer in table:
            said(f"jobs/s ahead of {peer} ({keel.rate / table[peer].rate:.2f}x)", keel.rate > table[peer].rate)
    if "procrastinate" in table and table["procrastinate"].pg_cpu_ms > 0:
        ratio = keel.pg_cpu_ms / table["procrastinate"].pg_cpu_ms
        said(f"PostgreSQL CPU per job within 2x procrastinate's ({ratio:.2f}x)", ratio <= 2.0)
    return out


def median(runs: list[IoRun]) -> IoRun:
    return IoRun(
        statistics.median(r.rate for r in runs),
        statistics.median(r.worker_cpu_ms for r in runs),
        statistics.median(r.pg_cpu_ms for r in runs),
        max(r.connections for r in runs),
        statistics.median(r.rss_mb for r in runs),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=600, help="jobs per run (default 600)")
    parser.add_argument("--seconds", type=float, default=1.0, help="each job's wait (default 1.0)")
    parser.add_argument("--concurrency", type=int, default=200, help="jobs in flight per worker (default 200)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each system per mode (default 2)")
    parser.add_argument("--modes", default="sleep,http", help="sleep, http or both (default both)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="which systems (default all four)")
    parser.add_argument(
        "--thousand", type=int, default=3000, metavar="N", help="jobs of the 1,000-in-flight run (0: skip)"
    )
    parser.add_argument("--logs", default=".keel/bench-logs", help="where the workers' logs go")
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="sample each worker with py-spy (pip install py-spy) and, where the server has pg_stat_statements,"
        " record the run's statements: both into DIR (py-spy samples without pausing the worker)",
    )
    args = parser.parse_args(argv)
    systems = tuple(s for s in args.systems.split(",") if s)
    modes = tuple(m for m in args.modes.split(",") if m)
    if unknown := [s for s in systems if s not in SYSTEMS]:
        parser.error(f"--systems: unknown {', '.join(unknown)} (known: {', '.join(SYSTEMS)})")
    if bad := [m for m in modes if m not in ("sleep", "http")]:
        parser.error(f"--modes: unknown {', '.join(bad)} (known: sleep, http)")
    if args.jobs < 2 or args.rounds < 1 or args.seconds <= 0 or args.concurrency < 1:
        parser.error("--jobs must be at least 2, --rounds and --concurrency at least 1, --seconds above 0")
    if missing := [name for name in missing_peers() if name in systems]:
        print(f"bench needs {', '.join(missing)}: pip install -e '.[bench]' (make bench-peers does)", file=sys.stderr)
        return 2
    os.environ["BENCH_BROKER_URL"] = broker_url_for(Settings())
    bench = IoPeers(args)
    os.environ["BENCH_BROKER_PREFIX"] = bench.peers.prefix
    try:
        bench.start_server()
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        OUT.line(
            f"I/O workload: {args.jobs} jobs waiting {args.seconds:g}s, {args.concurrency} in flight in one worker"
            f" process, {args.rounds} rounds; load average before: {load}"
        )
        for mode in modes:
            runs: dict[str, list[IoRun]] = {s: [] for s in systems}
            for r in range(args.rounds):
                for system in systems[r % len(systems) :] + systems[: r % len(systems)]:
                    with OUT.task(f"{system}, {mode}, round {r + 1}"):
                        runs[system].append(bench.run(system, mode))
            table = {s: median(runs[s]) for s in systems}
            OUT.line(f"\n{mode}: median of {args.rounds} (jobs/s of each run in brackets)")
            OUT.line(f"  {'system':<14}{'jobs/s':>8}{'worker CPU':>12}{'PG CPU':>10}{'conns':>7}{'RSS':>9}")
            for s in systems:
                m = table[s]
                each = ", ".join(f"{x.rate:.0f}" for x in runs[s])
                OUT.line(
                    f"  {s:<14}{m.rate:8.1f}{m.worker_cpu_ms:9.2f} ms{m.pg_cpu_ms:7.2f} ms{m.connections:7d}"
                    f"{m.rss_mb:6.0f} MB   [{each}]"
                )
            if "keel" in table:
                keel = table["keel"]
                for s in systems:
                    if s != "keel":
                        o = table[s]
                        # (bare Celery has no database: its PostgreSQL figure is the server's idle hum)
                        pg = f", PG CPU {keel.pg_cpu_ms / o.pg_cpu_ms:.2f}x" if s != "celery" else ""
                        OUT.line(
                            f"  keel / {s:<14} jobs/s {keel.rate / o.rate:.2f}x,"
                            f" worker CPU {keel.worker_cpu_ms / o.worker_cpu_ms:.2f}x{pg}"
                        )
                for line in targets(table):
                    OUT.line(line)
        if args.thousand and "keel" in systems:
            with OUT.task(f"keel, 1,000 in flight, {args.thousand} jobs waiting 10 s"):
                big = bench.keel("sleep", 1000, args.thousand, 10.0)
            met = big.rate >= 90 and big.rss_mb <= 300 and big.connections <= 20
            OUT.line(
                f"\nKeel, 1,000 in flight in one process (10 s waits): {big.rate:.1f} jobs/s (target 90),"
                f" RSS {big.rss_mb:.0f} MB (target 300), {big.connections} connections (target 20),"
                f" worker CPU {big.worker_cpu_ms:.2f} ms/job\n  target: all three -> {'met' if met else 'NOT MET'}"
            )
        OUT.line(f"load average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        bench.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
