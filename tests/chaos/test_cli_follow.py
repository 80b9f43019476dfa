"""`keel run --wait/--follow` and `keel journal --follow` against a real worker and beat."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.conftest import KEEL, Stack, wait_until

pytestmark = pytest.mark.chaos

COMMENT = {"name": "github_comment", "arguments": {"repository": "acme/api", "issue": 7, "body": "LGTM"}}


def keel(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KEEL, *args], env=stack.env, capture_output=True, text=True, timeout=180, cwd=stack.logs)


def script(tmp_path: Path, name: str, replies: list[dict[str, Any]]) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(replies))
    return str(path)


def test_run_waits_until_the_request_rests_and_exits_by_outcome(stack: Stack, tmp_path: Path) -> None:
    stack.worker()
    stack.beat()
    for name in ("hello", "broken", "careful"):
        assert keel(stack, "agent", "create", name).returncode == 0

    # --follow: progress as plain lines (stdout is a pipe), then the final state; 0 for done.
    done = keel(
        stack, "run", "hello", "Say hello", "--script", script(tmp_path, "hello", [{"content": "hi"}]),
        "--request-id", "r-hello", "--follow", "--timeout", "120",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "submit" in done.stdout and "planning -> done" in done.stdout and "phase      done" in done.stdout
    assert "\x1b[" not in done.stdout  # no terminal control codes in a pipe

    # 3 for failed.
    broken = script(tmp_path, "broken", [{"error": "invalid", "content": "never given"}])
    failed = keel(
        stack, "run", "broken", "Fail", "--script", broken,
        "--wait", "--timeout", "120", "--json",
    )  # fmt: skip
    assert failed.returncode == 3, failed.stdout + failed.stderr
    assert json.loads(failed.stdout)["phase"] == "failed"

    # 4 for waiting for approval; the pending call is shown.
    replies = [{"tool_calls": [COMMENT]}, {"content": "commented"}]
    request = {"prompt": "Comment", "script": replies}
    waiting = keel(
        stack, "run", "careful", "Comment", "--script", script(tmp_path, "careful", replies),
        "--request-id", "r-careful", "--wait", "--timeout", "120",
    )  # fmt: skip
    assert waiting.returncode == 4, waiting.stdout + waiting.stderr
    assert "approval   github" in waiting.stdout
    revision = json.loads(keel(stack, "state", "careful", "--json").stdout)["revision"]
    assert keel(stack, "approve", "careful", "--revision", str(revision)).returncode == 0
    # `keel wait` follows it to its end without submitting anything.
    followed = keel(stack, "wait", "careful", "--follow", "--timeout", "120")
    assert followed.returncode == 0, followed.stdout + followed.stderr
    assert "waiting_approval -> executing" in followed.stdout and "phase      done" in followed.stdout
    # Waiting again on the same request (a repeat submit changes nothing) follows it to its end.
    again = keel(
        stack, "submit", "careful", "r-careful", "--input", json.dumps(request), "--follow", "--json",
        "--timeout", "120",
    )  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    events = [json.loads(line) for line in again.stdout.splitlines()]
    assert [e["event"] for e in events if e["kind"] == "transition"][-1] == "finish"
    assert {e["request_id"] for e in events} == {"r-careful"}


def test_waiting_again_on_an_older_request_exits_by_its_own_outcome(stack: Stack, tmp_path: Path) -> None:
    """Before: the repeat of F1 waited for the agent's current request D1 and exited 0 (`request D1, phase done`)."""
    stack.worker()
    stack.beat()
    assert keel(stack, "agent", "create", "ops-bot").returncode == 0
    failing = script(tmp_path, "fail", [{"error": "invalid", "content": "never given"}])
    fine = script(tmp_path, "ok", [{"content": "hi"}])

    def run(request_id: str, replies: str) -> subprocess.CompletedProcess[str]:
        return keel(
            stack, "run", "ops-bot", "hello", "--script", replies, "--request-id", request_id, "--wait",
            "--timeout", "120",
        )  # fmt: skip

    assert run("F1", failing).returncode == 3
    assert run("D1", fine).returncode == 0
    again = run("F1", failing)
    assert again.returncode == 3, again.stdout + again.stderr
    assert "request    F1: failed" in again.stdout and "request D1 is done" in again.stdout
    assert keel(stack, "wait", "ops-bot", "F1").returncode == 3
    assert keel(stack, "wait", "ops-bot").returncode == 0


def test_journal_follow_prints_every_new_event_once(stack: Stack, tmp_path: Path) -> None:
    stack.worker()
    stack.beat()
    errors = stack.logs / "follower.err"
    # As a terminal starts it: Ctrl-C is not ignored (a shell's background job would have it ignored, inherited).
    with open(errors, "w") as err, subprocess.Popen(
        [KEEL, "journal", "--follow", "--json"], env=stack.env, stdout=subprocess.PIPE, stderr=err, text=True,
        cwd=stack.logs, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    ) as follower:  # fmt: skip
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(follower.stdout or ()), daemon=True)
        reader.start()
        try:
            for n in range(3):
                assert keel(stack, "agent", "create", f"bot{n}").returncode == 0
                ran = keel(
                    stack, "run", f"bot{n}", "Hi", "--script",
                    script(tmp_path, f"bot{n}", [{"content": "one"}]), "--wait", "--timeout", "120",
                )  # fmt: skip
                assert ran.returncode == 0, ran.stderr
            journal = json.loads(keel(stack, "journal", "--limit", "1000", "--json").stdout)["events"]
            expected = [(e["agent_id"], e["seq"]) for e in journal]
            wait_until("the follower to print every event", lambda: len(lines) >= len(expected), 60)
        finally:
            follower.send_signal(signal.SIGINT)
            try:
                follower.wait(timeout=30)
            except subprocess.TimeoutExpired:  # killed, or leaving the block would wait for it (and its pipe) forever
                follower.kill()
                follower.wait()
                raise AssertionError("keel journal --follow did not stop on Ctrl-C within 30 s") from None
            reader.join(timeout=10)
    got = [(e["agent_id"], e["seq"]) for e in map(json.loads, lines)]
    assert sorted(got) == sorted(expected) and len(got) == len(set(got))
    assert follower.returncode == 0, errors.read_text()  # Ctrl-C is how a follow ends: not an error
