"""Every key a step derives comes from the step's own key: a model that reuses a tool call id in a later round,
or a tool that names its message the same in two calls, still gets every message sent; the same id twice in one
reply is refused, visibly.

Through the OpenAI-compatible provider against the fake chat-completions server, and the relay against fake Slack.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from pydantic import BaseModel

import agents.runtime.loop  # noqa: F401 - registers plan, tool and gate
from agents.client import Client
from agents.core.commands import MessageSpec
from agents.core.keys import derive, step_message_key
from agents.outbox.relay import Backoff, Relay
from agents.outbox.senders import SlackSender
from agents.runtime import loop as runtime
from agents.runtime.tools import ToolContext, ToolOutput, tool
from models.db import Database
from models.jobs_sql import job_row
from models.outbox_sql import message_row
from tests.support import runs
from tests.support.fakes import FakeLLM, FakeSlack
from tests.support.keys import scoped

pytestmark = pytest.mark.integration

API_KEY = "sk-test-step-keys"
SLACK_TOKEN = "xoxb-test-step-keys"


class Summary(BaseModel):
    text: str


@tool("post_summary", description="Post a summary to the team channel.")
def post_summary(args: Summary, ctx: ToolContext) -> ToolOutput:
    # Every call names its message "summary": the step it comes from tells them apart.
    return ToolOutput("summary queued", messages=(MessageSpec("slack", "C0SUM", "summary", {"text": args.text}),))


@pytest.fixture
def llm() -> Iterator[FakeLLM]:
    fake = FakeLLM(token=API_KEY, timeout_delay=1.5)
    fake.start()
    env = {
        "KEEL_LLM_PROVIDER": "openai",
        "KEEL_LLM_BASE_URL": f"{fake.url}/v1",
        "KEEL_LLM_API_KEY": API_KEY,
        "KEEL_LLM_MODEL": "m-1",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    runtime._settings.cache_clear()
    runtime._openai_client.cache_clear()
    try:
        yield fake
    finally:
        if runtime._openai_client.cache_info().currsize:
            runtime._openai().close()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        runtime._settings.cache_clear()
        runtime._openai_client.cache_clear()
        fake.stop()


@pytest.fixture
def slack() -> Iterator[FakeSlack]:
    fake = FakeSlack(token=SLACK_TOKEN, timeout_delay=1.5, retry_after=1.0)
    fake.start()
    yield fake
    fake.stop()


def deliver(db: Database, slack: FakeSlack, expected: int) -> None:
    """Run the relay until ``expected`` messages reached the fake Slack (bounded)."""
    relay = Relay(
        db,
        {"slack": SlackSender(SLACK_TOKEN, f"{slack.url}/api/", timeout=1.0)},
        lease=timedelta(seconds=10),
        concurrency=4,
        backoff=Backoff(0.05, 0.2, 6, 200),
        pass_seconds=10,
        secrets=(SLACK_TOKEN,),
    )
    try:
        for _ in range(50):
            relay.run_pass()
            if sum(slack.delivered_keys().values()) >= expected:
                return
            time.sleep(0.05)
    finally:
        relay.close()
    raise AssertionError(f"the relay delivered {dict(slack.delivered_keys())}, not {expected} messages")


def _post(call_id: str, channel: str, text: str) -> dict[str, str]:
    return {"id": call_id, "name": "slack_post", "arguments": f'{{"channel": "{channel}", "text": "{text}"}}'}


def test_a_call_id_reused_in_the_next_round_still_sends_both_messages(
    client: Client, db: Database, llm: FakeLLM, slack: FakeSlack
) -> None:
    llm.replies = [
        {"tool_calls": [_post("call_1", "C111", "first")]},
        {"tool_calls": [_post("call_1", "C222", "second")]},
        {"content": "posted twice"},
    ]
    agent = client.create_agent("reuser")
    client.submit(agent.id, "r1", {"prompt": "post twice"})
    ran = runs.run_all(db)
    steps = ["plan:1", "tool:slack_post:1.call_1", "plan:2", "tool:slack_post:2.call_1", "plan:3"]
    assert ran == [scoped(agent.id, f"r1:{step}") for step in steps]
    assert client.get_state(agent.id).phase == "done"
    suppressed = [e.details.get("messages_suppressed") for e in client.journal(agent_id=agent.id)]
    assert not any(suppressed), f"a message was dropped as a duplicate: {suppressed}"
    deliver(db, slack, 2)
    assert [m["text"] for m in slack.channels["C111"]] == ["first"]
    assert [m["text"] for m in slack.channels["C222"]] == ["second"]
    first = message_row(db, step_message_key(scoped(agent.id, "r1:tool:slack_post:1.call_1"), "slack", "post"))
    second = message_row(db, step_message_key(scoped(agent.id, "r1:tool:slack_post:2.call_1"), "slack", "post"))
    assert first is not None and second is not None
    assert (first["destination"], second["destination"]) == ("C111", "C222")
    assert first["key"] == scoped(agent.id, "r1:slack:tool.slack_post:1.call_1@post")


def test_a_user_tool_naming_its_message_alike_in_two_calls_sends_both(
    client: Client, db: Database, llm: FakeLLM, slack: FakeSlack
) -> None:
    summary = {"id": "s", "name": "post_summary", "arguments": '{"text": "one"}'}
    llm.replies = [
        {"tool_calls": [summary, {**summary, "id": "t", "arguments": '{"text": "two"}'}]},
        {"tool_calls": [{**summary, "arguments": '{"text": "three"}'}]},
        {"content": "ok"},
    ]
    agent = client.create_agent("summariser")
    client.submit(agent.id, "r1", {"prompt": "summarise"})
    runs.run_all(db)
    assert client.get_state(agent.id).phase == "done"
    suppressed = [e.details.get("messages_suppressed") for e in client.journal(agent_id=agent.id)]
    assert not any(suppressed), f"a message was dropped as a duplicate: {suppressed}"
    deliver(db, slack, 3)
    assert sorted(m["text"] for m in slack.channels["C0SUM"]) == ["one", "three", "two"]
    key = step_message_key(scoped(agent.id, "r1:tool:post_summary:2.s"), "slack", "summary")
    assert key == scoped(agent.id, "r1:slack:tool.post_summary:2.s@summary")
    assert slack.delivered_keys()[key] == 1


def test_the_same_call_id_twice_in_one_reply_is_refused_visibly(
    client: Client, db: Database, llm: FakeLLM, slack: FakeSlack
) -> None:
    llm.replies = [{"tool_calls": [_post("call_1", "C111", "first"), _post("call_1", "C222", "second")]}]
    agent = client.create_agent("repeater")
    client.submit(agent.id, "r1", {"prompt": "post twice"})
    assert runs.run_all(db) == [scoped(agent.id, "r1:plan:1")], "no call of the malformed reply ran"
    assert len(llm.requests_seen) == 1, "an invalid reply was asked for again"
    state = client.get_state(agent.id)
    assert state.phase == "failed" and state.spent_tokens > 0
    job = job_row(db, scoped(agent.id, "r1:plan:1"))
    assert job is not None and (job["status"], job["error_class"]) == ("failed", "invalid")
    assert "call_1" in job["last_error"] and "twice" in job["last_error"]
    last = client.journal(agent_id=agent.id)[-1]
    assert (last.event, last.to_phase, last.details["error_class"]) == ("fail", "failed", "invalid")
    assert "twice" in last.details["error"]
    with db.connection() as conn:
        assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)


@tool("forge_post", description="Post a message it claims another step emitted.")
def forge_post(args: Summary, ctx: ToolContext) -> ToolOutput:
    forged = MessageSpec("slack", "C0SUM", "post", {"text": args.text}, step=derive(ctx.key, "tool", "slack_post:1.x"))
    return ToolOutput("queued", messages=(forged,))


def test_a_step_cannot_key_its_message_from_another_step(client: Client, db: Database, llm: FakeLLM) -> None:
    llm.replies = [{"tool_calls": [{"id": "f", "name": "forge_post", "arguments": '{"text": "hi"}'}]}]
    agent = client.create_agent("forger")
    client.submit(agent.id, "r1", {"prompt": "forge"})
    runs.run_all(db)
    job = job_row(db, scoped(agent.id, "r1:tool:forge_post:1.f"))
    assert job is not None and (job["status"], job["error_class"]) == ("failed", "invalid")
    assert "a step's messages are keyed by that step" in job["last_error"]
    assert client.get_state(agent.id).phase == "failed"
    with db.connection() as conn:
        assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)
