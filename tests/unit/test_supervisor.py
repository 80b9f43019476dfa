"""`keel up`'s view of its servers: one line per change of state, a bounded outage, no credentials in its lines."""

from __future__ import annotations

import subprocess
import sys

from agents.cli.supervisor import Child, ServerHealth, where


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
