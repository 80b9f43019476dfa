"""Secrets never reach a log line or the journal of a real `keel worker` and `keel beat`."""

from __future__ import annotations

import json

import pytest

from agents.client import Client
from tests.chaos.conftest import Stack, wait_until

pytestmark = pytest.mark.chaos

TOKEN = "opaque-configured-token-0451"  # no known shape: only the worker's registration of its settings masks it


def test_a_handler_exception_carrying_tokens_is_logged_and_journaled_masked(stack: Stack, client: Client) -> None:
    stack.worker("w1", KEEL_GITHUB_TOKEN=TOKEN)
    stack.beat(KEEL_GITHUB_TOKEN=TOKEN)
    agent = client.create_agent("leaker")
    client.submit(agent.id, "r1", None, operation="leaky")
    # `unknown` failures are retried (twice under FAST): wait until the job has given up.
    wait_until("the leaky job to give up", lambda: stack.query("SELECT status FROM jobs")[0][0] in ("failed", "dead"))
    stack.stop_all()
    journaled = json.dumps([row[0] for row in stack.query("SELECT details::text FROM audit.journal")])
    worker_log = stack.log("w1")
    for text in (journaled, worker_log, stack.log("beat")):
        assert TOKEN not in text and "xoxb-12345" not in text
    assert "r1:leaky:1" in worker_log and "token=*** and Authorization: ***" in worker_log
    assert "token=*** and Authorization: ***" in journaled
