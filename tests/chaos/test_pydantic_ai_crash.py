"""A Pydantic AI agent on Keel in real worker processes, the worker SIGKILLed in the middle of its first model request,
of its tool call, and of its second model request (after the tool's outcome was recorded). Each time the run finishes
on a new worker; a reply or tool result that was recorded is never asked for or run again, a call the dead worker
was in the middle of is made again, and each reply that was answered is charged once."""

from __future__ import annotations

import json

import pytest

import tests.support.pai_agents  # noqa: F401 - registers operation pai_ship for this process's submits
from agents.client import Client
from tests.chaos.conftest import Stack, wait_until
from tests.support.keys import scoped
from tests.support.pai_agents import RELEASE

pytestmark = pytest.mark.chaos


def _count(stack: Stack, key: str, phase: str) -> int:
    return int(stack.query("SELECT count(*) FROM executions WHERE key = %s AND phase = %s", key, phase)[0][0])


# (where the worker dies, the call it is in, (starts, finishes) of each call once the run has finished)
CASES = {
    "model1": (("pai_model", "model1"), {"model1": (2, 1), "ship": (1, 1), "model2": (1, 1)}),
    "tool": (("pai_ship", ""), {"model1": (1, 1), "ship": (2, 1), "model2": (1, 1)}),
    "model2": (("pai_model", "model2"), {"model1": (1, 1), "ship": (1, 1), "model2": (2, 1)}),
}


@pytest.mark.parametrize("where", list(CASES))
def test_a_worker_killed_mid_call_resumes_the_run_repeating_only_that_call(
    stack: Stack, client: Client, where: str
) -> None:
    (key, call), expected = CASES[where]
    started = f"{call}_start" if call else "start"
    stack.env["KEEL_IMPORTS"] = json.dumps(["tests.support.handlers", "tests.support.pai_agents"])
    stack.worker("w1", concurrency=4)
    stack.beat()
    shopper = client.create_agent("shopper")
    client.submit(shopper.id, "req-1", {"prompt": f"block:{where}"}, operation="pai_ship")
    wait_until(f"the run to reach {where}", lambda: _count(stack, key, started) == 1, 60)
    stack.kill("w1")
    stack.release(RELEASE)
    stack.worker("w2", concurrency=4)
    wait_until("the run to finish", lambda: client.get_state(shopper.id).phase == "done", 90)

    seen = {
        "model1": (_count(stack, "pai_model", "model1_start"), _count(stack, "pai_model", "model1_done")),
        "ship": (_count(stack, "pai_ship", "start"), _count(stack, "pai_ship", "done")),
        "model2": (_count(stack, "pai_model", "model2_start"), _count(stack, "pai_model", "model2_done")),
    }
    assert seen == expected, "only the call the worker died in was made again, and it finished once"
    assert client.get_state(shopper.id).spent_tokens == 220, "each answered reply charged once"
    steps = stack.query("SELECT key, status FROM jobs WHERE agent_id = %s ORDER BY created_at", shopper.id)
    assert steps == [(scoped(shopper.id, f"req-1:pai_ship:{n}"), "succeeded") for n in (1, 2, 3)]
