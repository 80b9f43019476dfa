"""The peers of ``bench.peers``: a no-op job in procrastinate and in DBOS Transact, each on a PostgreSQL database of
its own, recording its finish time in Redis under the run's key prefix (as ``bench.bare`` does for bare Celery). Run
as ``python -m bench.peer_worker {procrastinate|dbos} {setup|worker}`` with ``BENCH_DATABASE_URL``,
``BENCH_BROKER_URL`` and ``BENCH_BROKER_PREFIX`` set; ``setup`` creates the peer's schema, ``worker`` runs one worker
process until it is terminated. Both peers come from the optional ``bench`` extra (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import os
import time
from functools import cache
from typing import Any

import redis

DATABASE = os.environ.get("BENCH_DATABASE_URL", "")
BROKER = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("BENCH_BROKER_PREFIX", "keel-bench:")
DONE = PREFIX + "bench:done"


@cache
def _redis(pid: int) -> redis.Redis:
    # DBOS runs many workflows of a process at once, in threads: they wait their turn for a connection.
    return redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(BROKER, max_connections=8, timeout=60))


def record_done() -> None:
    _redis(os.getpid()).rpush(DONE, time.time())


def procrastinate_app() -> Any:
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=DATABASE))

    @app.task(name="bench_noop")  # type: ignore[untyped-decorator]
    def bench_noop(i: int) -> None:
        record_done()

    return app


def procrastinate_main(what: str) -> None:
    app = procrastinate_app()
    if what == "setup":
        with app.open():
            app.schema_manager.apply_schema()
        return
    # One process, one job at a time: the same shape as a Celery worker process with prefetch 1.
    app.run_worker(concurrency=1, install_signal_handlers=True)


def dbos_main(what: str) -> None:
    from dbos import DBOS

    DBOS(config={"name": "keel-bench", "system_database_url": DATABASE, "log_level": "WARNING"})

    @DBOS.workflow(name="bench_noop")  # type: ignore[untyped-decorator]
    def bench_noop(i: int) -> None:
        record_done()

    DBOS.launch()  # creates (setup) or checks the system database
    if what == "setup":
        DBOS.destroy()
        return
    DBOS.register_queue("bench")  # the peer's defaults: its own polling interval and concurrency
    while True:
        time.sleep(3600)


def enqueue_procrastinate(n: int) -> None:
    app = procrastinate_app()
    with app.open():
        task = app.tasks["bench_noop"]
        task.batch_defer(*({"i": i} for i in range(n)))


def enqueue_dbos(n: int) -> None:
    from dbos import DBOSClient

    client = DBOSClient(system_database_url=DATABASE)
    try:
        for i in range(n):
            client.enqueue({"queue_name": "bench", "workflow_name": "bench_noop"}, i)
    finally:
        client.destroy()


def main(argv: list[str]) -> None:
    peer, what = argv
    {"procrastinate": procrastinate_main, "dbos": dbos_main}[peer](what)
