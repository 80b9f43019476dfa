"""kombu's Redis transport on a lost connection, on a bare Celery worker (no Keel code but the guard under test).

A worker with room for another message (a BRPOP in flight) that holds an unacknowledged one loses Redis: without
:func:`tasks.kombu_guard.guard_redis_transport`, Celery's cleanup of the lost connection restores the message through
a transport it has already detached, and the worker stops with ``Unrecoverable error: AttributeError("'NoneType'
object has no attribute 'hostname'")``. With it, the worker reconnects, acks the message it held and takes the next.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis
from celery import Celery

from tests.chaos.conftest import ROOT, wait_until
from tests.support.audit import clean_env

CRASH = "Unrecoverable error: AttributeError(\"'NoneType' object has no attribute 'hostname'\")"

#: Keel's broker settings that matter here (tasks/app.py): late acks, one message per process, running tasks kept
#: through a lost connection, a key prefix, bounded socket waits.
BARE_APP = '''
import os
import time
from pathlib import Path

from celery import Celery

if os.environ.get("BARE_GUARD"):
    from tasks.kombu_guard import guard_redis_transport

    guard_redis_transport()

app = Celery("bare", broker=os.environ["BARE_BROKER_URL"])
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
    worker_cancel_long_running_tasks_on_connection_loss=False,
    broker_connection_retry_on_startup=True,
    broker_transport_options={
        "visibility_timeout": 60,
        "global_keyprefix": "bare:",
        "socket_timeout": 5,
        "socket_connect_timeout": 5,
    },
)


@app.task(name="bare.hold")
def hold(gate):
    """Runs until the file ``gate`` exists (60 s at most)."""
    Path(gate + ".running").touch()
    deadline = time.monotonic() + 60
    while not Path(gate).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
'''


@contextmanager
def bare_worker(tmp_path: Path, broker_url: str, *, guarded: bool) -> Iterator[subprocess.Popen[bytes]]:
    """``celery worker`` on the bare app, two processes (as ``keel worker``), gossip and mingle off (likewise)."""
    (tmp_path / "bare_app.py").write_text(BARE_APP)
    env = {**clean_env(), "PYTHONPATH": f"{tmp_path}:{ROOT}", "BARE_BROKER_URL": broker_url}
    if guarded:
        env["BARE_GUARD"] = "1"
    argv = ["worker", "-c", "2", "-n", "bare@%h", "-l", "info", "--without-mingle", "--without-gossip"]
    with open(tmp_path / "worker.log", "ab") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "bare_app", *argv], env=env, stdout=log, stderr=log, cwd=tmp_path
        )
    try:
        yield proc
    finally:
        try:
            family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        for member in family:
            try:
                member.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait(timeout=10)
        psutil.wait_procs(family, timeout=10)


def send(broker_url: str, gate: Path) -> None:
    producer = Celery("bare-producer", broker=broker_url)
    producer.conf.broker_transport_options = {"global_keyprefix": "bare:"}
    try:
        producer.send_task("bare.hold", args=[str(gate)])
    finally:
        producer.close()


def in_brpop(broker_url: str) -> bool:
    """Whether a client is blocked in BRPOP on this server: the worker waiting for its next message."""
    with redis.Redis.from_url(broker_url) as client:
        clients: list[dict[str, Any]] = client.client_list()
    return any(c.get("cmd") == "brpop" and "b" in c.get("flags", "") for c in clients)


def reconnecting_or_crashed(log: Path) -> str | None:
    """The worker's log once it says it is trying to reconnect or that it crashed."""
    text = log.read_text()
    return text if "Cannot connect to" in text or CRASH in text else None


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_a_worker_that_loses_redis_while_it_holds_a_message_reconnects(
    own_redis: dict[str, Any], tmp_path: Path, guarded: bool
) -> None:
    """The unguarded case shows the bug is still there (and the reproduction still reaches it): once kombu fixes
    it, that case fails, and the guard goes (tasks/kombu_guard.py)."""
    url = own_redis["url"]
    log = tmp_path / "worker.log"
    with bare_worker(tmp_path, url, guarded=guarded) as worker:
        wait_until("the worker to be ready", lambda: "ready." in log.read_text(), 60)
        send(url, tmp_path / "first")
        wait_until("the task to run", (tmp_path / "first.running").exists, 30, every=0.02)
        # One of its two processes is free: the worker asks Redis for the next message (BRPOP) while it holds this
        # one unacknowledged. Both are needed: closing the channel first fails on the BRPOP's dead connection.
        wait_until("the worker to wait for the next message", lambda: in_brpop(url), 30, every=0.02)
        own_redis["stop"]()

        # Celery tries to reconnect only once it has closed the lost connection: past the point of the crash.
        text = wait_until("the worker to try to reconnect, or to crash", lambda: reconnecting_or_crashed(log), 60)
        if not guarded:
            assert CRASH in text, text[-4000:]
            return
        assert CRASH not in text and worker.poll() is None, text[-4000:]
        own_redis["start"]()
        wait_until("the worker to reconnect", lambda: log.read_text().count("Connected to") == 2, 60)
        (tmp_path / "first").touch()
        (tmp_path / "second").touch()
        send(url, tmp_path / "second")
        wait_until("both tasks to finish", lambda: log.read_text().count("succeeded in") == 2, 60)
        text = log.read_text()
        assert worker.poll() is None, text[-4000:]
        # The held message's ack went through the old channel's kept connection parameters to the restarted Redis.
        assert "Couldn't ack" not in text and "Unrecoverable" not in text, text[-4000:]
