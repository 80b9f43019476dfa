"""A Pydantic AI agent, unchanged, run on Keel (agents/integrations/pydantic_ai.py): each model request and each tool
call is a Keel step keyed from the one before; structured output and deps work; what is paid for is charged once and
never asked again after a crash; a provider's 429 is ``rate_limited`` with its Retry-After. The model is Pydantic AI's
``FunctionModel``: no network."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai import Agent, RunContext
from pydantic_ai.exceptions import ModelHTTPError
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RequestUsage

from agents.client import Client
from agents.core.errors import InvalidInput
from agents.core.policies import ErrorClass, RetryRule
from agents.integrations import pydantic_ai as integration
from agents.integrations.pydantic_ai import KeelAgent
from agents.jobs.handlers import registry
from agents.jobs.runner import Runner
from models.db import Database
from models.jobs_sql import job_row
from tests.support.keys import scoped
from tests.support.runs import FAST_RULES, make_runner, run_all

pytestmark = pytest.mark.integration

CALLS: Counter[str] = Counter()
#: Failures retried at once: no backoff to wait out.
AT_ONCE = {**FAST_RULES, ErrorClass.UNKNOWN: RetryRule(3, 0.0, 0.0, 0.0)}


@dataclass
class Shop:
    customer: str


class Answer(BaseModel):
    order: str
    status: str
    note: str


def _model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Asks for the order, then writes a note, then answers with the structured output (its output tool)."""
    CALLS["model"] += 1
    usage = RequestUsage(input_tokens=10 * len(messages), output_tokens=5)
    returned = [p for m in messages for p in getattr(m, "parts", []) if getattr(p, "part_kind", "") == "tool-return"]
    if not returned:
        return ModelResponse(parts=[ToolCallPart("lookup_order", {"order": "A-1"}, tool_call_id="c1")], usage=usage)
    if len(returned) == 1:
        return ModelResponse(parts=[ToolCallPart("write_note", {"text": "checked"}, tool_call_id="c2")], usage=usage)
    output = info.output_tools[0].name
    answer = {"order": "A-1", "status": str(returned[0].content), "note": str(returned[1].content)}
    return ModelResponse(parts=[ToolCallPart(output, answer, tool_call_id="c3")], usage=usage)


def _support_agent() -> Agent[Shop, Answer]:
    agent: Agent[Shop, Answer] = Agent(FunctionModel(_model), deps_type=Shop, output_type=Answer, name="support")

    @agent.tool
    def lookup_order(ctx: RunContext[Shop], order: str) -> str:
        CALLS["lookup_order"] += 1
        return f"{order} shipped to {ctx.deps.customer}"

    @agent.tool_plain
    def write_note(text: str) -> str:
        CALLS["write_note"] += 1
        return f"noted: {text}"

    return agent


def _deps(given: Mapping[str, Any]) -> Shop:
    return Shop(customer=str(given.get("customer", "nobody")))


SUPPORT = KeelAgent(_support_agent(), name="pai_support", deps=_deps)


@pytest.fixture(autouse=True)
def _counted() -> None:
    CALLS.clear()


def _steps(db: Database, agent_id: Any, request_id: str) -> list[dict[str, Any]]:
    with db.connection() as conn:
        rows = conn.execute(
            "SELECT key, status, result, tokens FROM jobs WHERE agent_id = %s ORDER BY created_at, key", (agent_id,)
        ).fetchall()
    return [{"key": r[0], "status": r[1], "result": r[2], "tokens": r[3]} for r in rows]


def test_a_run_is_one_step_per_model_request_and_tool_call_with_its_structured_answer(
    client: Client, db: Database
) -> None:
    agent = client.create_agent("pai-1")
    client.submit(agent.id, "req-1", {"prompt": "where is A-1?", "customer": "ada"}, operation="pai_support")
    ran = run_all(db)
    # model, lookup_order, model, write_note, model (its output tool is checked in the same step)
    assert ran == [scoped(agent.id, f"req-1:pai_support:{n}") for n in range(1, 6)]
    assert CALLS == {"model": 3, "lookup_order": 1, "write_note": 1}
    state = client.get_state(agent.id)
    assert state.phase == "done"
    final = job_row(db, ran[-1])
    assert final is not None
    assert final["result"]["answer"] == {"order": "A-1", "status": "A-1 shipped to ada", "note": "noted: checked"}
    kinds = [u.get("kind") for row in _steps(db, agent.id, "req-1") for u in row["result"]["units"] if u.get("kind")]
    assert kinds == ["model", "tool", "model", "tool", "model"]
    # The conversation is stored with the last step: the prompt, each reply and each tool's result.
    said = str(final["result"]["messages"])
    assert "where is A-1?" in said and "A-1 shipped to ada" in said
    # Each model request's tokens were charged once, on the step that asked: 10 per message sent plus 5.
    spent = [row["tokens"] for row in _steps(db, agent.id, "req-1")]
    assert spent == [15, 0, 35, 0, 55]
    assert state.spent_tokens == 105


def test_a_step_that_died_after_its_model_reply_replays_it_and_pays_once(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker dies right after the reply was checkpointed (before its outcome): the step's next attempt replays
    the reply, the model is not asked again, and its tokens are charged once."""
    agent = client.create_agent("pai-2")
    client.submit(agent.id, "req-1", {"prompt": "where is A-1?"}, operation="pai_support")
    first = scoped(agent.id, "req-1:pai_support:1")

    class Died(Exception):
        """As a worker that dies here would: nothing after it in the step runs (in-process: an unknown failure)."""

    real = integration._Backend.execute
    died: list[str] = []

    async def dying(self: Any, **kw: Any) -> object:
        result = await real(self, **kw)
        run = integration._current.get()
        if run is not None and run.ran and not died:
            died.append(kw["name"])
            raise Died
        return result

    monkeypatch.setattr(integration._Backend, "execute", dying)
    runner = Runner(db, registry, worker="w", lease=timedelta(seconds=30), rules=AT_ONCE)
    assert runner.run(first).status == "retrying"  # (in-process: the runner sees the step end without a result)
    row = job_row(db, first)
    assert row is not None and row["result"]["units"][0]["kind"] == "model"
    assert CALLS["model"] == 1
    monkeypatch.setattr(integration._Backend, "execute", real)
    run_all(db, rules=AT_ONCE)
    assert client.get_state(agent.id).phase == "done"
    assert CALLS == {"model": 3, "lookup_order": 1, "write_note": 1}, "the paid reply was not asked for again"
    assert client.get_state(agent.id).spent_tokens == 105


def test_a_providers_429_is_rate_limited_with_its_retry_after(client: Client, db: Database) -> None:
    def limited(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        raise ModelHTTPError(429, "gpt-test", body={"error": "slow down"}, retry_after=7.0)

    KeelAgent(Agent(FunctionModel(limited), name="limited"), name="pai_limited")
    agent = client.create_agent("pai-3")
    client.submit(agent.id, "req-1", {"prompt": "hello"}, operation="pai_limited")
    key = scoped(agent.id, "req-1:pai_limited:1")
    outcome = make_runner(db).run(key)
    assert outcome.status == "retrying"
    row = job_row(db, key)
    assert row is not None and row["error_class"] == "rate_limited"
    with db.connection() as conn:
        waits = "SELECT extract(epoch FROM run_at - updated_at) FROM jobs WHERE key = %s"
        wait = conn.execute(waits, (key,)).fetchone()
    assert wait is not None and float(wait[0]) >= 7.0


def test_a_submit_without_a_prompt_is_refused_naming_the_field(client: Client) -> None:
    agent = client.create_agent("pai-4")
    with pytest.raises(InvalidInput, match=r"input of operation 'pai_support': input\.prompt: is required"):
        client.submit(agent.id, "req-1", {"customer": "ada"}, operation="pai_support")
    assert client.get_state(agent.id).phase == "idle"


def test_approve_must_name_the_agents_tools_and_the_name_must_fit_a_key() -> None:
    with pytest.raises(InvalidInput, match=r"approve names no tool of the agent: \['refnud'\] \(tools: lookup_order"):
        KeelAgent(_support_agent(), name="pai_approving", approve=["refnud"])
    with pytest.raises(InvalidInput):
        KeelAgent(_support_agent(), name="bad:name")


# --- approvals -------------------------------------------------------------------------------------------------


def _refunding_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Looks the order up, asks for a refund, then says what became of it (the refund's result, or its denial)."""
    CALLS["model"] += 1
    parts = [p for m in messages for p in getattr(m, "parts", [])]
    returned = [p for p in parts if getattr(p, "part_kind", "") in ("tool-return", "retry-prompt")]
    usage = RequestUsage(input_tokens=10, output_tokens=5)
    if not returned:
        return ModelResponse(parts=[ToolCallPart("lookup_order", {"order": "A-1"}, tool_call_id="c1")], usage=usage)
    if len(returned) == 1:
        call = ToolCallPart("refund", {"order": "A-1", "amount": 30}, tool_call_id="c2")
        return ModelResponse(parts=[call], usage=usage)
    return ModelResponse(parts=[TextPart(f"Outcome: {returned[-1].content}")], usage=usage)


REFUNDS: list[dict[str, Any]] = []


def _refunding_agent() -> Agent[None, str]:
    agent: Agent[None, str] = Agent(FunctionModel(_refunding_model), name="refunder")

    @agent.tool_plain
    def lookup_order(order: str) -> str:
        CALLS["lookup_order"] += 1
        return f"{order} arrived broken"

    @agent.tool_plain
    def refund(order: str, amount: int) -> str:
        REFUNDS.append({"order": order, "amount": amount})
        return f"refunded {amount} on {order}"

    return agent


REFUNDER = KeelAgent(_refunding_agent(), name="pai_refund", approve=["refund"])


def _held(client: Client, db: Database, name: str) -> Any:
    REFUNDS.clear()
    agent = client.create_agent(name)
    client.submit(agent.id, "req-1", {"prompt": "refund A-1"}, operation="pai_refund")
    run_all(db)
    state = client.get_state(agent.id)
    assert state.phase == "waiting_approval"
    assert state.pending_approval is not None
    assert (state.pending_approval["tool"], state.pending_approval["arguments"]) == (
        "refund",
        {"order": "A-1", "amount": 30},
    )
    assert REFUNDS == [], "nothing ran before a person decided"
    return state


def test_a_tool_named_in_approve_waits_for_a_person_and_runs_once_with_the_edited_arguments(
    client: Client, db: Database
) -> None:
    state = _held(client, db, "pai-5")
    assert [a.tool for a in client.approvals().approvals if a.agent_id == state.id] == ["refund"]
    with pytest.raises(InvalidInput, match=r"edited arguments refused: refund: arguments\.amount"):
        client.approve(
            state.id, expected_revision=state.revision, actor="carol", arguments={"order": "A-1", "amount": "lots"}
        )
    assert client.get_state(state.id).revision == state.revision, "a refused edit changed nothing"
    client.approve(state.id, expected_revision=state.revision, actor="carol", arguments={"order": "A-1", "amount": 20})
    run_all(db)
    done = client.get_state(state.id)
    assert done.phase == "done"
    assert REFUNDS == [{"order": "A-1", "amount": 20}], "the refund ran once, with the person's arguments"
    assert CALLS == {"model": 3, "lookup_order": 1}, "no model request or tool call was repeated"
    last = job_row(db, scoped(state.id, "req-1:pai_refund:5"))
    assert last is not None and last["result"]["answer"] == "Outcome: refunded 20 on A-1"


def test_a_rejected_call_never_runs_and_the_model_is_told_why(client: Client, db: Database) -> None:
    state = _held(client, db, "pai-6")
    client.reject(state.id, expected_revision=state.revision, actor="dana", reason="not without a photo")
    run_all(db)
    done = client.get_state(state.id)
    assert done.phase == "done"
    assert REFUNDS == []
    answers = [r["result"].get("answer") for r in _steps(db, state.id, "req-1") if r["result"]]
    assert "Outcome: not without a photo" in answers
