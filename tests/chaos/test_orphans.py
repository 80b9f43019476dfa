"""Nothing `keel up` or `keel demo` starts outlives it — worker, beat, the HTTP API: not when it is SIGKILLed (the
kernel's parent-death signal ends its children), and not when the demo gets SIGTERM or SIGHUP (it stops its worker,
beat and API, then exits)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import psutil
import psycopg
import pytest

from agents.cli.supervisor import ORPHAN_GRACE_SECONDS
from agents.client import Client
from models.urls import libpq_url
from tests.chaos.conftest import free_port, wait_until
from tests.support.audit import clean_env
from tests.support.broker import Broker
from tests.support.handlers import EXECUTIONS_DDL

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.chaos
KEEL = str(Path(sys.executable).parent / "keel")


def _start(db_url: str, broker: Broker, log: Path, *args: str, **more: str) -> subprocess.Popen[bytes]:
    env = clean_env()
    env.update({"KEEL_DATABASE_URL": db_url, **broker.env, "KEEL_HOME": str(log.parent / ".keel"), **more})
    env["KEEL_API_METRICS_PORT"] = str(free_port())  # not the default 9810: tests run side by side
    with open(log, "wb") as out:
        return subprocess.Popen([KEEL, *args], env=env, stdout=out, stderr=out, cwd=log.parent)


def _family(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _commands(family: list[psutil.Process]) -> set[str]:
    """The keel subcommands these processes run (``python -m agents worker|beat|serve``)."""
    lines = [p.cmdline() for p in family]
    return {line[line.index("agents") + 1] for line in lines if "agents" in line[:-1]}


def _named(alive: list[psutil.Process]) -> list[str]:
    """Who outlived the supervisor: pid and command line, so a failure says which child lingered."""
    named = []
    for proc in alive:
        try:
            named.append(f"{proc.pid} {' '.join(proc.cmdline())} ({proc.status()})")
        except psutil.NoSuchProcess:
            named.append(f"{proc.pid} (gone since)")
    return named


def _cleanup(proc: subprocess.Popen[bytes], family: list[psutil.Process]) -> None:
    """Only if the test failed: leave nothing behind."""
    if proc.poll() is None:
        family += _family(proc.pid)
        proc.kill()
        proc.wait()
    for orphan in family:
        try:
            orphan.kill()
        except psutil.NoSuchProcess:
            pass


def test_a_sigkilled_keel_up_leaves_no_orphans(db_url: str, broker: Broker, tmp_path: Path) -> None:
    log = tmp_path / "up.log"
    up = _start(db_url, broker, log, "up", "--no-flower", "--api-port", str(free_port()))
    family: list[psutil.Process] = []
    try:
        wait_until("keel up to run", lambda: "running" in log.read_text() or up.poll() is not None, 120, every=0.2)
        assert up.poll() is None, log.read_text()
        family = _family(up.pid)
        assert {"worker", "beat", "serve"} <= _commands(family), [p.cmdline() for p in family]
        up.kill()  # no handler runs: only the kernel can tell the children
        up.wait()
        _gone, alive = psutil.wait_procs(family, timeout=60)
        assert alive == [], f"outlived a SIGKILLed keel up: {_named(alive)}"
    finally:
        _cleanup(up, family)


def test_a_sigkilled_keel_up_with_a_job_running_leaves_no_orphans(
    db_url: str, broker: Broker, client: Client, tmp_path: Path
) -> None:
    """The kernel's SIGTERM starts a warm shutdown, which waits for the running job (here: forever): once orphaned,
    a child kills its own group after ORPHAN_GRACE_SECONDS."""
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        conn.execute(EXECUTIONS_DDL)
    log = tmp_path / "up.log"
    imports = {"KEEL_IMPORTS": '["tests.support.handlers"]', "PYTHONPATH": str(ROOT)}
    up = _start(db_url, broker, log, "up", "--no-flower", "--api-port", str(free_port()), **imports)
    family: list[psutil.Process] = []
    try:
        wait_until("keel up to run", lambda: "running" in log.read_text() or up.poll() is not None, 120, every=0.2)
        assert up.poll() is None, log.read_text()
        agent = client.create_agent("held")
        client.submit(agent.id, "req-held", None, operation="block")
        started = "SELECT count(*) FROM executions WHERE phase = 'start'"
        with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
            wait_until("the blocking job to start", lambda: conn.execute(started).fetchone() == (1,), 60)
        family = _family(up.pid)
        up.kill()
        up.wait()
        _gone, alive = psutil.wait_procs(family, timeout=ORPHAN_GRACE_SECONDS + 30)
        assert alive == [], f"outlived a SIGKILLed keel up by {ORPHAN_GRACE_SECONDS + 30}s: {_named(alive)}"
    finally:
        _cleanup(up, family)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stopped_demo_stops_its_worker_and_beat(
    db_url: str, broker: Broker, tmp_path: Path, sig: signal.Signals
) -> None:
    log = tmp_path / "demo.log"
    demo = _start(db_url, broker, log, "demo")
    family: list[psutil.Process] = []
    try:
        wait_until(
            "the demo to submit its requests",
            lambda: "submitting 8 scripted requests" in log.read_text() or demo.poll() is not None,
            120,
            every=0.1,
        )
        assert demo.poll() is None, log.read_text()
        family = _family(demo.pid)
        assert {"worker", "beat", "serve"} <= _commands(family), [p.cmdline() for p in family]
        demo.send_signal(sig)
        assert demo.wait(timeout=90) == 128 + sig, log.read_text()
        assert f"stopped by {sig.name}" in log.read_text()
        _gone, alive = psutil.wait_procs(family, timeout=30)
        assert alive == [], f"outlived the demo: {_named(alive)}"
    finally:
        _cleanup(demo, family)


def test_a_sigkilled_demo_leaves_no_orphans(db_url: str, broker: Broker, tmp_path: Path) -> None:
    log = tmp_path / "demo.log"
    demo = _start(db_url, broker, log, "demo")
    family: list[psutil.Process] = []
    try:
        wait_until(
            "the demo to submit its requests",
            lambda: "submitting 8 scripted requests" in log.read_text() or demo.poll() is not None,
            120,
            every=0.1,
        )
        family = _family(demo.pid)
        assert {"worker", "beat", "serve"} <= _commands(family), [p.cmdline() for p in family]
        demo.kill()
        demo.wait()
        _gone, alive = psutil.wait_procs(family, timeout=60)
        assert alive == [], f"outlived a SIGKILLed demo: {_named(alive)}"
    finally:
        _cleanup(demo, family)
