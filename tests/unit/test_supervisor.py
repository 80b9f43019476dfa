"""`keel up`'s view of its servers: one line per change of state, a bounded outage, no credentials in its lines."""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from agents.cli.supervisor import Child, ServerHealth, Supervisor, api_ready, local_url, where


def test_one_line_per_change_of_state_and_giving_up_only_after_a_whole_outage() -> None:
    health = ServerHealth("Redis", "redis://:secret@127.0.0.1:6390/0", give_up_after=30)
    assert health.observe(0, None) is None
    down = health.observe(1, "Connection refused")
    assert down is not None and down.startswith(
        "keel up: Redis at 127.0.0.1:6390/0 is unreachable (Connection refused)"
    )
    assert health.observe(2, "Timeout") is None, "still down: no new line"
    assert not health.gave_up(30)
    assert health.observe(20, None) == "keel up: Redis at 127.0.0.1:6390/0 answers again (after 19s)"
    assert health.observe(21, None) is None
    assert health.observe(40, "refused") is not None
    assert not health.gave_up(69), "the clock restarts with each outage"
    assert health.gave_up(70)


def test_server_lines_never_show_credentials() -> None:
    assert where("postgresql+psycopg://keel:hunter2@db.internal:5432/keel") == "db.internal:5432/keel"
    assert where("redis://:hunter2@127.0.0.1:6379/3") == "127.0.0.1:6379/3"
    assert where("postgresql://postgres:@/postgres?host=/srv/.keel/postgres") == (
        "postgres on the socket in /srv/.keel/postgres"
    )


def _exited(name: str, code: str, *lines: str) -> Child:
    child = Child(name, [sys.executable, "-c", code], ready_line=None)
    child.proc = subprocess.Popen(child.argv)
    child.proc.wait()
    child.last_lines.extend(lines)
    return child


def test_an_exit_says_which_signal_killed_it_and_quotes_the_last_line_only_for_a_failure() -> None:
    """Before: `beat exited with status -9: [… INFO] this beat is the leader; stopped the rest`."""
    leader = "[2026-11-30 18:22:01,123: INFO] this beat is the leader"
    killed = _exited("beat", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", leader)
    assert killed.why_exited() == "beat was killed by SIGKILL"
    failed = _exited("worker", "raise SystemExit(3)", "Traceback …", "OSError: boom", "")
    assert failed.why_exited() == "worker exited with status 3 (its last line was: OSError: boom)"
    assert _exited("flower", "pass", "bye").why_exited() == "flower exited with status 0"


STOPPABLE = """
import signal, sys, time
def stop(signum, _frame):
    with open(sys.argv[1], "w") as out:
        out.write(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGQUIT, stop)
print("ready", flush=True)
time.sleep(60)
"""


def test_sigquit_is_celerys_cold_shutdown_for_celery_and_a_plain_stop_for_the_api(tmp_path: Path) -> None:
    """The API (uvicorn) has no cold shutdown: SIGQUIT would kill it without its graceful stop."""
    children = [
        Child(name, [sys.executable, "-c", STOPPABLE, str(tmp_path / name)], ready_line=lambda line: line == "ready")
        for name in ("worker", "api")
    ]
    children[1].quit_as = signal.SIGTERM
    supervisor = Supervisor(children, dict(os.environ), stop_timeout=30)
    with supervisor.signals_handled():
        supervisor.start()
        assert supervisor.wait_ready(timeout=30)
        os.kill(os.getpid(), signal.SIGQUIT)  # as keel up gets it
        assert supervisor.received == signal.SIGQUIT
        supervisor.stop()
    assert (tmp_path / "worker").read_text() == "SIGQUIT"
    assert (tmp_path / "api").read_text() == "SIGTERM"
    assert [child.proc.returncode for child in children if child.proc] == [0, 0]


def test_the_api_url_is_one_this_machine_reaches() -> None:
    assert local_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert local_url("0.0.0.0", 8080) == "http://127.0.0.1:8080"
    assert local_url("::", 8080) == "http://127.0.0.1:8080"
    assert local_url("::1", 9000) == "http://[::1]:9000"
    assert local_url("10.1.2.3", 9000) == "http://10.1.2.3:9000"


class _Readyz(http.server.BaseHTTPRequestHandler):
    status = 503

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/readyz" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


def test_the_api_counts_as_ready_only_when_readyz_answers_200() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Readyz)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert not api_ready(url), "503: the database or the broker is not there yet"
        _Readyz.status = 200
        assert api_ready(url)
    finally:
        server.shutdown()
        server.server_close()
    assert not api_ready(url), "nothing listens"


def test_a_worker_that_exits_to_be_replaced_is_started_again_and_any_other_exit_stops_the_stack(
    tmp_path: Path,
) -> None:
    starts = tmp_path / "starts"
    # Exits 70 (asking to be replaced) the first time, then runs until stopped.
    code = (
        "import os, sys, time, pathlib\n"
        f"p = pathlib.Path({str(starts)!r}); n = len(p.read_text()) if p.exists() else 0\n"
        "p.write_text('x' * (n + 1)); print('ready.', flush=True)\n"
        "sys.exit(70) if n == 0 else time.sleep(60)\n"
    )
    worker = Child("worker", [sys.executable, "-c", code], ready_line=lambda line: "ready." in line, replaceable=True)
    beat = Child("beat", [sys.executable, "-c", "raise SystemExit(70)"], ready_line=None)
    supervisor = Supervisor([worker, beat], dict(os.environ), stop_timeout=5)
    try:
        supervisor.start()
        assert worker.proc is not None and worker.proc.wait(10) == 70
        assert supervisor.replaced(worker), "the worker is started again"
        assert worker.saw_ready_line.wait(10), "the new worker process showed it was ready"
        assert worker.proc.poll() is None
        assert beat.proc is not None and beat.proc.wait(10) == 70
        assert not supervisor.replaced(beat), "only a child that may be replaced is"
    finally:
        supervisor.stop()
    assert starts.read_text() == "xx"


def test_a_child_started_after_another_starts_only_once_that_one_is_ready(tmp_path: Path) -> None:
    """Flower after the worker (keel up): its first look at the workers, as it starts, finds one."""
    readied = tmp_path / "worker-ready"
    worker_code = (
        "import pathlib, time\n"
        f"time.sleep(1); pathlib.Path({str(readied)!r}).touch(); print('ready.', flush=True); time.sleep(60)\n"
    )
    flower_code = (
        "import pathlib, time\n"
        f"print('saw the worker ready' if pathlib.Path({str(readied)!r}).exists() else 'too early', flush=True)\n"
        "time.sleep(60)\n"
    )
    worker = Child("worker", [sys.executable, "-c", worker_code], ready_line=lambda line: "ready." in line)
    flower = Child("flower", [sys.executable, "-c", flower_code], ready_line=bool, after="worker")
    supervisor = Supervisor([flower, worker], dict(os.environ), stop_timeout=5)
    try:
        supervisor.start()
        assert flower.proc is None, "not started with the others"
        assert supervisor.wait_ready(timeout=30)
        assert list(flower.last_lines) == ["saw the worker ready"]
    finally:
        supervisor.stop()
