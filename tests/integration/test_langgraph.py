"""A LangGraph graph, unchanged, run on Keel (agents/integrations/langgraph.py) through the same seam as a Pydantic AI
agent (agents/integrations/steps.py): one super-step per Keel step, each recorded so a retried step never runs a
finished super-step again; model tokens charged once; ``interrupt()`` held in Keel's gate for a revision-checked
approve, edit-and-approve or reject; a node's ``send()`` through the outbox. The model is LangChain's fake chat
model: no network."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode
from langgraph.types import interrupt

from agents.client import Client
from agents.core.commands import MessageSpec
from agents.core.errors import StoreError
from agents.integrations import langgraph as integration
from agents.integrations.langgraph import KeelGraph
from models.db import Database
from models.jobs_sql import job_row
from tests.integration.test_staged_outcomes import _failing_once, _recovered
from tests.support.keys import scoped
from tests.support.runs import make_runner, run_all

pytestmark = pytest.mark.integration

CALLS: Counter[str] = Counter()


@tool
def lookup(order: str) -> str:
    """Look an order up."""
    CALLS["lookup"] += 1
    return f"{order} arrived broken"


@tool
def refund(order: str, amount: int) -> str:
    """Refund an order, once a person approved it."""
    decision = interrupt({"tool": "refund", "arguments": {"order": order, "amount": amount}})
    if not decision["approved"]:
        return f"not refunded: {decision['reason']}"
    amount = int((decision.get("arguments") or {}).get("amount", amount))
    CALLS["refund"] += 1
    integration.send(MessageSpec("slack", "C0PS", "refund", {"text": f"refunded {amount} on {order}"}))
    return f"refunded {amount} on {order}"


def _replies(*calls: dict[str, Any]) -> Iterator[AIMessage]:
    usage = {"input_tokens": 20, "output_tokens": 5, "total_tokens": 25}
    for n, call in enumerate(calls):
        yield AIMessage("", tool_calls=[{**call, "id": f"c{n}"}], usage_metadata=usage)
    yield AIMessage("All handled.", usage_metadata=usage)


def _graph(*calls: dict[str, Any]) -> StateGraph[Any]:
    """An agent node (the fake model's scripted replies) and a ToolNode, as LangGraph's tutorials build them."""
    model = GenericFakeChatModel(messages=_replies(*calls))

    def agent(state: MessagesState) -> dict[str, Any]:
        CALLS["model"] += 1
        return {"messages": [model.invoke(state["messages"])]}

    def route(state: MessagesState) -> str:
        last = state["messages"][-1]
        return "tools" if isinstance(last, AIMessage) and last.tool_calls else END

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", ToolNode([lookup, refund]))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", route, ["tools", END])
    builder.add_edge("tools", "agent")
    return builder


LOOKUP = {"name": "lookup", "args": {"order": "A-1"}}
REFUND = {"name": "refund", "args": {"order": "A-1", "amount": 30}}


@pytest.fixture(autouse=True)
def _counted() -> None:
    CALLS.clear()


def _held(client: Client, db: Database, name: str, operation: str) -> Any:
    KeelGraph(_graph(LOOKUP, REFUND), name=operation)
    agent = client.create_agent(name)
    client.submit(agent.id, "req-1", {"prompt": "refund A-1"}, operation=operation)
    run_all(db)
    state = client.get_state(agent.id)
    assert state.phase == "waiting_approval"
    assert state.pending_approval is not None
    assert (state.pending_approval["tool"], state.pending_approval["arguments"]) == ("refund", REFUND["args"])
    assert CALLS == {"model": 2, "lookup": 1}, "nothing refunded before a person decided"
    return state


def test_a_graph_runs_one_super_step_per_step_and_charges_each_model_call_once(client: Client, db: Database) -> None:
    KeelGraph(_graph(LOOKUP), name="lg_lookup")
    agent = client.create_agent("lg-1")
    client.submit(agent.id, "req-1", {"prompt": "where is A-1?"}, operation="lg_lookup")
    ran = run_all(db)
    assert ran == [scoped(agent.id, f"req-1:lg_lookup:{n}") for n in (1, 2, 3)]  # agent, tools, agent
    state = client.get_state(agent.id)
    assert (state.phase, state.spent_tokens) == ("done", 50)
    assert CALLS == {"model": 2, "lookup": 1}
    final = job_row(db, ran[-1])
    assert final is not None and final["result"]["answer"] == "All handled."
    assert (client.outcome(agent.id, "req-1").answer, client.outcome(agent.id, "req-1").tokens) == ("All handled.", 50)
    said = [m["data"]["content"] for m in final["result"]["messages"]]
    assert said[0] == "where is A-1?" and "A-1 arrived broken" in said
    with db.connection() as conn:
        moves = conn.execute(
            "SELECT event FROM audit.journal WHERE agent_id = %s AND kind = 'transition' ORDER BY seq", (agent.id,)
        ).fetchall()
    assert [m[0] for m in moves] == ["submit", "plan", "observe", "finish"]


def test_an_interrupt_waits_for_a_person_and_resumes_with_the_edited_arguments(client: Client, db: Database) -> None:
    state = _held(client, db, "lg-2", "lg_refund")
    client.approve(state.id, expected_revision=state.revision, actor="carol", arguments={"order": "A-1", "amount": 20})
    run_all(db)
    done = client.get_state(state.id)
    assert done.phase == "done"
    assert CALLS == {"model": 3, "lookup": 1, "refund": 1}
    with db.connection() as conn:
        sent = conn.execute("SELECT payload FROM outbox WHERE agent_id = %s", (state.id,)).fetchall()
    assert [s[0]["text"] for s in sent] == ["refunded 20 on A-1"], "the node's message left through the outbox once"


def test_a_rejected_interrupt_resumes_with_the_reason_and_nothing_is_refunded(client: Client, db: Database) -> None:
    state = _held(client, db, "lg-3", "lg_reject")
    client.reject(state.id, expected_revision=state.revision, actor="dana", reason="photo first")
    run_all(db)
    assert client.get_state(state.id).phase == "done"
    assert CALLS["refund"] == 0
    with db.connection() as conn:
        results = conn.execute(
            "SELECT result FROM jobs WHERE agent_id = %s AND result ? 'answer'", (state.id,)
        ).fetchall()
    contents = [m["data"]["content"] for m in results[0][0]["messages"]]
    assert "not refunded: photo first" in contents


def test_a_super_step_whose_outcome_failed_to_record_is_not_run_again(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    KeelGraph(_graph(LOOKUP), name="lg_retry")
    agent = client.create_agent("lg-4")
    client.submit(agent.id, "req-1", {"prompt": "where is A-1?"}, operation="lg_retry")
    first = scoped(agent.id, "req-1:lg_retry:1")
    _failing_once(monkeypatch, first)
    with pytest.raises(StoreError):
        make_runner(db).run(first)
    _recovered(db, first)
    run_all(db)
    state = client.get_state(agent.id)
    assert (state.phase, state.spent_tokens) == ("done", 50)
    assert CALLS == {"model": 2, "lookup": 1}, "the recorded super-step's model call was not made again"


def test_keel_graph_takes_a_builder_not_a_compiled_graph() -> None:
    from agents.core.errors import InvalidJob

    with pytest.raises(InvalidJob, match="takes a StateGraph \\(not compiled\\), got CompiledStateGraph"):
        KeelGraph(_graph(LOOKUP).compile(), name="lg_compiled")  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_step_that_died_after_recording_its_super_step_takes_it_from_there(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker dies right after the super-step's checkpoint was stored on the job (before its outcome): the next
    attempt restores it instead of running the super-step (its model call) again, and charges its tokens once."""
    from datetime import timedelta

    from agents.core.policies import ErrorClass, RetryRule
    from agents.integrations.steps import StepState
    from agents.jobs.handlers import registry
    from agents.jobs.runner import Runner
    from tests.support.runs import FAST_RULES

    class Died(BaseException):
        """As a worker that dies here would (in-process: the handler's thread ends with it, an unknown failure)."""

    real = StepState.checkpoint
    died: list[int] = []

    def dying(self: StepState) -> None:
        real(self)
        if not died:
            died.append(self.number)
            raise Died

    KeelGraph(_graph(LOOKUP), name="lg_died")
    monkeypatch.setattr(StepState, "checkpoint", dying)
    agent = client.create_agent("lg-5")
    client.submit(agent.id, "req-1", {"prompt": "where is A-1?"}, operation="lg_died")
    at_once = {**FAST_RULES, ErrorClass.UNKNOWN: RetryRule(3, 0.0, 0.0, 0.0)}
    runner = Runner(db, registry, worker="w", lease=timedelta(seconds=30), rules=at_once)
    assert runner.run(scoped(agent.id, "req-1:lg_died:1")).status == "retrying"
    assert CALLS == {"model": 1}
    run_all(db, rules=at_once)
    state = client.get_state(agent.id)
    assert (state.phase, state.spent_tokens) == ("done", 50)
    assert CALLS == {"model": 2, "lookup": 1}, "the recorded super-step was not run again"


def test_the_conversation_that_led_to_an_interrupt_reads_as_a_person_reads_it(client: Client, db: Database) -> None:
    state = _held(client, db, "lg-6", "lg_said")
    said = client.conversation(state.id, "req-1")
    refund_args = {"order": "A-1", "amount": 30}  # as the model gave them
    assert said == [
        {"role": "user", "content": "refund A-1"},
        {"role": "assistant", "content": "", "calls": [{"tool": "lookup", "arguments": {"order": "A-1"}}]},
        {"role": "tool", "content": "A-1 arrived broken"},
        {"role": "assistant", "content": "", "calls": [{"tool": "refund", "arguments": refund_args}]},
    ]


# --- what LangGraph's semantics would otherwise let through ---------------------------------------------------


def test_a_message_sent_before_interrupt_is_sent_once_by_the_run_that_finishes_the_node(
    client: Client, db: Database
) -> None:
    """A node sends, then interrupts; resumed, it runs again from its start and sends again: only that run's message
    leaves (the held super-step's is dropped), so one message, whatever LangGraph reruns."""

    def ask(state: MessagesState) -> dict[str, Any]:
        integration.send(MessageSpec("slack", "C0PS", "heads-up", {"text": "a refund waits for you"}))
        decision = interrupt({"tool": "refund", "arguments": {"order": "A-1", "amount": 5}})
        return {"messages": [AIMessage(f"approved: {decision['approved']}")]}

    builder = StateGraph(MessagesState)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", END)
    KeelGraph(builder, name="lg_heads_up")
    agent = client.create_agent("lg-7")
    client.submit(agent.id, "req-1", {"prompt": "refund"}, operation="lg_heads_up")
    run_all(db)
    held = client.get_state(agent.id)
    assert held.phase == "waiting_approval"
    client.approve(agent.id, expected_revision=held.revision, actor="carol")
    run_all(db)
    assert client.get_state(agent.id).phase == "done"
    with db.connection() as conn:
        sent = conn.execute("SELECT count(*) FROM outbox WHERE agent_id = %s", (agent.id,)).fetchone()
    assert sent == (1,)


def test_a_graph_that_cycles_stops_at_its_recursion_limit_counted_over_the_run(client: Client, db: Database) -> None:
    def spin(state: MessagesState) -> dict[str, Any]:
        CALLS["spin"] += 1
        return {}

    builder = StateGraph(MessagesState)
    builder.add_node("spin", spin)
    builder.add_edge(START, "spin")
    builder.add_edge("spin", "spin")
    KeelGraph(builder, name="lg_spin", recursion_limit=5)
    agent = client.create_agent("lg-8")
    client.submit(agent.id, "req-1", {"prompt": "go"}, operation="lg_spin")
    run_all(db)
    state = client.get_state(agent.id)
    assert state.phase == "failed"
    assert CALLS["spin"] == 5  # as a plain LangGraph run with recursion_limit=5 (langgraph 1.2): five, then refused
    row = job_row(db, scoped(agent.id, "req-1:lg_spin:6"))
    assert row is not None and row["error_class"] == "invalid" and "recursion limit" in row["last_error"]


def test_two_interrupts_at_once_are_each_held_and_answered_in_turn(client: Client, db: Database) -> None:
    """Two parallel branches interrupt in one super-step: each waits in its own gate, and each decision resumes the
    interrupt it was given for."""

    def branch(name: str) -> Any:
        def node(state: MessagesState) -> dict[str, Any]:
            decision = interrupt({"tool": f"deploy_{name}", "arguments": {"service": name}})
            return {"messages": [AIMessage(f"{name}: {'deployed' if decision['approved'] else 'kept'}")]}

        return node

    builder = StateGraph(MessagesState)
    builder.add_node("api", branch("api"))
    builder.add_node("web", branch("web"))
    builder.add_edge(START, "api")
    builder.add_edge(START, "web")
    builder.add_edge("api", END)
    builder.add_edge("web", END)
    KeelGraph(builder, name="lg_two")
    agent = client.create_agent("lg-9")
    client.submit(agent.id, "req-1", {"prompt": "deploy both"}, operation="lg_two")
    decided = []
    for _ in range(2):
        run_all(db)
        held = client.get_state(agent.id)
        assert held.phase == "waiting_approval" and held.pending_approval is not None
        tool = held.pending_approval["tool"]
        decided.append(tool)
        if tool == "deploy_api":
            client.approve(agent.id, expected_revision=held.revision, actor="carol")
        else:
            client.reject(agent.id, expected_revision=held.revision, actor="carol", reason="not today")
    run_all(db)
    assert client.get_state(agent.id).phase == "done"
    assert sorted(decided) == ["deploy_api", "deploy_web"]
    said = {m["content"] for m in client.conversation(agent.id, "req-1")}
    assert {"api: deployed", "web: kept"} <= said
