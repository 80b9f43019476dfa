"""What the processes say as they start: Flower (under `keel up` and alone, before any worker) no warning; a worker
that runs the outbox relay, and `keel up`'s summary, one warning per sender without its token, and none for a sender
that has one."""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.chaos.conftest import Stack, free_port, wait_until
from tests.chaos.test_up import keel_up, running
from tests.support.broker import Broker
from tests.support.logs import log_lines

pytestmark = pytest.mark.chaos

SLACK_TOKEN = "xoxb-start-warnings-token-000"
#: A warning in a readable line (`[warning  ]`), a JSON line's level, or a Python warning (`DeprecationWarning: …`).
WARNING = re.compile(r"\[warning\s*\]|\"level\": \"warning\"|WARNING|Warning")


def _workers(port: int, *, refresh: bool) -> tuple[dict[str, Any]] | None:
    """What Flower's API lists of the workers (``refresh``: after asking them again), or None before it answers."""
    try:
        answer = httpx.get(f"http://127.0.0.1:{port}/api/workers", params={"refresh": 1} if refresh else {}, timeout=5)
    except httpx.HTTPError:
        return None
    return (answer.json(),) if answer.status_code == 200 else None


def test_keel_flower_started_before_any_worker_says_no_warning(stack: Stack) -> None:
    """Before: four `Inspect method stats failed` (registered, conf, active_queues) warnings: no worker answered
    Flower's first look at the workers, as in compose, where nothing starts Flower after the workers."""
    port = free_port()
    stack.start("flower", "flower", "--port", str(port), "--address=127.0.0.1")
    # A refresh waits for the look Flower took as it started (it is the same one while it runs), then asks again.
    (listed,) = wait_until("Flower to answer", lambda: _workers(port, refresh=True), 60, every=0.5)
    assert listed == {}
    text = stack.log("flower")
    assert f"Visit me at http://127.0.0.1:{port}" in text
    assert not [line for line in text.splitlines() if WARNING.search(line)], text


def test_keel_up_starts_flower_after_the_worker_and_names_the_sender_without_a_token(
    db_url: str, broker: Broker, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "up.log"
    with keel_up(db_url, {**broker.env, "KEEL_SLACK_TOKEN": SLACK_TOKEN}, log, "--flower-port", str(port)) as up:
        running(up, log)
        # Flower's first look, as it started, found the worker: listed without asking again.
        listed = wait_until(
            "Flower to list the worker", lambda: (_workers(port, refresh=False) or [{}])[0], 30, every=0.5
        )
        assert any(name.startswith("keel@") for name in listed), listed
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=90) == 0, log.read_text()
    lines = log.read_text().splitlines()
    flower = [line for line in lines if line.startswith("flower |")]
    assert flower and not [line for line in flower if WARNING.search(line)], "\n".join(flower)
    summary = [line for line in lines if line.startswith("keel up: KEEL_")]
    assert summary == [
        "keel up: KEEL_GITHUB_TOKEN is not set: GitHub messages (github_comment) will go dead unsent"
        ' ("github is not configured: set KEEL_GITHUB_TOKEN"); set it, then `keel outbox retry KEY` revives a dead one'
    ]
    said = [line for line in lines if line.startswith("worker |") and "_TOKEN is not set" in line]
    assert len(said) == 1 and "[warning" in said[0] and "KEEL_GITHUB_TOKEN is not set" in said[0], said


def test_only_a_worker_that_runs_the_relay_warns_of_a_sender_without_its_token(stack: Stack) -> None:
    stack.worker("jobs", queues="keel.jobs,keel.jobs.low")
    stack.worker("relay", queues="keel.outbox", KEEL_GITHUB_TOKEN="ghp_startWarningsToken000")
    warned = {
        name: [line["event"] for line in log_lines(stack.log(name)) if line["logger"] == "keel.outbox"]
        for name in ("jobs", "relay")
    }
    assert warned["jobs"] == [], "it sends nothing: nothing to warn of"
    (slack,) = warned["relay"]
    assert slack.startswith("KEEL_SLACK_TOKEN is not set: Slack messages (slack_post, approval and deadline notices")
