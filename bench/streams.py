"""Benchmark: what idle live event streams cost the database and the plain requests beside them
(``make bench-streams``; :data:`DESCRIPTION`, its ``--help``, says how it measures).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import threading
import time
import uuid
from contextlib import AbstractContextManager, AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import psycopg
import redis

from agents.cli.progress import Progress
from agents.client import Client
from agents.ingress.tokens import create_token
from bench.api import serve
from models import migrations
from models.audit_keys import audit_keys_for
from models.db import Database
from models.embedded import broker_url_for, database_url_for
from models.settings import Settings
from models.urls import libpq_url, with_database

#: The benchmark's ``--help``: what it measures and how.
DESCRIPTION = """\
Benchmark: what idle live event streams cost the database and the plain requests beside them.

Starts a real ``keel serve`` on a database of its own, then measures twice in one run: with no stream open (the
baseline), and with N idle Server-Sent Event streams open (default 3,000, all of one producer token, spread over
``--agents`` agents that do not move). Each measure samples ``pg_stat_database.xact_commit + xact_rollback`` of that
database at the start and the end of a ``--seconds`` window in which nothing else runs (transactions per second),
then times ``--gets`` plain ``GET /v1/agents/{id}`` one after another (median and worst latency). The stream caps
are raised for the run (``KEEL_API_MAX_STREAMS_PER_TOKEN``/``_PER_PROCESS`` = N) and the rate limit is off; the
open-file limit of this process (and so of the server it starts) is raised to its hard limit. The bench client,
the server and PostgreSQL share the machine's cores.

Run with ``make bench-streams`` (or ``python -m bench.streams --streams 3000``). Uses KEEL_DATABASE_URL /
KEEL_BROKER_URL's servers, else the embedded ones; it creates and drops a database of its own, and touches only Redis
keys under a prefix of its own.
"""

OUT = Progress()
ROOT = Path(__file__).resolve().parent.parent
#: Streams opened at once while the run opens them.
OPENING = 50
#: Target: what N idle streams may cost the database (transactions per second above the baseline).
TARGET_TPS = 50.0


def raise_open_files(wanted: int) -> int:
    """Raise this process's soft open-file limit towards ``wanted`` (at most the hard limit); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    goal = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if goal > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (goal, hard))
        soft = goal
    return soft


def transactions(admin: psycopg.Connection[Any], db_name: str) -> int:
    row = admin.execute(
        "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s", (db_name,)
    ).fetchone()
    assert row is not None
    return int(row[0])


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        settings = Settings()
        self.args = args
        self.server = database_url_for(settings)
        self.db_name = f"keel_bench_streams_{uuid.uuid4().hex[:8]}"
        self.admin = psycopg.connect(libpq_url(with_database(self.server, "postgres")), autocommit=True)
        self.admin.execute(f'CREATE DATABASE "{self.db_name}"')
        self.db_url = with_database(self.server, self.db_name)
        self.broker_url = broker_url_for(settings)
        self.prefix = f"keel-bench-streams-{uuid.uuid4().hex[:8]}:"
        self.logs = Path(args.logs)
        self.logs.mkdir(parents=True, exist_ok=True)
        migrations.upgrade(self.db_url)
        self.db = Database(self.db_url, pool_size=2, audit_keys=audit_keys_for(Settings()))
        client = Client(self.db, Settings(database_url=self.db_url))
        self.agents = [client.create_agent(f"idle-{n}", actor="bench").id for n in range(args.agents)]
        _, self.watcher = create_token(self.db, "bench-watcher", ["producer"], actor="bench")
        _, self.reader = create_token(self.db, "bench-reader", ["auditor"], actor="bench")

    def close(self) -> None:
        self.db.dispose()
        with redis.Redis.from_url(self.broker_url) as keys:
            found = list(keys.scan_iter(match=self.prefix + "*", count=1000))
            if found:
                keys.delete(*found)
        self.admin.execute(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)')
        self.admin.close()

    def api(self) -> AbstractContextManager[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
        env.update(
            {
                "PYTHONPATH": self.args.server_code or str(ROOT),
                "KEEL_DATABASE_URL": self.db_url,
                "KEEL_BROKER_URL": self.broker_url,
                "KEEL_BROKER_PREFIX": self.prefix,
                "KEEL_API_RATE_LIMIT_ENABLED": "false",
                "KEEL_API_MAX_STREAMS_PER_TOKEN": str(max(1, self.args.streams)),
                "KEEL_API_MAX_STREAMS_PER_PROCESS": str(max(1, self.args.streams)),
            }
        )
        return serve(env, self.logs)

    def tps(self, label: str) -> float:
        seconds = self.args.seconds
        with OUT.task(f"{label}: transactions over {seconds:.0f} s", total=None):
            before, started = transactions(self.admin, self.db_name), time.monotonic()
            time.sleep(seconds)
            after, elapsed = transactions(self.admin, self.db_name), time.monotonic() - started
        return max(0.0, (after - before - 1) / elapsed)  # less the sampling statement's own transaction

    def latencies(self, url: str) -> list[float]:
        out: list[float] = []
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {self.reader}"}, timeout=60) as http:
            for n in range(self.args.gets):
                started = time.perf_counter()
                answer = http.get(f"/v1/agents/{self.agents[n % len(self.agents)]}")
                out.append(time.perf_counter() - started)
                if answer.status_code != 200:
                    raise RuntimeError(f"GET answered {answer.status_code}: {answer.text}")
        return out


async def hold_streams(
    url: str, secret: str, agents: list[uuid.UUID], count: int, opened: asyncio.Event, done: asyncio.Event
) -> None:
    """Open ``count`` streams (OPENING at a time), set ``opened``, keep them open and read until ``done``."""
    limits = httpx.Limits(max_connections=count + 10, max_keepalive_connections=0)
    timeout = httpx.Timeout(60, read=None)
    async with (
        httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {secret}"}, limits=limits, timeout=timeout
        ) as http,
        AsyncExitStack() as streams,
    ):
        gate = asyncio.Semaphore(OPENING)
        readers: list[asyncio.Task[None]] = []

        async def drain(response: httpx.Response) -> None:
            async for _ in response.aiter_raw():
                pass

        async def open_one(n: int) -> None:
            async with gate:
                response = await streams.enter_async_context(
                    http.stream("GET", f"/v1/agents/{agents[n % len(agents)]}/events")
                )
                if response.status_code != 200:
                    raise RuntimeError(f"stream {n} answered {response.status_code}: {(await response.aread())!r}")
                readers.append(asyncio.create_task(drain(response)))

        with OUT.task(f"opening {count} streams", total=count) as step:
            for batch in range(0, count, OPENING):
                await asyncio.gather(*(open_one(n) for n in range(batch, min(count, batch + OPENING))))
                step.advance(min(OPENING, count - batch))
        opened.set()
        await done.wait()
        for reader in readers:
            reader.cancel()


def summary(label: str, tps: float, lat: list[float]) -> str:
    ms = sorted(x * 1000 for x in lat)
    return (
        f"  {label:<22} {tps:8.1f} transactions/s   GET median {statistics.median(ms):7.1f} ms   worst {ms[-1]:7.1f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=3000, help="idle streams to hold open (default 3000)")
    parser.add_argument("--agents", type=int, default=100, help="agents the streams follow (default 100)")
    parser.add_argument("--seconds", type=float, default=45.0, help="length of each sampling window (default 45)")
    parser.add_argument("--gets", type=int, default=200, help="plain GETs timed after each window (default 200)")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds to wait before each window (default 15)")
    parser.add_argument(
        "--server-code",
        help="serve the keel package found here instead (e.g. `git archive <commit> | tar -x -C DIR`: a before/after)",
    )
    parser.add_argument("--logs", default=".keel/bench-logs", help="where the API's log goes")
    args = parser.parse_args(argv)
    limit = raise_open_files(args.streams * 2 + 1024)  # the server's sockets and this client's
    if limit < args.streams * 2 + 256:
        OUT.line(f"warning: the open-file limit is {limit}: too low for {args.streams} streams on both ends")
    bench = Bench(args)
    try:
        with bench.api() as url:
            OUT.line(
                f"stream benchmark on {bench.db_name}: {args.streams} idle streams of one token over"
                f" {args.agents} agents; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"
            )
            bench.latencies(url)  # warm-up: the server's pool, prepared statements
            time.sleep(args.settle)
            base_tps = bench.tps("no streams")
            base_lat = bench.latencies(url)
            loop_result = _with_streams(bench, url)
        tps, lat = loop_result
        OUT.line(summary("no streams (baseline)", base_tps, base_lat))
        OUT.line(summary(f"{args.streams} idle streams", tps, lat))
        cost = tps - base_tps
        OUT.line(
            f"\ntarget: {args.streams} idle streams cost the database under {TARGET_TPS:.0f} transactions/s ->"
            f" {cost:.1f}/s {'met' if cost < TARGET_TPS else 'NOT MET'}"
        )
        OUT.line(f"load average at the end {os.getloadavg()[0]:.1f}")
    finally:
        bench.close()
    return 0


def _with_streams(bench: Bench, url: str) -> tuple[float, list[float]]:
    """Open the streams in a thread of their own (an event loop), measure meanwhile, then close them."""

    loop = asyncio.new_event_loop()
    opened, done = asyncio.Event(), asyncio.Event()
    failure: list[BaseException] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(hold_streams(url, bench.watcher, bench.agents, bench.args.streams, opened, done))
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    while not opened.is_set() and thread.is_alive():
        time.sleep(0.2)
    if failure:
        raise failure[0]
    try:
        time.sleep(bench.args.settle)  # what opening them set going settles (their tokens' last use, first reads)
        tps = bench.tps(f"{bench.args.streams} streams")
        lat = bench.latencies(url)
    finally:
        loop.call_soon_threadsafe(done.set)
        thread.join(60)
    return tps, lat


if __name__ == "__main__":
    sys.exit(main())
