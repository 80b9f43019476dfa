"""A request survives its worker being SIGKILLed during a model call and during a tool call: it resumes at the
first unfinished step, never repeats a finished call, and ends with the same answer as an uninterrupted run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from uuid import UUID

import pytest

from agents.client import Client
from agents.demo.fake_servers import FakeLLM
from tests.chaos.conftest import ROUTES, Stack, wait_until
from tests.support.keys import scoped

pytestmark = pytest.mark.chaos


@pytest.fixture(params=ROUTES)
def database_route(request: pytest.FixtureRequest) -> str:
    """Every scenario here also runs with the processes behind a PgBouncer in transaction mode."""
    return str(request.param)


API_KEY = "sk-chaos-test-key-0000"
REPLIES = [
    {"tool_calls": [{"id": "call_a", "name": "test_wait", "arguments": '{"topic": "failover"}'}], "usage": (300, 40)},
    {"content": "The failover caused both incidents.", "usage": (420, 25)},
]


@pytest.fixture
def llm() -> Iterator[FakeLLM]:
    fake = FakeLLM(token=API_KEY, replies=REPLIES, timeout_delay=4.0)
    fake.start()
    yield fake
    fake.stop()


def _stack_env(stack: Stack, llm: FakeLLM) -> None:
    stack.env.update(
        {
            "KEEL_LLM_PROVIDER": "openai",
            "KEEL_LLM_BASE_URL": f"{llm.url}/v1",
            "KEEL_LLM_MODEL": "fake-1",
            "KEEL_LLM_API_KEY": API_KEY,
            "KEEL_LLM_TIMEOUT_SECONDS": "20",
            "KEEL_IMPORTS": json.dumps(["tests.support.handlers", "tests.support.tools"]),
        }
    )


def _answer(stack: Stack, agent_id: UUID, request_id: str) -> Any:
    rows = stack.query("SELECT result->>'answer' FROM jobs WHERE key = %s", scoped(agent_id, f"{request_id}:plan:2"))
    return rows[0][0] if rows else None


def _tool_runs(stack: Stack) -> dict[str, int]:
    return {k: n for k, n in stack.query("SELECT key, count(*) FROM executions WHERE phase = 'tool' GROUP BY key")}


def test_sigkill_during_a_model_call_and_during_a_tool_call(stack: Stack, client: Client, llm: FakeLLM) -> None:
    _stack_env(stack, llm)
    stack.worker("w1", concurrency=1)
    stack.beat()

    # An uninterrupted run first: the reference answer.
    calm = client.create_agent("calm")
    client.submit(calm.id, "req-calm", {"prompt": "Why did we page?"})
    calm_key = scoped(calm.id, "req-calm:tool:test_wait:1.call_a")
    wait_until(
        "the calm run's tool call",
        lambda: stack.query("SELECT 1 FROM jobs WHERE key = %s AND status = 'running'", calm_key),
        60,
    )
    stack.release(calm_key)
    wait_until("the calm run to finish", lambda: client.get_state(calm.id).phase == "done", 60)
    reference = _answer(stack, calm.id, "req-calm")
    assert reference == "The failover caused both incidents."
    calls_before = dict(llm.completed)

    # Killed during the first model call (the fake answers turn 0 slowly).
    llm.slow_turns = {0}
    hurt = client.create_agent("hurt")
    client.submit(hurt.id, "req-hurt", {"prompt": "Why did we page?"})
    seen = len(llm.requests_seen)
    wait_until("the model call to be in flight", lambda: len(llm.requests_seen) > seen, 60)
    stack.kill("w1")
    llm.slow_turns = set()
    stack.worker("w2", concurrency=1)

    # Killed again during the tool call.
    key = scoped(hurt.id, "req-hurt:tool:test_wait:1.call_a")
    wait_until(
        "the tool call to be running",
        lambda: stack.query("SELECT 1 FROM jobs WHERE key = %s AND status = 'running'", key),
        60,
    )
    stack.kill("w2")
    stack.worker("w3", concurrency=1)
    stack.release(key)
    wait_until("the interrupted run to finish", lambda: client.get_state(hurt.id).phase == "done", 90)

    assert _answer(stack, hurt.id, "req-hurt") == reference, "the interrupted run's answer differs"
    delivered = {turn: n - calls_before.get(turn, 0) for turn, n in llm.completed.items()}
    assert delivered == {0: 1, 1: 1}, f"a finished model call was repeated: {delivered}"
    assert _tool_runs(stack) == {calm_key: 1, key: 1}, "a finished tool call was repeated"
    state = client.get_state(hurt.id)
    assert state.spent_tokens == 340 + 445, "usage adds up to what the provider reported"
