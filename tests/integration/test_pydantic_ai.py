"""A Pydantic AI agent, unchanged, run on Keel (agents/integrations/pydantic_ai.py): each model request and each tool
call is a Keel step keyed from the one before; structured output and deps work; what is paid for is charged once and
never asked again after a crash; a provider's 429 is ``rate_limited`` with its Retry-After. The model is Pydantic AI's
``FunctionModel``: no network."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai import Agent, RunContext
from pydantic_ai.exceptions import ModelHTTPError
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RequestUsage

from agents.client import Client
from agents.core.commands import MessageSpec
from agents.core.errors import InvalidInput, InvalidJob, StoreError
from agents.core.policies import ErrorClass, RetryRule
from agents.integrations import pydantic_ai as integration
from agents.integrations.pydantic_ai import KeelAgent
from agents.jobs.handlers import registry
from agents.jobs.runner import Runner
from models.db import Database
from models.jobs_sql import job_row
from tests.support.api import Api
from tests.support.broker import Broker
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
    outcome = client.outcome(agent.id, "req-1")  # what every door shows as the request's answer and spend
    assert (outcome.answer, outcome.tokens) == (final["result"]["answer"], state.spent_tokens)
    units = [u for row in _steps(db, agent.id, "req-1") for u in row["result"]["record"]["units"]]
    kinds = [u.get("kind") for u in units if u.get("kind")]
    assert kinds == ["model", "tool", "model", "tool", "model"]
    # The conversation is stored with the last step: the prompt, each reply and each tool's result.
    said = str(final["result"]["messages"])
    assert "where is A-1?" in said and "A-1 shipped to ada" in said
    # Each model request's tokens were charged once, on the step that asked: 10 per message sent plus 5.
    spent = [row["tokens"] for row in _steps(db, agent.id, "req-1")]
    assert spent == [15, 0, 35, 0, 55]
    assert state.spent_tokens == 105


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_step_that_died_after_its_model_reply_replays_it_and_pays_once(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker dies right after the reply was checkpointed (before its outcome): the step's next attempt replays
    the reply, the model is not asked again, and its tokens are charged once."""
    agent = client.create_agent("pai-2")
    client.submit(agent.id, "req-1", {"prompt": "where is A-1?"}, operation="pai_support")
    first = scoped(agent.id, "req-1:pai_support:1")

    class Died(BaseException):
        """As a worker that dies here would: nothing after it in the step runs (in-process: the handler's thread ends
        with it, an unknown failure)."""

    real = integration._Backend.execute
    died: list[str] = []

    async def dying(self: Any, **kw: Any) -> object:
        result = await real(self, **kw)
        run = integration._units.get()
        if run is not None and run.ran and not died:
            died.append(kw["name"])
            raise Died
        return result

    monkeypatch.setattr(integration._Backend, "execute", dying)
    runner = Runner(db, registry, worker="w", lease=timedelta(seconds=30), rules=AT_ONCE)
    assert runner.run(first).status == "retrying"  # (in-process: the runner sees the step end without a result)
    row = job_row(db, first)
    assert row is not None and row["result"]["record"]["units"][0]["kind"] == "model"
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
    assert last is not None and last["result"]["answer"].endswith("refunded 20 on A-1")


def test_a_rejected_call_never_runs_and_the_model_is_told_why(client: Client, db: Database) -> None:
    state = _held(client, db, "pai-6")
    client.reject(state.id, expected_revision=state.revision, actor="dana", reason="not without a photo")
    run_all(db)
    done = client.get_state(state.id)
    assert done.phase == "done"
    assert REFUNDS == []
    answers = [r["result"].get("answer") for r in _steps(db, state.id, "req-1") if r["result"]]
    assert "Outcome: not without a photo" in answers


def test_the_budget_stops_the_run_before_its_next_step_once_spent(client: Client, db: Database) -> None:
    """Each step's spend is charged when it is recorded; a run over its agent's budget stops before the next step,
    as Keel's own loop does: the model is not asked again."""
    agent = client.create_agent("pai-7", budget_tokens=40)
    client.submit(agent.id, "req-1", {"prompt": "where is A-1?"}, operation="pai_support")
    run_all(db)
    state = client.get_state(agent.id)
    assert state.phase == "failed"
    # 15 (first request) + 35 (second) = 50 > 40: stopped before the next step, the second reply's tool call
    assert state.spent_tokens == 50
    assert CALLS == {"model": 2, "lookup_order": 1}
    with db.connection() as conn:
        decided = conn.execute(
            "SELECT decision FROM audit.journal WHERE agent_id = %s ORDER BY seq DESC LIMIT 1", (agent.id,)
        ).fetchone()
    assert decided == ("budget_exhausted",)


def test_an_edit_is_told_to_the_model_with_the_tools_result(client: Client, db: Database) -> None:
    state = _held(client, db, "pai-8")
    client.approve(state.id, expected_revision=state.revision, actor="carol", arguments={"order": "A-1", "amount": 20})
    run_all(db)
    final = [r["result"] for r in _steps(db, state.id, "req-1") if r["result"] and "answer" in r["result"]]
    assert final and final[0]["answer"].startswith("Outcome: A person edited this call's arguments before approving")
    assert "amount: 30 → 20" in final[0]["answer"] and final[0]["answer"].endswith("refunded 20 on A-1")


def test_a_call_id_reused_in_a_later_reply_is_held_again_not_taken_as_approved(client: Client, db: Database) -> None:
    """Some providers number calls per reply (call_0 each time): a person's decision answers the call it was given
    for, where the run held it, never a later one that happens to share its id."""

    def reusing(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        done = [p for m in messages for p in getattr(m, "parts", []) if getattr(p, "part_kind", "") == "tool-return"]
        if len(done) < 2:
            order = f"O{len(done)}"
            return ModelResponse(parts=[ToolCallPart("refund", {"order": order, "amount": 10}, tool_call_id="call_0")])
        return ModelResponse(parts=[TextPart("both handled")])

    agent_def: Agent[None, str] = Agent(FunctionModel(reusing), name="reuser")

    @agent_def.tool_plain
    def refund(order: str, amount: int) -> str:
        REFUNDS.append({"order": order, "amount": amount})
        return f"refunded {order}"

    KeelAgent(agent_def, name="pai_reuse", approve=["refund"])
    REFUNDS.clear()
    agent = client.create_agent("pai-9")
    client.submit(agent.id, "req-1", {"prompt": "two refunds"}, operation="pai_reuse")
    run_all(db)
    first = client.get_state(agent.id)
    assert first.phase == "waiting_approval"
    client.approve(agent.id, expected_revision=first.revision, actor="carol")
    run_all(db)
    second = client.get_state(agent.id)
    assert second.phase == "waiting_approval", "the second call (same id, later reply) waits for its own decision"
    assert second.pending_approval is not None and second.pending_approval["arguments"]["order"] == "O1"
    assert REFUNDS == [{"order": "O0", "amount": 10}]
    client.reject(agent.id, expected_revision=second.revision, actor="dana", reason="one is enough")
    run_all(db)
    assert client.get_state(agent.id).phase == "done"
    assert REFUNDS == [{"order": "O0", "amount": 10}]


def test_cost_prices_each_reply_once_and_a_failing_price_fails_the_step_charged(client: Client, db: Database) -> None:
    from decimal import Decimal

    KeelAgent(_support_agent(), name="pai_priced", deps=_deps, cost=lambda r: Decimal("0.01") * len(r.parts))
    agent = client.create_agent("pai-10")
    client.submit(agent.id, "req-1", {"prompt": "where is A-1?"}, operation="pai_priced")
    run_all(db)
    state = client.get_state(agent.id)
    assert (state.phase, state.spent_tokens, state.spent_cost) == ("done", 105, Decimal("0.03"))

    def broken(response: ModelResponse) -> Decimal:
        raise ValueError("no price list")

    KeelAgent(_support_agent(), name="pai_unpriced", deps=_deps, cost=broken)
    CALLS.clear()
    agent = client.create_agent("pai-11")
    client.submit(agent.id, "req-1", {"prompt": "where is A-1?"}, operation="pai_unpriced")
    run_all(db)
    state = client.get_state(agent.id)
    assert (state.phase, state.spent_tokens) == ("failed", 15), "the reply's tokens are charged, once"
    assert CALLS["model"] == 1, "the paid reply was not asked for again"
    row = job_row(db, scoped(agent.id, "req-1:pai_unpriced:1"))
    assert row is not None and row["error_class"] == "invalid" and "cost= could not price" in row["last_error"]


def test_a_failure_after_a_paid_reply_is_charged_once_and_not_retried(client: Client, db: Database) -> None:
    """An output validator that raises (not ModelRetry) after the model answered: the step fails as invalid, its
    reply charged once; retried, it would replay the reply and fail alike."""

    def answering(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        CALLS["model"] += 1
        return ModelResponse(parts=[TextPart("done")], usage=RequestUsage(input_tokens=7, output_tokens=3))

    failing: Agent[None, str] = Agent(FunctionModel(answering), name="validating")

    @failing.output_validator
    def check(output: str) -> str:
        raise KeyError("the validator's lookup table")

    KeelAgent(failing, name="pai_validating")
    agent = client.create_agent("pai-12")
    client.submit(agent.id, "req-1", {"prompt": "hi"}, operation="pai_validating")
    run_all(db, rules=AT_ONCE)
    state = client.get_state(agent.id)
    assert (state.phase, state.spent_tokens, CALLS["model"]) == ("failed", 10, 1)
    row = job_row(db, scoped(agent.id, "req-1:pai_validating:1"))
    assert row is not None and row["error_class"] == "invalid"
    assert "after paid work this step checkpointed" in row["last_error"]


# --- messages through the outbox -------------------------------------------------------------------------------

ANNOUNCED: list[str] = []


def _announcing_agent() -> Agent[None, str]:
    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if not any(getattr(p, "part_kind", "") == "tool-return" for m in messages for p in getattr(m, "parts", [])):
            return ModelResponse(parts=[ToolCallPart("announce", {"text": "A-1 refunded"}, tool_call_id="a1")])
        return ModelResponse(parts=[TextPart("announced")])

    agent: Agent[None, str] = Agent(FunctionModel(model), name="announcer")

    @agent.tool_plain
    def announce(text: str) -> str:
        ANNOUNCED.append(text)
        integration.send(MessageSpec("slack", "C0PS", "post", {"text": text}))
        return "posted"

    return agent


KeelAgent(_announcing_agent(), name="pai_announce")


def test_a_tools_message_leaves_through_the_outbox_once_keyed_from_its_step(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tool sends a Slack message through Keel; the step's outcome fails to be recorded once (the database went
    away): the retry replays the tool's checkpointed result and message, so the tool ran once and one message,
    keyed from the tool's step, is in the outbox."""
    from tests.integration.test_staged_outcomes import _failing_once, _recovered

    ANNOUNCED.clear()
    agent = client.create_agent("pai-13")
    client.submit(agent.id, "req-1", {"prompt": "announce it"}, operation="pai_announce")
    runner = make_runner(db)
    first, tool_step = (scoped(agent.id, f"req-1:pai_announce:{n}") for n in (1, 2))
    assert runner.run(first).status == "succeeded"
    _failing_once(monkeypatch, tool_step)
    with pytest.raises(StoreError):
        runner.run(tool_step)
    _recovered(db, tool_step)
    run_all(db)
    assert client.get_state(agent.id).phase == "done"
    assert ANNOUNCED == ["A-1 refunded"], "the tool ran once"
    with db.connection() as conn:
        rows = conn.execute("SELECT key, destination FROM outbox WHERE agent_id = %s", (agent.id,)).fetchall()
    assert rows == [(f"{tool_step.rsplit(':', 2)[0]}:slack:pai_announce.2@post", "C0PS")]


def test_send_outside_a_tool_of_a_keel_run_is_refused() -> None:
    with pytest.raises(InvalidJob, match=r"send\(\) is for an agent's tool while Keel runs it"):
        integration.send(MessageSpec("slack", "C0PS", "post", {"text": "hi"}))


def test_a_cancel_between_steps_ends_the_run_and_no_further_call_is_made(client: Client, db: Database) -> None:
    agent = client.create_agent("pai-14")
    client.submit(agent.id, "req-1", {"prompt": "where is A-1?"}, operation="pai_support")
    runner = make_runner(db)
    assert runner.run(scoped(agent.id, "req-1:pai_support:1")).status == "succeeded"
    client.cancel(agent.id, actor="carol", reason="wrong customer")
    assert run_all(db) == [], "the next step was cancelled with the request"
    state = client.get_state(agent.id)
    assert (state.phase, state.spent_tokens) == ("failed", 15)
    assert CALLS == {"model": 1}
    row = job_row(db, scoped(agent.id, "req-1:pai_support:2"))
    assert row is not None and row["status"] == "cancelled"


def test_a_tool_marked_requires_approval_in_pydantic_ai_waits_as_one_named_in_approve(
    client: Client, db: Database
) -> None:
    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if not any(getattr(p, "part_kind", "") == "tool-return" for m in messages for p in getattr(m, "parts", [])):
            return ModelResponse(parts=[ToolCallPart("wipe", {"disk": "sdb"}, tool_call_id="w1")])
        return ModelResponse(parts=[TextPart("wiped")])

    wiper: Agent[None, str] = Agent(FunctionModel(model), name="wiper")
    wiped: list[str] = []

    @wiper.tool_plain(requires_approval=True)
    def wipe(disk: str) -> str:
        wiped.append(disk)
        return f"{disk} wiped"

    KeelAgent(wiper, name="pai_wipe")  # no approve=[...]: the tool itself asks for a person
    agent = client.create_agent("pai-15")
    client.submit(agent.id, "req-1", {"prompt": "wipe sdb"}, operation="pai_wipe")
    run_all(db)
    held = client.get_state(agent.id)
    assert held.phase == "waiting_approval" and held.pending_approval is not None
    assert (held.pending_approval["tool"], held.pending_approval["arguments"]) == ("wipe", {"disk": "sdb"})
    assert wiped == []
    client.approve(agent.id, expected_revision=held.revision, actor="carol")
    run_all(db)
    assert client.get_state(agent.id).phase == "done"
    assert wiped == ["sdb"]


def test_the_conversation_that_led_to_a_held_call_reads_as_a_person_reads_it(client: Client, db: Database) -> None:
    state = _held(client, db, "pai-16")
    said = client.conversation(state.id, "req-1")
    refund_args = {"order": "A-1", "amount": 30}  # as the model gave them
    assert said == [
        {"role": "user", "content": "refund A-1"},
        {"role": "assistant", "content": "", "calls": [{"tool": "lookup_order", "arguments": {"order": "A-1"}}]},
        {"role": "tool", "content": "A-1 arrived broken"},
        {"role": "assistant", "content": "", "calls": [{"tool": "refund", "arguments": refund_args}]},
    ]


def test_the_console_shows_an_approver_the_conversation_that_led_to_the_call(
    api: Api, client: Client, db: Database
) -> None:
    from html import unescape

    from tests.support.console import Browsers

    state = _held(client, db, "pai-17")
    browsers = Browsers(api)
    try:
        page = browsers.signed_in(api.token("approver")).get(f"/agents/{state.id}").text
        said = unescape(page.split('id="conversation"', 1)[1].split("</details>", 1)[0])
        assert "refund A-1" in said and "lookup_order" in said and "A-1 arrived broken" in said
        assert said.index("refund A-1") < said.index("lookup_order") < said.index("A-1 arrived broken")
        # Once done, the whole conversation is part of the request's story (an operator's page), the answer last.
        client.approve(state.id, expected_revision=state.revision, actor="carol")
        run_all(db)
        page = browsers.signed_in(api.token("operator")).get(f"/agents/{state.id}").text
        story = unescape(page.split('id="request-conversation"', 1)[1].split("</details>", 1)[0])
        assert story.rstrip().endswith("</ol>") and "Outcome: refunded 30 on A-1" in story
    finally:
        browsers.close()


def test_the_cli_submits_to_a_registered_agents_operation(db_url: str, client: Client, db: Database) -> None:
    """`keel submit … --operation NAME`: the CLI's door to an agent registered by a KEEL_IMPORTS module; an operation
    nobody registered is refused naming the known ones, and changes nothing."""
    from tests.support.cli import keel

    agent = client.create_agent("pai-cli")
    imports = '["tests.support.pai_agents"]'
    refused = keel(db_url, "submit", "pai-cli", "r1", "--operation", "pai_shp", "--input", "{}", check=False)
    assert refused.returncode != 0 and "pai_shp" in refused.stderr and "Traceback" not in refused.stderr
    assert client.get_state(agent.id).phase == "idle"
    done = keel(
        db_url,
        "submit",
        "pai-cli",
        "r1",
        "--operation",
        "pai_ship",
        "--input",
        '{"prompt": "ship A-1"}',
        KEEL_IMPORTS=imports,
    )
    assert "planning" in done.stdout
    assert job_row(db, scoped(agent.id, "r1:pai_ship:1")) is not None


def test_http_submits_to_an_agents_operation_and_refuses_a_bad_input_naming_the_field(
    client: Client, db: Database, db_url: str, broker: Broker, tmp_path: Path
) -> None:
    """The HTTP door: POST /v1/agents/{agent}/requests with the operation of an agent a KEEL_IMPORTS module registers
    in the API's process; its input checked against the agent's input model (a prompt is required) before anything
    is written."""
    from tests.support.api import running_api

    agent = client.create_agent("pai-http")
    imports = {"KEEL_IMPORTS": '["tests.support.handlers", "tests.support.pai_agents"]'}
    with running_api(db, db_url, broker, tmp_path, env=imports) as api, api.http(api.token("producer")) as http:
        path = f"/v1/agents/{agent.id}/requests"
        no_prompt = {"input": {"order": "A-1"}, "operation": "pai_ship"}
        bad = http.post(path, json=no_prompt, headers={"Idempotency-Key": "r0"})
        assert bad.status_code == 422 and "input.prompt" in bad.text, bad.text
        assert client.get_state(agent.id).phase == "idle"
        made = http.post(
            path, json={"input": {"prompt": "ship A-1"}, "operation": "pai_ship"}, headers={"Idempotency-Key": "r1"}
        )
        assert made.status_code == 201, made.text
    assert client.get_state(agent.id).phase == "planning"
    assert job_row(db, scoped(agent.id, "r1:pai_ship:1")) is not None


def test_the_http_story_carries_the_conversation_the_client_reads(api: Api, client: Client, db: Database) -> None:
    """Every door reads the same conversation: HttpClient (the story's) as Client."""
    from agents.client import HttpClient

    state = _held(client, db, "pai-18")
    with HttpClient(api.url, api.token("operator")) as http:
        assert http.conversation(state.id, "req-1") == client.conversation(state.id, "req-1")
