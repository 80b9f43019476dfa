"""`keel up` runs worker, beat, the HTTP API and Flower together: it says "running" only once all of them are (the API
once /readyz answers 200), stops all of them on every termination signal, refuses a taken API or Flower port in one
line, and gives up when a server stays away."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest

from models import migrations
from models.embedded import redis_executable
from tests.chaos.conftest import free_port, wait_until
from tests.support.audit import clean_env
from tests.support.broker import Broker

pytestmark = pytest.mark.chaos
KEEL = str(Path(sys.executable).parent / "keel")


@contextmanager
def keel_up(db_url: str, broker_env: dict[str, str], log: Path, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """``keel up ARGS``; without --api-port or --no-api, the API on a free port (not 8000, which may be taken); the
    worker's and the beat's metrics too, unless given or --no-metrics."""
    if "--api-port" not in args and "--no-api" not in args:
        args = ("--api-port", str(free_port()), *args)
    if "--worker-metrics-port" not in args and "--no-metrics" not in args:
        args = ("--worker-metrics-port", str(free_port()), "--beat-metrics-port", str(free_port()), *args)
    if "--api-metrics-port" not in args and "--no-metrics" not in args and "--no-api" not in args:
        args = ("--api-metrics-port", str(free_port()), *args)  # not the default 9810: tests run side by side
    if "--flower-port" not in args and "--no-flower" not in args:
        args = ("--flower-port", str(free_port()), *args)
    env = clean_env()
    env.update({"KEEL_DATABASE_URL": db_url, **broker_env, "FLOWER_UNAUTHENTICATED_API": "true"})
    with open(log, "wb") as out:
        up = subprocess.Popen([KEEL, "up", *args], env=env, stdout=out, stderr=out, cwd=log.parent)
    try:
        yield up
    finally:
        family = []
        if up.poll() is None:
            family = psutil.Process(up.pid).children(recursive=True)
            up.kill()
            up.wait()
        for orphan in family:  # only if the test failed: leave nothing behind
            try:
                orphan.kill()
            except psutil.NoSuchProcess:
                pass


def running(up: subprocess.Popen[bytes], log: Path) -> None:
    wait_until(
        "keel up to say it is running",
        lambda: "; Ctrl-C stops them" in log.read_text() or up.poll() is not None,
        120,
        every=0.2,
    )
    assert up.poll() is None, log.read_text()


@pytest.mark.parametrize(
    ("sig", "flower"),
    [(signal.SIGINT, True), (signal.SIGHUP, True), (signal.SIGTERM, False), (signal.SIGQUIT, False)],
    ids=["SIGINT", "SIGHUP", "SIGTERM-no-flower", "SIGQUIT-no-flower"],
)
def test_every_termination_signal_stops_the_whole_stack(
    db_url: str, broker: Broker, tmp_path: Path, sig: signal.Signals, flower: bool
) -> None:
    port, api_port = free_port(), free_port()
    api = f"http://127.0.0.1:{api_port}"
    log = tmp_path / "up.log"
    args = ["--api-port", str(api_port), *(["--flower-port", str(port)] if flower else ["--no-flower"])]
    with keel_up(db_url, broker.env, log, *args) as up:
        running(up, log)
        if flower:
            assert f"worker, beat, api, flower running (API: {api}, docs at {api}/docs; Flower: " in log.read_text()
            # "running" means Flower has bound its port already: no waiting here.
            assert httpx.get(f"http://127.0.0.1:{port}/healthcheck", timeout=5).text == "OK"
        else:
            assert f"worker, beat, api running (API: {api}, docs at {api}/docs); Ctrl-C" in log.read_text()
        # "running" means the API said it is ready (database migrated, broker reachable): no waiting here either.
        assert httpx.get(f"{api}/readyz", timeout=5).status_code == 200
        children = psutil.Process(up.pid).children()
        assert len(children) == (4 if flower else 3), [c.cmdline() for c in children]
        (served,) = [c for c in children if "serve" in c.cmdline()]
        family = psutil.Process(up.pid).children(recursive=True)  # the worker's pool processes too
        up.send_signal(sig)
        assert up.wait(timeout=90) == 0, log.read_text()
        _gone, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, f"left running after {sig.name}: {[(p.pid, p.cmdline()) for p in alive]}"
        assert not served.is_running()
        assert f"keel up: {sig.name} received" in log.read_text()
        # The API stopped as uvicorn stops (SIGQUIT included: it is sent SIGTERM), not killed after --stop-timeout.
        finished = r"^api    \| .*\[info\s*\] Finished server process .*\[uvicorn\.error\]"  # readable lines
        assert re.search(finished, log.read_text(), re.M)
        assert "did not stop within" not in log.read_text()


def test_up_migrates_a_configured_database_when_given_migrate_and_says_so(
    db_url: str, broker: Broker, tmp_path: Path
) -> None:
    """Without --migrate it refuses such a database (tests/integration/test_db_revisions.py)."""
    previous, head = migrations.revisions()[-2], migrations.head()
    migrations.downgrade(db_url, previous)
    log = tmp_path / "up.log"
    with keel_up(db_url, broker.env, log, "--no-flower", "--migrate") as up:
        running(up, log)
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=90) == 0, log.read_text()
    assert log.read_text().splitlines()[0] == f"database: migrated {previous} → {head}"
    assert migrations.revision_at(db_url) == head


def test_up_serves_metrics_from_the_api_the_worker_and_the_beat_and_says_where(
    db_url: str, broker: Broker, tmp_path: Path
) -> None:
    api_port, api_metrics_port, worker_port, beat_port = free_port(), free_port(), free_port(), free_port()
    log = tmp_path / "up.log"
    ports = ["--worker-metrics-port", str(worker_port), "--beat-metrics-port", str(beat_port)]
    ports += ["--api-metrics-port", str(api_metrics_port)]
    with keel_up(db_url, broker.env, log, "--no-flower", "--api-port", str(api_port), *ports) as up:
        running(up, log)
        urls = [
            f"http://127.0.0.1:{api_metrics_port}/metrics (api)",
            f"http://127.0.0.1:{worker_port}/metrics (worker)",
            f"http://127.0.0.1:{beat_port}/metrics (beat)",
        ]
        assert f"keel up: metrics at {', '.join(urls)}" in log.read_text()
        for url in urls:
            answer = httpx.get(url.split(" ")[0], timeout=30)
            assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain"), url
        # The API's own probes (/readyz) are among its requests already; its public port serves no metrics.
        assert 'route="/readyz"' in httpx.get(f"http://127.0.0.1:{api_metrics_port}/metrics", timeout=30).text
        assert httpx.get(f"http://127.0.0.1:{api_port}/metrics", timeout=30).status_code == 404
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=90) == 0, log.read_text()


@pytest.mark.parametrize(("name", "command"), [("beat", "beat"), ("api", "serve")])
def test_a_child_killed_from_outside_is_named_with_its_signal(
    db_url: str, broker: Broker, tmp_path: Path, name: str, command: str
) -> None:
    """Before: `beat exited with status -9: [… INFO] this beat is the leader; stopped the rest`."""
    log = tmp_path / "up.log"
    with keel_up(db_url, broker.env, log, "--no-flower") as up:
        running(up, log)
        family = psutil.Process(up.pid).children(recursive=True)
        (child,) = [c for c in psutil.Process(up.pid).children() if command in c.cmdline()]
        child.kill()
        assert up.wait(timeout=90) == 1, log.read_text()
        _gone, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, f"left running: {[(p.pid, p.cmdline()) for p in alive]}"
    assert log.read_text().splitlines()[-1] == f"keel: error: {name} was killed by SIGKILL; stopped the rest"


@pytest.mark.parametrize("taken", ["api", "flower"])
def test_a_taken_port_is_one_line_and_starts_nothing(db_url: str, broker: Broker, tmp_path: Path, taken: str) -> None:
    log = tmp_path / "up.log"
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with keel_up(db_url, broker.env, log, f"--{taken}-port", str(port)) as up:
            assert up.wait(timeout=60) == 1
    out = log.read_text()
    assert out == (
        f"keel: error: port {port} is taken by another process: pick another with --{taken}-port, or use --no-{taken}\n"
    )


def test_an_api_port_taken_after_the_check_is_the_same_one_line(db_url: str, broker: Broker, tmp_path: Path) -> None:
    """uvicorn lost the race for its port: before, this quoted its last line (`INFO: Application shutdown complete.`,
    which follows its bind error)."""
    port = free_port()
    log = tmp_path / "up.log"
    with keel_up(db_url, broker.env, log, "--no-flower", "--api-port", str(port)) as up:
        # The children start after the port checks; uvicorn binds only once it has imported the app.
        wait_until(
            "keel up to start its children", lambda: psutil.Process(up.pid).children() or up.poll(), 60, every=0.02
        )
        with socket.socket() as squatter:
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
            assert up.wait(timeout=120) == 1, log.read_text()
    lines = log.read_text().splitlines()
    assert any("address already in use" in line for line in lines if line.startswith("api ")), lines
    assert lines[-1] == (
        f"keel: error: port {port} is taken by another process: pick another with --api-port, or use --no-api"
    )


@contextmanager
def own_redis(tmp_path: Path, port: int) -> Iterator[subprocess.Popen[bytes]]:
    server = subprocess.Popen(
        [redis_executable(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", tmp_path],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_until("Redis to answer", lambda: _answers(port), 30)
        yield server
    finally:
        server.kill()
        server.wait()


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def test_up_says_when_redis_goes_and_comes_back_and_gives_up_when_it_stays_away(db_url: str, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "up.log"
    broker = {"KEEL_BROKER_URL": f"redis://127.0.0.1:{port}/0"}
    with keel_up(db_url, broker, log, "--no-flower", "--give-up-after", "10") as up:
        with own_redis(tmp_path, port):
            running(up, log)
            family = psutil.Process(up.pid).children(recursive=True)
        wait_until("the outage to be reported", lambda: "is unreachable" in log.read_text(), 30)
        with own_redis(tmp_path, port):
            wait_until("Redis to be back", lambda: "answers again" in log.read_text() or up.poll() is not None, 30)
            assert "answers again" in log.read_text(), log.read_text()[-4000:]
        assert up.wait(timeout=120) == 1
        _gone, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, f"left running: {[(p.pid, p.cmdline()) for p in alive]}"
    lines = log.read_text().splitlines()
    # (Where the metrics are and which senders have no token are said once at the start, and a child slow to stop on a
    # loaded machine is named before it is killed — nothing is left running either way, checked above: none of them
    # is about Redis.)
    ours = [
        line
        for line in lines
        if line.startswith("keel")
        and not line.startswith("keel up: metrics at")
        and not re.match(r"keel up: KEEL_\w+_TOKEN is not set", line)
        and not re.fullmatch(r"keel up: \w+ did not stop within \d+s; killing it", line)
    ]
    assert [line.split(" (")[0].split(";")[0] for line in ours] == [
        "keel up: worker, beat, api running",
        f"keel up: Redis at 127.0.0.1:{port}/0 is unreachable",
        f"keel up: Redis at 127.0.0.1:{port}/0 answers again",
        f"keel up: Redis at 127.0.0.1:{port}/0 is unreachable",
        f"keel: error: Redis at 127.0.0.1:{port}/0 has not answered for 10s",
    ], ours
    assert ours[-1].endswith("stopped worker, beat, api")
