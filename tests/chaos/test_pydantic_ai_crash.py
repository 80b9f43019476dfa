"""A Pydantic AI agent on Keel in real worker processes: the worker SIGKILLed in the middle of a tool call, after the
model's first reply was recorded. The run finishes on a new worker; the model is not asked again for what it already
answered, and each reply is charged once."""

from __future__ import annotations

import json

import pytest

import tests.support.pai_agents  # noqa: F401 - registers operation pai_ship for this process's submits
from agents.client import Client
from tests.chaos.conftest import Stack, wait_until
from tests.support.keys import scoped
from tests.support.pai_agents import SHIP_RELEASE

pytestmark = pytest.mark.chaos


def _count(stack: Stack, key: str, phase: str) -> int:
    return int(stack.query("SELECT count(*) FROM executions WHERE key = %s AND phase = %s", key, phase)[0][0])


def test_a_worker_killed_mid_tool_resumes_the_run_without_asking_the_model_again(stack: Stack, client: Client) -> None:
    stack.env["KEEL_IMPORTS"] = json.dumps(["tests.support.handlers", "tests.support.pai_agents"])
    stack.worker("w1", concurrency=4)
    stack.beat()
    shopper = client.create_agent("shopper")
    client.submit(shopper.id, "req-1", {"prompt": "ship A-1"}, operation="pai_ship")
    wait_until("the tool to start", lambda: _count(stack, "pai_ship", "start") == 1, 60)
    stack.kill("w1")  # mid tool: its step has no outcome; the model's reply is recorded by step 1
    assert _count(stack, "pai_model", "asked_first") == 1
    stack.release(SHIP_RELEASE)
    stack.worker("w2", concurrency=4)
    wait_until("the run to finish", lambda: client.get_state(shopper.id).phase == "done", 90)

    assert _count(stack, "pai_model", "asked_first") == 1, "the recorded reply was asked for again"
    assert _count(stack, "pai_model", "asked_after_tool") == 1
    # The tool died mid-call, so it ran again (a unit interrupted before its result is recorded runs again): it
    # finished once. A tool that acts on the world is idempotent, or declares its effect through Keel's outbox.
    assert (_count(stack, "pai_ship", "start"), _count(stack, "pai_ship", "done")) == (2, 1)
    assert client.get_state(shopper.id).spent_tokens == 220, "each reply charged once"
    steps = stack.query("SELECT key, status FROM jobs WHERE agent_id = %s ORDER BY created_at", shopper.id)
    assert steps == [(scoped(shopper.id, f"req-1:pai_ship:{n}"), "succeeded") for n in (1, 2, 3)]
