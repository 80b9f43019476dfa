"""The agent loop (plan → tools → plan … → done), approvals, budgets, with the scripted provider; and the
OpenAI-compatible client against a local fake chat-completions server."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from pydantic import BaseModel

import agents.runtime.loop  # noqa: F401 - registers plan, tool and gate
from agents.client import Client
from agents.core.commands import Usage
from agents.core.errors import HardDeadlinePassed, InvalidInput, InvalidJob, RateLimited, StaleRevision, TransientError
from agents.jobs.handlers import registry
from agents.jobs.runner import Runner
from agents.runtime.inference import OpenAICompatible
from agents.runtime.tools import ToolContext, ToolOutput, tool
from models.db import Database
from models.jobs_sql import job_row
from tests.support.db import expire_lease
from tests.support.fakes import FakeLLM
from tests.support.keys import scoped
from tests.support.runs import FAST_RULES, run_all

pytestmark = pytest.mark.integration
LOOKUPS: list[str] = []


class Lookup(BaseModel):
    q: str


@tool("kb_lookup", description="Look something up in the knowledge base.")
def lookup(args: Lookup, ctx: ToolContext) -> ToolOutput:
    LOOKUPS.append(ctx.call_id)
    return ToolOutput(f"3 incidents match {args.q!r}", usage=Usage(5, Decimal("0.0005")))


def script(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"prompt": "Summarise open incidents", "script": list(entries)}


def test_a_scripted_conversation_runs_to_done_and_its_usage_adds_up(client: Client, db: Database) -> None:
    agent = client.create_agent("analyst", budget_tokens=10_000)
    LOOKUPS.clear()
    client.submit(
        agent.id,
        "req-1",
        script(
            {
                "tool_calls": [
                    {"name": "kb_lookup", "arguments": {"q": "db"}},
                    {"name": "slack_post", "arguments": {"channel": "C1", "text": "looking"}},
                ],
                "tokens": 120,
                "cost": "0.002",
            },
            {"content": "Three incidents, all about the database.", "tokens": 80, "cost": "0.001"},
        ),
    )
    ran = run_all(db)
    assert ran == [
        scoped(agent.id, "req-1:plan:1"),
        scoped(agent.id, "req-1:tool:kb_lookup:1.call_0_0"),
        scoped(agent.id, "req-1:tool:slack_post:1.call_0_1"),
        scoped(agent.id, "req-1:plan:2"),
    ]
    state = client.get_state(agent.id)
    assert (state.phase, state.spent_tokens, state.spent_cost) == ("done", 205, Decimal("0.0035"))
    assert (
        job_row(db, scoped(agent.id, "req-1:plan:2"))["result"]["answer"] == "Three incidents, all about the database."
    )  # type: ignore[index]
    from models.outbox_sql import message_row

    assert message_row(db, scoped(agent.id, "req-1:slack:tool.slack_post:1.call_0_1@post"))["payload"] == {
        "text": "looking"
    }  # type: ignore[index]
    moves = [(e.event, e.to_phase) for e in client.journal(agent_id=agent.id) if e.kind == "transition"]
    assert moves == [
        ("submit", "planning"),
        ("plan", "executing"),
        ("progress", "executing"),
        ("observe", "planning"),
        ("finish", "done"),
    ]
    assert LOOKUPS == ["call_0_0"]


def _to_approval(client: Client, db: Database, **submit: Any) -> Any:
    agent = client.create_agent("commenter")
    client.submit(
        agent.id,
        "req-1",
        script(
            {
                "tool_calls": [
                    {"name": "github_comment", "arguments": {"repository": "acme/api", "issue": 7, "body": "Fixed"}}
                ]
            },
            {"content": "Commented."},
            {"content": "Understood, no comment."},
        ),
        **submit,
    )
    run_all(db)
    return client.get_state(agent.id)


def test_approval_continues_the_loop_and_a_stale_approval_is_rejected(client: Client, db: Database) -> None:
    waiting = _to_approval(client, db)
    assert waiting.phase == "waiting_approval"
    assert waiting.pending_approval == {
        "tool": "github_comment",
        "call_id": "call_0_0",
        "round": 1,
        "arguments": {"repository": "acme/api", "issue": 7, "body": "Fixed"},
    }
    with pytest.raises(StaleRevision):
        client.approve(waiting.id, expected_revision=waiting.revision - 1, actor="bob")
    client.approve(waiting.id, expected_revision=waiting.revision, actor="carol")
    run_all(db)
    state = client.get_state(waiting.id)
    assert state.phase == "done"
    from models.outbox_sql import message_row

    assert (
        message_row(db, scoped(waiting.id, "req-1:github:tool.github_comment:1.call_0_0@comment"))["destination"]
        == "acme/api#7"
    )  # type: ignore[index]


def test_reject_makes_the_model_revise(client: Client, db: Database) -> None:
    waiting = _to_approval(client, db)
    client.reject(waiting.id, expected_revision=waiting.revision, actor="dana", reason="not on a Friday")
    run_all(db)
    state = client.get_state(waiting.id)
    assert state.phase == "done"
    from agents.runtime.loop import conversation

    _, messages = conversation(db, waiting.id, "req-1", scoped(waiting.id, "req-1:plan:2"))
    assert messages[-1] == {
        "role": "tool",
        "tool_call_id": "call_0_0",
        "content": "A person rejected this call: not on a Friday",
    }
    assert job_row(db, scoped(waiting.id, "req-1:tool:github_comment:1.call_0_0")) is None, (
        "the rejected call never ran"
    )


def test_an_approval_after_the_hard_deadline_is_refused(client: Client, db: Database) -> None:
    waiting = _to_approval(client, db, hard_deadline=timedelta(seconds=2))
    time.sleep(2.1)
    with pytest.raises(HardDeadlinePassed):
        client.approve(waiting.id, expected_revision=waiting.revision, actor="late")
    assert client.get_state(waiting.id).phase == "waiting_approval"


def test_an_exhausted_budget_stops_the_loop_before_the_next_model_call(client: Client, db: Database) -> None:
    agent = client.create_agent("spender", budget_tokens=150)
    step = {"tool_calls": [{"name": "kb_lookup", "arguments": {"q": "x"}}], "tokens": 100}
    client.submit(agent.id, "req-1", script(step, step, step, {"content": "never"}))
    run_all(db)
    state = client.get_state(agent.id)
    # plan 1 (100) + a lookup (5) + plan 2 (100) = 205 >= 150: the next step is not started.
    assert state.phase == "failed" and state.spent_tokens == 205
    assert client.journal(agent_id=agent.id)[-1].decision == "budget_exhausted"
    assert job_row(db, scoped(agent.id, "req-1:tool:kb_lookup:2.call_1_0"))["status"] == "failed"  # type: ignore[index]
    assert job_row(db, scoped(agent.id, "req-1:plan:3")) is None, "no further model call was made"


def test_a_transient_model_error_is_retried_and_its_spend_is_retry_cost(client: Client, db: Database) -> None:
    agent = client.create_agent("flaky")
    client.submit(agent.id, "req-1", script({"error": "transient", "tokens": 30, "content": "fine"}))
    run_all(db)
    row = job_row(db, scoped(agent.id, "req-1:plan:1"))
    assert row is not None and (row["status"], row["attempts"], row["failed_tokens"], row["tokens"]) == (
        "succeeded",
        2,
        30,
        30,
    )
    assert client.get_state(agent.id).spent_tokens == 60


# --- the OpenAI-compatible client -----------------------------------------------------------------------------------


@pytest.fixture
def llm() -> Iterator[FakeLLM]:
    fake = FakeLLM(token="sk-test-secret-key-123", timeout_delay=1.5)
    fake.start()
    yield fake
    fake.stop()


def test_openai_client_reads_tool_calls_usage_and_cost(llm: FakeLLM) -> None:
    llm.replies = [
        {"tool_calls": [{"id": "call_9", "name": "kb_lookup", "arguments": '{"q": "db"}'}], "usage": (1000, 200)},
    ]
    client = OpenAICompatible(
        f"{llm.url}/v1", "m-1", "sk-test-secret-key-123", timeout=1.0, prices={"m-1": {"input": 1.0, "output": 2.0}}
    )
    reply = client.complete([{"role": "user", "content": "hi"}], [{"type": "function", "function": {"name": "x"}}])
    client.close()
    assert [(c.id, c.name, dict(c.arguments)) for c in reply.tool_calls] == [("call_9", "kb_lookup", {"q": "db"})]
    assert reply.usage == Usage(1200, Decimal("0.0014"))
    request = llm.requests_seen[-1]
    assert request["model"] == "m-1" and request["tools"][0]["function"]["name"] == "x"


@pytest.mark.parametrize(
    ("fault", "error", "text"),
    [
        ("429", RateLimited, "rate limited"),
        ("500", TransientError, "error 500"),
        ("timeout", TransientError, "timed out"),
        ("context", InvalidJob, "no longer fits"),
        ("401", InvalidJob, r"refused the request \(401\)"),
    ],
)
def test_openai_client_maps_errors_to_classes(llm: FakeLLM, fault: str, error: type[Exception], text: str) -> None:
    llm.fault = fault
    client = OpenAICompatible(f"{llm.url}/v1", "m-1", "sk-test-secret-key-123", timeout=1.0)
    with pytest.raises(error, match=text) as info:
        client.complete([{"role": "user", "content": "hi"}], [])
    client.close()
    assert "sk-test-secret-key-123" not in str(info.value)
    if fault == "429":
        assert info.value.retry_after == 3.0  # type: ignore[attr-defined]


def test_a_script_calling_a_tool_that_does_not_exist_is_refused_at_submit(client: Client, db: Database) -> None:
    """The README once called the tools slack.post and github.comment: such a script is refused before anything
    is written, naming the call and the tools there are (it used to end done, the failure hidden in one job)."""
    agent = client.create_agent("sneaky")
    events = client.journal()
    comment = {"name": "github.comment", "arguments": {"repository": "acme/api", "issue": 7, "body": "x"}}
    with pytest.raises(InvalidInput) as info:
        client.submit(agent.id, "req-1", script({"tool_calls": [comment]}, {"content": "ok"}))
    message = str(info.value)
    assert message.startswith(
        "input of operation 'plan': input.script[0].tool_calls[0].name: there is no tool named 'github.comment'"
        " (tools: "
    ), message
    assert "github_comment" in message and "slack_post" in message and "kb_lookup" in message
    assert client.get_state(agent.id) == agent and client.journal() == events
    with psycopg.connect(db.libpq_url) as conn:
        assert conn.execute("SELECT count(*) FROM requests").fetchone() == (0,)


def test_a_script_with_arguments_a_tool_refuses_is_refused_at_submit(client: Client, db: Database) -> None:
    """A Slack channel name instead of its id used to end `done`, nothing posted, the error inside one job."""
    agent = client.create_agent("poster")
    events = client.journal()
    post = {"name": "slack_post", "arguments": {"channel": "#general", "text": "hi"}}
    with pytest.raises(InvalidInput) as info:
        client.submit(agent.id, "req-1", script({"tool_calls": [post]}, {"content": "ok"}))
    assert str(info.value) == (
        "input of operation 'plan': input.script[0].tool_calls[0].arguments.channel: string should match pattern"
        " '^[CGD][A-Z0-9]{1,20}$'"
    )
    assert client.get_state(agent.id) == agent and client.journal() == events
    with psycopg.connect(db.libpq_url) as conn:
        assert conn.execute("SELECT count(*) FROM requests").fetchone() == (0,)


def test_a_models_bad_arguments_are_told_to_it_and_journaled(client: Client, db: Database) -> None:
    """A model's reply is not checked at submit: it can correct itself, and the journal shows what went wrong."""
    from agents.core.commands import Command, JobSpec
    from agents.core.phases import Event
    from agents.core.transition import transition

    agent = client.create_agent("typist")
    replies = script(
        {"tool_calls": [{"name": "slack_post", "arguments": {"channel": "#general", "text": "hi"}}]},
        {"tool_calls": [{"name": "slack_post", "arguments": {"channel": "C0GENERAL", "text": "hi"}}]},
        {"content": "Posted."},
    )
    # As a real model would reply (the scripted provider stands in for it): nothing checked these arguments before.
    submit = Command(
        agent.id, Event.SUBMIT, "t", request_id="req-1", jobs=(JobSpec("plan", "1", payload={"input": replies}),)
    )
    transition(db, submit, input_json=json.dumps(replies))
    run_all(db)
    assert client.get_state(agent.id).phase == "done"
    told = job_row(db, scoped(agent.id, "req-1:tool:slack_post:1.call_0_0"))["result"]["content"]  # type: ignore[index]
    assert told.startswith("error: tool slack_post: channel: String should match pattern"), told
    (event,) = [
        e
        for e in client.journal(agent_id=agent.id)
        if e.details.get("job") == scoped(agent.id, "req-1:tool:slack_post:1.call_0_0")
    ]
    assert event.decision == "tool_arguments_invalid"
    assert event.details["tool_error"] == told.removeprefix("error: ")
    from models.outbox_sql import message_row

    assert message_row(db, scoped(agent.id, "req-1:slack:tool.slack_post:2.call_1_0@post"))["payload"] == {"text": "hi"}  # type: ignore[index]


def _a_gated_comment_beside_a_pending_lookup(client: Client, db: Database, name: str) -> Any:
    """An agent whose round is a GitHub comment waiting for approval and a lookup not run yet (then an answer)."""
    agent = client.create_agent(name)
    client.submit(
        agent.id,
        "req-1",
        script(
            {
                "tool_calls": [
                    {"name": "github_comment", "arguments": {"repository": "acme/api", "issue": 7, "body": "x"}},
                    {"name": "kb_lookup", "arguments": {"q": "later"}},
                ]
            },
            {"content": "Revised without commenting."},
        ),
    )
    runner = Runner(db, registry, worker="t", lease=timedelta(seconds=30), rules=FAST_RULES)
    runner.run(scoped(agent.id, "req-1:plan:1"))
    runner.run(
        scoped(agent.id, "req-1:gate:github_comment:1.call_0_0")
    )  # the lookup is still pending when the person decides
    return agent


def test_a_rejection_supersedes_the_rest_of_its_round(client: Client, db: Database) -> None:
    agent = _a_gated_comment_beside_a_pending_lookup(client, db, "mixed")
    waiting = client.get_state(agent.id)
    client.reject(waiting.id, expected_revision=waiting.revision, actor="dana", reason="no")
    assert job_row(db, scoped(agent.id, "req-1:tool:kb_lookup:1.call_0_1"))["status"] == "cancelled"  # type: ignore[index]
    run_all(db)
    assert client.get_state(agent.id).phase == "done"


def test_a_rejection_charges_what_a_superseded_step_staged_before_its_worker_died(client: Client, db: Database) -> None:
    """A call of the round had run and staged its outcome (30 tokens spent) when its worker died; the person then
    rejected the round, superseding it. No attempt will record that outcome: the rejection charges its spend, once,
    and the superseded job keeps it as a void attempt's."""
    from models.jobs_sql import checkpoint, claim

    agent = _a_gated_comment_beside_a_pending_lookup(client, db, "superseded")
    lookup = scoped(agent.id, "req-1:tool:kb_lookup:1.call_0_1")
    claimed = claim(db, lookup, "doomed", timedelta(seconds=30))
    assert not isinstance(claimed, str) and claimed is not None
    staged = {"output": {"content": "found"}, "usage": {"tokens": 30, "cost": "0.30"}}
    assert checkpoint(db, lookup, claimed.fencing_token, {"staged": {"result": staged}})  # then its worker died
    waiting = client.get_state(agent.id)
    state = client.reject(waiting.id, expected_revision=waiting.revision, actor="dana", reason="no")
    assert (state.spent_tokens, state.spent_cost) == (waiting.spent_tokens + 30, waiting.spent_cost + Decimal("0.30"))
    rejection = client.journal(agent_id=agent.id)[-1]
    assert rejection.details["staged_spend_charged"] == {"jobs": [lookup], "tokens": 30, "cost": "0.30"}
    assert rejection.details["effects"]["superseded"] == [lookup]
    row = job_row(db, lookup)
    assert row is not None and row["status"] == "cancelled" and "staged" not in (row["result"] or {})
    assert (row["failed_tokens"], row["failed_cost"]) == (30, Decimal("0.30"))
    run_all(db)
    with psycopg.connect(db.libpq_url) as raw:
        (on_jobs,) = raw.execute(  # type: ignore[misc]
            "SELECT sum(tokens + failed_tokens) FROM jobs WHERE agent_id = %s", (agent.id,)
        ).fetchone()
    final = client.get_state(agent.id)
    assert final.phase == "done" and final.spent_tokens == on_jobs, "every token charged once: as its jobs say"


def test_reused_call_ids_across_rounds_do_not_collide(client: Client, db: Database) -> None:
    agent = client.create_agent("reuser")
    same = {"tool_calls": [{"name": "kb_lookup", "arguments": {"q": "x"}}]}
    client.submit(agent.id, "req-1", script(same, same, {"content": "done"}))
    run_all(db)
    assert client.get_state(agent.id).phase == "done"
    assert job_row(db, scoped(agent.id, "req-1:tool:kb_lookup:2.call_1_0"))["status"] == "succeeded"  # type: ignore[index]


def test_a_checkpointed_reply_is_reused_not_paid_for_again(client: Client, db: Database, llm: FakeLLM) -> None:
    """The model answered, the worker died before recording it: the retry uses the stored reply."""
    import os

    from agents.jobs.handlers import JobContext
    from agents.runtime import loop as runtime
    from models.jobs_sql import claim

    llm.replies = [{"content": "stored answer", "usage": (50, 10)}]
    agent = client.create_agent("checkpointed")
    client.submit(agent.id, "req-1", {"prompt": "hi"})
    env = {
        "KEEL_LLM_PROVIDER": "openai",
        "KEEL_LLM_BASE_URL": f"{llm.url}/v1",
        "KEEL_LLM_API_KEY": "sk-test-secret-key-123",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    runtime._settings.cache_clear()
    runtime._openai_client.cache_clear()
    try:
        first = claim(db, scoped(agent.id, "req-1:plan:1"), "w1", timedelta(seconds=30))
        assert first is not None and not isinstance(first, type(None))
        ctx = JobContext(
            scoped(agent.id, "req-1:plan:1"), agent.id, "req-1", "plan", "1", {}, 1, first.fencing_token, db
        )  # type: ignore[union-attr]
        runtime.plan(ctx)  # called the model and checkpointed; "dies" before the outcome
        expire_lease(db, scoped(agent.id, "req-1:plan:1"))
        from models.jobs_sql import take_due

        with db.transaction() as cur:  # the dispatcher recovers it
            assert [d.key for d in take_due(cur, enqueue_timeout=timedelta(minutes=5), limit=5)] == [
                scoped(agent.id, "req-1:plan:1")
            ]
        run_all(db)
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
    assert sum(llm.completed.values()) == 1, "the model was called again"
    assert job_row(db, scoped(agent.id, "req-1:plan:1"))["result"]["answer"] == "stored answer"  # type: ignore[index]
    assert client.get_state(agent.id).spent_tokens == 60


def client_now() -> Any:
    from agents.core.transition import now

    return now()


@pytest.mark.parametrize(
    ("body", "headers", "error", "text"),
    [
        ({"error": "model not found"}, {}, InvalidJob, "model not found"),
        ({"error": {"message": "quota", "code": "insufficient_quota"}}, {}, InvalidJob, "no quota left"),
        (
            {"error": {"message": "slow down"}},
            {"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"},
            RateLimited,
            "slow down",
        ),
    ],
)
def test_odd_error_bodies_are_classified(
    llm: FakeLLM, body: Any, headers: dict[str, str], error: type[Exception], text: str
) -> None:
    llm.custom = (429 if error is RateLimited or "quota" in text else 404, body, headers)
    client = OpenAICompatible(f"{llm.url}/v1", "m-1", "sk-test-secret-key-123", timeout=1.0)
    with pytest.raises(error, match=text):
        client.complete([{"role": "user", "content": "hi"}], [])
    client.close()
