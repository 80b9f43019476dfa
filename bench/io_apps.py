"""The I/O workload of ``bench.io_peers``: a job that waits as an agent step waits on a model (``time.sleep``, or a
real HTTP call to a local server that answers after that long) in Keel (``bench_wait``), bare Celery (``bench.wait``
in bench/bare.py), procrastinate and DBOS, each recording its finish time in Redis under the run's key prefix (Keel's
are its jobs' ``finished_at``); and that slow server. Processes: ``python -m bench.io_worker serve PORT`` and
``python -m bench.io_worker {procrastinate|dbos} {setup|worker} CONCURRENCY``."""

from __future__ import annotations

import asyncio
import os
import time
from functools import cache
from typing import Any
from urllib.parse import parse_qs

import httpx
import redis

from agents.core.phases import Event
from agents.jobs.handlers import JobContext, JobResult, handler

DATABASE = os.environ.get("BENCH_DATABASE_URL", "")
BROKER = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("BENCH_BROKER_PREFIX", "keel-bench:")
DONE = PREFIX + "bench:done"
#: Connections a process may keep to the slow server: one per job in flight.
HTTP_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=2000)


@cache
def _http(pid: int) -> httpx.Client:
    return httpx.Client(limits=HTTP_LIMITS, timeout=60)


@cache
def _redis(pid: int) -> redis.Redis:
    return redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(BROKER, max_connections=64, timeout=60))


#: Tries of a call to the slow server: a keep-alive connection it closed as the call went out is tried again, as
#: every system's model client would.
TRIES = 3


def wait(seconds: float, url: str | None) -> None:
    """The step's wait: a real HTTP call to the slow server when ``url`` is given, else a sleep."""
    if not url:
        time.sleep(seconds)
        return
    for attempt in range(TRIES):
        try:
            _http(os.getpid()).get(url, params={"s": seconds}).raise_for_status()
            return
        except httpx.TransportError:
            if attempt == TRIES - 1:
                raise


def record_done() -> None:
    _redis(os.getpid()).rpush(DONE, time.time())


@handler("bench_wait", repeatable=True)  # a wait: run twice, it does no harm (not staged: docs/benchmarks.md)
def bench_wait(ctx: JobContext) -> JobResult:
    given = ctx.payload.get("input") or {}
    wait(float(given["seconds"]), given.get("url"))
    return JobResult(event=Event.FINISH)


# --- procrastinate: an async task, as procrastinate runs many at once ------------------------------------------


def procrastinate_app() -> Any:
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=DATABASE))
    client: list[httpx.AsyncClient] = []

    @app.task(name="bench_wait")  # type: ignore[untyped-decorator]
    async def bench_wait_task(seconds: float, url: str | None) -> None:
        if not url:
            await asyncio.sleep(seconds)
        else:
            if not client:
                client.append(httpx.AsyncClient(limits=HTTP_LIMITS, timeout=60))
            for attempt in range(TRIES):
                try:
                    (await client[0].get(url, params={"s": seconds})).raise_for_status()
                    break
                except httpx.TransportError:
                    if attempt == TRIES - 1:
                        raise
        await asyncio.to_thread(record_done)

    return app


def procrastinate_main(what: str, concurrency: int) -> None:
    app = procrastinate_app()
    if what == "setup":
        with app.open():
            app.schema_manager.apply_schema()
        return
    app.run_worker(concurrency=concurrency, install_signal_handlers=True)


def enqueue_procrastinate(n: int, seconds: float, url: str | None) -> None:
    app = procrastinate_app()
    with app.open():
        app.tasks["bench_wait"].batch_defer(*({"seconds": seconds, "url": url} for _ in range(n)))


# --- DBOS: a workflow whose wait is a step (checkpointed, as Keel's outcome is) ------------------------------


def dbos_main(what: str, concurrency: int) -> None:
    from dbos import DBOS

    DBOS(config={"name": "keel-bench-io", "system_database_url": DATABASE, "log_level": "WARNING"})

    @DBOS.step(name="bench_wait_step")  # type: ignore[untyped-decorator]
    def step(seconds: float, url: str | None) -> None:
        wait(seconds, url)

    @DBOS.workflow(name="bench_wait")  # type: ignore[untyped-decorator]
    def bench_wait_workflow(seconds: float, url: str | None) -> None:
        step(seconds, url)
        record_done()

    DBOS.launch()
    if what == "setup":
        DBOS.destroy()
        return
    DBOS.register_queue("bench_io", worker_concurrency=concurrency)
    while True:
        time.sleep(3600)


def enqueue_dbos(n: int, seconds: float, url: str | None) -> None:
    from dbos import DBOSClient

    client = DBOSClient(system_database_url=DATABASE)
    try:
        for _ in range(n):
            client.enqueue({"queue_name": "bench_io", "workflow_name": "bench_wait"}, seconds, url)
    finally:
        client.destroy()


# --- the slow server ------------------------------------------------------------------------------------------


async def slow_server(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An ASGI app that answers ``GET /?s=SECONDS`` after that many seconds, as a model endpoint would."""
    if scope["type"] != "http":
        return
    seconds = float(parse_qs(scope["query_string"].decode()).get("s", ["1"])[0])
    await asyncio.sleep(seconds)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"ok": true}'})


def serve(port: int) -> None:
    import uvicorn

    uvicorn.run(
        slow_server,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        backlog=4096,
        access_log=False,
        timeout_keep_alive=300,  # a client's idle connection is not closed under it between runs
    )


def main(argv: list[str]) -> None:
    if argv[0] == "serve":
        serve(int(argv[1]))
        return
    peer, what, concurrency = argv
    {"procrastinate": procrastinate_main, "dbos": dbos_main}[peer](what, int(concurrency))
