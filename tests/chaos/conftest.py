"""Real Celery worker and beat processes against the test's own database and Redis db, killed and restarted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest

from models.urls import libpq_url
from tests.support.audit import clean_env
from tests.support.broker import Broker
from tests.support.handlers import EXECUTIONS_DDL
from tests.support.logs import log_lines
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
KEEL = str(Path(sys.executable).parent / "keel")

# Short timeouts so that recovery happens within a test's patience.
FAST = {
    "KEEL_JOB_LEASE_SECONDS": "3",
    "KEEL_ENQUEUE_TIMEOUT_SECONDS": "4",
    "KEEL_DISPATCH_INTERVAL_SECONDS": "0.2",
    "KEEL_BEAT_LEASE_SECONDS": "3",
    "KEEL_DEADLINE_CHECK_SECONDS": "0.5",
    "KEEL_VISIBILITY_TIMEOUT_SECONDS": "10",
    "KEEL_RETRY_POLICY": json.dumps(
        {
            "transient": {"max_attempts": 3, "base_seconds": 0.2, "max_seconds": 1},
            "unknown": {"max_attempts": 2, "base_seconds": 0.2},
            "rate_limited": {"base_seconds": 0.2},
        }
    ),
}


__all__ = ["free_port"]  # this xdist worker's own range (tests/support/ports.py), imported from here by the tests


def wait_until(what: str, predicate: Callable[[], Any], timeout: float = 30.0, every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


class Stack:
    """Starts keel worker/beat/flower processes for one test and kills exactly those (and their children)."""

    def __init__(self, db_url: str, broker: Broker, logs: Path, *, admin_url: str | None = None) -> None:
        """The processes connect with ``db_url``; the test itself (its helper table, :meth:`query`) with
        ``admin_url`` (a superuser's; default: ``db_url``)."""
        self.db_url = db_url
        self.admin_url = admin_url or db_url
        self.broker = broker
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env = clean_env()
        self.env.update(FAST)
        self.env.update(
            {
                "KEEL_DATABASE_URL": db_url,
                **broker.env,
                "KEEL_IMPORTS": json.dumps(["tests.support.handlers"]),
                "PYTHONPATH": str(ROOT),
                "FLOWER_UNAUTHENTICATED_API": "true",
                # The pool the workers run in: the default (threads), or KEEL_TEST_WORKER_POOL=prefork to run the
                # whole chaos suite against prefork. A test that needs one pool names it when it starts a worker.
                "KEEL_WORKER_POOL": os.environ.get("KEEL_TEST_WORKER_POOL", "threads"),
            }
        )
        with psycopg.connect(libpq_url(self.admin_url), autocommit=True) as conn:
            conn.execute(EXECUTIONS_DDL)

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "ab") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [KEEL, *args], env={**self.env, **(env or {})}, stdout=log, stderr=log, cwd=self.logs
            )
        self.procs[name] = proc
        return proc

    def worker(
        self, name: str = "w1", concurrency: int = 1, queues: str | None = None, **env: str
    ) -> subprocess.Popen[bytes]:
        args = ["worker", "-c", str(concurrency), "-n", f"{name}@%h", "-l", "info"]
        if queues:
            args += ["-Q", queues]
        proc = self.start(name, *args, env=env)
        wait_until(f"worker {name} ready", lambda: b"ready." in (self.logs / f"{name}.log").read_bytes(), 60)
        return proc

    def beat(self, name: str = "beat", **env: str) -> subprocess.Popen[bytes]:
        return self.start(name, "beat", "-l", "info", env=env)

    def kill(self, name: str) -> None:
        """SIGKILL the process and every process it started, as if the machine died."""
        proc = self.procs.pop(name)
        try:
            family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        for member in family:
            try:
                member.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        proc.wait(timeout=10)
        psutil.wait_procs(family, timeout=10)

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.kill(name)

    def release(self, key: str) -> None:
        """Let the ``block`` handler (or tool) waiting on ``key`` finish."""
        with self.broker.redis() as client:
            client.set(self.broker.key(f"release:{key}"), 1)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(libpq_url(self.admin_url), autocommit=True) as conn:
            return conn.execute(sql, params).fetchall()


FAKETIME_SHIM = Path(__file__).parent / "faketime_shim"


def libfaketime_path() -> Path:
    """libfaketime as the ``libfaketime`` wheel (a dev dependency) ships it: no system package needed."""
    import libfaketime

    found = Path(libfaketime.__file__).parent / "vendor" / "libfaketime" / "src" / "libfaketime.so.1"
    assert found.exists(), f"libfaketime's shared library is missing at {found}"
    return found


def skewed(stack: Stack, offset: str) -> dict[str, str]:
    """Environment that runs a process (and its children) with its wall clock ``offset`` off, e.g. "+5m" or "-5m"
    (libfaketime; the monotonic clock is left alone, and a shim makes ``time.sleep`` work under it)."""
    return {
        "LD_PRELOAD": str(libfaketime_path()),
        "FAKETIME": offset,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "PYTHONPATH": f"{FAKETIME_SHIM}:{stack.env['PYTHONPATH']}",
    }


def clock_offset_in_log(stack: Stack, name: str) -> float:
    """Seconds between the clock of process ``name`` (its newest log line's timestamp) and this one's."""
    from datetime import UTC, datetime

    stamps = [line["timestamp"] for line in log_lines(stack.log(name)) if "timestamp" in line]
    assert stamps, f"{name} logged no timestamped line"
    return (datetime.fromisoformat(stamps[-1]) - datetime.now(UTC)).total_seconds()


#: The ways the processes a :class:`Stack` starts may reach the database: straight to PostgreSQL, or through a
#: PgBouncer in transaction mode (the session's, tests/support/pgbouncer.py). A module runs its scenarios on both by
#: overriding :func:`database_route` with ``params=ROUTES``.
ROUTES = ["direct", "pgbouncer"]


@pytest.fixture
def database_route() -> str:
    """How the stack's processes reach the database: straight, unless the module says otherwise (:data:`ROUTES`)."""
    return "direct"


@pytest.fixture
def stack(
    db_url: str, broker: Broker, tmp_path: Path, request: pytest.FixtureRequest, database_route: str
) -> Iterator[Stack]:
    if database_route == "pgbouncer":
        # The worker, beat and relay (and the producers a test starts with stack.env) go through PgBouncer; the
        # test's own reads (stack.query) and its in-process client go straight to the database.
        bouncer = request.getfixturevalue("pgbouncer")
        stack = Stack(bouncer.url(db_url), broker, tmp_path, admin_url=db_url)
        stack.env.update({"KEEL_DATABASE_POOLER": "transaction", "KEEL_DATABASE_DIRECT_URL": db_url})
    else:
        stack = Stack(db_url, broker, tmp_path)
    try:
        yield stack
    finally:
        stack.stop_all()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            for log in sorted(tmp_path.glob("*.log")):
                print(f"\n----- {log.name} (last 60 lines) -----")
                print("\n".join(log.read_text(errors="replace").splitlines()[-60:]))
            if database_route == "pgbouncer":
                print("\n----- pgbouncer.log (last 60 lines) -----")
                print("\n".join(request.getfixturevalue("pgbouncer").log().splitlines()[-60:]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{report.when}", report)
