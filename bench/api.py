"""Benchmark: submits over HTTP (``keel serve``) beside ``Client.submit`` directly, on one database, in one run
(``make bench-api``; :data:`DESCRIPTION`, its ``--help``, says how it measures).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from uuid import UUID

import httpx
import psycopg
import redis

from agents.cli.progress import Progress
from agents.client import Client
from agents.ingress.tokens import create_token
from models import migrations
from models.audit_keys import audit_keys_for
from models.db import Database
from models.embedded import broker_url_for, database_url_for
from models.settings import Settings
from models.urls import libpq_url, with_database
from tasks.app import make_app, publisher

#: The benchmark's ``--help``: what it measures and how.
DESCRIPTION = """\
Benchmark: submits over HTTP (``keel serve``) beside ``Client.submit`` directly, on one database, in one run.

Both sides submit the same request (the ``plan`` operation, a small scripted input) from the same 8 threads, each
thread working through its own share of freshly created idle agents: one request per agent, so every submit is a
real ``idle -> planning`` transition that inserts the request's first job, and no other transition (a cancel to
reset the agent) runs inside the measured window. Agents are created before each run, outside the timing.

* direct: ``agents.client.Client.submit`` in this process (its database pool holds one connection per thread).
* HTTP: ``POST /v1/agents/{id}/requests`` (``Idempotency-Key`` = the request id, a producer token) to a real
  ``keel serve`` subprocess; each thread has its own keep-alive ``httpx.Client``. Then the same with
  ``keel serve --workers 2``.

Both publish the request's first job to the broker at once with Celery's publisher (``tasks.api:create`` passes it,
so the direct client gets it too); no worker runs, so the messages wait in Redis until the run deletes them. The
API's per-token rate limit is off for the run (``KEEL_API_RATE_LIMIT_ENABLED=false``): it would otherwise cap a
producer token at 50/s. Direct and HTTP runs alternate, so drift on the machine hits both alike; the bench client,
the server and PostgreSQL share the machine's cores.

Run with ``make bench-api`` (or ``python -m bench.api``). Uses KEEL_DATABASE_URL / KEEL_BROKER_URL's servers, else
the embedded ones; it creates and drops a database of its own and, on the broker's Redis database, uses (and then
deletes, SCAN + DEL) only keys under a prefix of its own (``KEEL_BROKER_PREFIX=keel-bench-api-…:``).
"""

OUT = Progress()  # live on a terminal, plain lines in a pipe or a file

ROOT = Path(__file__).resolve().parent.parent
KEEL = str(Path(sys.executable).parent / "keel")
INPUT = {"prompt": "hi", "script": [{"content": "done"}]}

Submit = Callable[[UUID, str], None]  # submits one request (its id) to one agent


@dataclass
class Result:
    count: int
    seconds: float
    latencies: list[float]

    @property
    def rate(self) -> float:
        return self.count / self.seconds

    def pct(self, p: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] * 1000


def merged(runs: list[Result]) -> Result:
    return Result(sum(r.count for r in runs), sum(r.seconds for r in runs), [x for r in runs for x in r.latencies])


def run_threads(submits: list[Submit], shares: list[list[UUID]]) -> Result:
    """Each thread submits one request to each agent of its share; all start together; the run lasts until the
    last thread is done."""
    barrier = threading.Barrier(len(submits) + 1)
    per_thread: list[list[float]] = [[] for _ in submits]
    errors: list[BaseException] = []

    def loop(n: int) -> None:
        lat, submit = per_thread[n], submits[n]
        barrier.wait()
        try:
            for agent_id in shares[n]:
                t0 = time.perf_counter()
                submit(agent_id, f"r-{uuid.uuid4().hex[:16]}")
                lat.append(time.perf_counter() - t0)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(n,)) for n in range(len(submits))]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    latencies = [x for lat in per_thread for x in lat]
    return Result(len(latencies), elapsed, latencies)


def direct_submit(client: Client) -> Submit:
    def submit(agent_id: UUID, request_id: str) -> None:
        client.submit(agent_id, request_id, INPUT, actor="bench", operation="plan")

    return submit


def http_submit(http: httpx.Client) -> Submit:
    def submit(agent_id: UUID, request_id: str) -> None:
        response = http.post(
            f"/v1/agents/{agent_id}/requests",
            json={"input": INPUT, "operation": "plan"},
            headers={"Idempotency-Key": request_id},
        )
        if response.status_code != 201:
            raise RuntimeError(f"submit answered {response.status_code}: {response.text}")

    return submit


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def serve(env: dict[str, str], logs: Path, workers: int = 1) -> Iterator[str]:
    """A ``keel serve`` subprocess with ``env`` on a free port, ready (``/readyz``); its URL. Stopped by its pid
    after (SIGTERM, then SIGKILL)."""
    port = free_port()
    log = logs / f"api-{workers}w.log"
    argv = [KEEL, "serve", "--port", str(port), "--workers", str(workers), "-l", "warning"]
    # Several processes need one console session key (keel serve refuses to start without).
    env = {"KEEL_CONSOLE_SESSION_KEY": "bench-" + "k" * 32, **env}
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=out, cwd=ROOT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"keel serve exited with {proc.returncode}; see {log}")
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"keel serve not ready in 60 s; see {log}")
            time.sleep(0.1)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        settings = Settings()
        self.args = args
        self.server = database_url_for(settings)
        self.db_name = f"keel_bench_api_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(libpq_url(with_database(self.server, "postgres")), autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{self.db_name}"')
        self.db_url = with_database(self.server, self.db_name)
        # The configured broker, shared with whoever else uses it: this run touches only keys under its own prefix,
        # and deletes only those afterwards.
        self.broker_url = broker_url_for(settings)
        self.prefix = f"keel-bench-api-{uuid.uuid4().hex[:8]}:"
        self.redis = redis.Redis.from_url(self.broker_url)
        self.logs = Path(args.logs)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
        self.env.update(
            {
                "PYTHONPATH": str(ROOT),
                "KEEL_DATABASE_URL": self.db_url,
                "KEEL_BROKER_URL": self.broker_url,
                "KEEL_BROKER_PREFIX": self.prefix,
                "KEEL_API_RATE_LIMIT_ENABLED": "false",
            }
        )
        migrations.upgrade(self.db_url)
        own = Settings(database_url=self.db_url, broker_url=self.broker_url, broker_prefix=self.prefix)
        self.celery = make_app(own)
        self.db = Database(self.db_url, pool_size=args.threads + 2, audit_keys=audit_keys_for(Settings()))
        self.client = Client(self.db, own, publisher=publisher(self.celery))
        _, self.secret = create_token(self.db, "bench-producer", ["producer"], actor="bench")
        self.agent_seq = 0

    def close(self) -> None:
        self.celery.close()
        self.db.dispose()
        keys = list(self.redis.scan_iter(match=self.prefix + "*", count=1000))
        for start in range(0, len(keys), 500):
            self.redis.delete(*keys[start : start + 500])
        self.redis.close()
        with psycopg.connect(libpq_url(with_database(self.server, "postgres")), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)')

    def shares(self, n: int) -> list[list[UUID]]:
        """``n`` new idle agents, dealt out to the threads (created from the threads: seeding is not measured)."""
        threads = self.args.threads
        names = [f"a{self.agent_seq + k}" for k in range(n)]
        self.agent_seq += n
        out: list[list[UUID]] = [[] for _ in range(threads)]

        def make(t: int) -> None:
            out[t] = [self.client.create_agent(name, actor="bench").id for name in names[t::threads]]

        threads_ = [threading.Thread(target=make, args=(t,)) for t in range(threads)]
        for t in threads_:
            t.start()
        for t in threads_:
            t.join()
        return out

    def api(self, workers: int) -> AbstractContextManager[str]:
        return serve(self.env, self.logs, workers)

    def scenario(self, workers: int) -> tuple[list[Result], list[Result]]:
        """Alternating direct and HTTP runs against one ``keel serve --workers N``."""
        args = self.args
        direct_runs: list[Result] = []
        http_runs: list[Result] = []
        with self.api(workers) as url:
            headers = {"Authorization": f"Bearer {self.secret}"}
            clients = [httpx.Client(base_url=url, headers=headers, timeout=30) for _ in range(args.threads)]
            try:
                http = [http_submit(c) for c in clients]
                direct = [direct_submit(self.client)] * args.threads
                # Warm-up: connections, prepared statements, imports, the server's pool, on both sides.
                run_threads(direct, self.shares(args.threads * 20))
                run_threads(http, self.shares(args.threads * 20))
                label = f"--workers {workers}: {args.rounds} rounds of {args.requests} submits each side"
                with OUT.task(label, total=2 * args.rounds) as step:
                    for r in range(args.rounds):
                        # Alternate which side goes first in a round, so neither always runs on a warmer machine.
                        order = [("direct", direct), ("http", http)]
                        for side, submits in order if r % 2 == 0 else order[::-1]:
                            result = run_threads(submits, self.shares(args.requests))
                            (direct_runs if side == "direct" else http_runs).append(result)
                            step.advance()
            finally:
                for c in clients:
                    c.close()
        return direct_runs, http_runs


def line(label: str, runs: list[Result]) -> str:
    m = merged(runs)
    rates = ", ".join(f"{r.rate:.0f}" for r in runs)
    return (
        f"  {label:<24} {m.rate:>6.0f} submits/s   p50 {m.pct(50):6.2f} ms   p95 {m.pct(95):6.2f} ms   "
        f"p99 {m.pct(99):6.2f} ms   (runs: {rates})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000, help="submits per measured run (default 1000)")
    parser.add_argument("--rounds", type=int, default=2, help="direct/HTTP alternations per scenario (default 2)")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="keel serve --workers to try")
    parser.add_argument("--logs", default=".keel/bench-logs", help="where the API's log goes")
    args = parser.parse_args(argv)
    bench = Bench(args)
    try:
        OUT.line(
            f"API benchmark on {bench.db_name}: {args.threads} threads, {args.requests} submits a run,"
            f" {args.rounds} rounds; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start"
        )
        OUT.line(
            "  each submit: plan operation, one fresh idle agent; first job published to the broker on both sides;"
            " rate limit off (KEEL_API_RATE_LIMIT_ENABLED=false)"
        )
        ratios = {}
        for workers in args.workers:
            direct, http = bench.scenario(workers)
            ratio = merged(http).rate / merged(direct).rate
            ratios[workers] = ratio
            OUT.line(f"\nkeel serve --workers {workers}, {args.threads} keep-alive clients")
            OUT.line(line("Client.submit (direct)", direct))
            OUT.line(line("HTTP POST .../requests", http))
            OUT.line(f"  ratio HTTP/direct        {ratio:.2f}x")
        best = max(ratios.values())
        first = ratios[args.workers[0]]
        OUT.line(
            f"\ntarget: HTTP at least 0.60x direct -> --workers {args.workers[0]}: {first:.2f}x"
            f" {'met' if first >= 0.6 else 'NOT MET'}" + (f"; best {best:.2f}x" if len(ratios) > 1 else "")
        )
        OUT.line(
            f"load average at the end {os.getloadavg()[0]:.1f}: the bench, the server and PostgreSQL share the cores"
        )
    finally:
        bench.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
