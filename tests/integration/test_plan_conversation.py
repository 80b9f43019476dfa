"""The conversation a plan step reads, and what a request stores of it: once, on its latest plan step, continued
exactly as a rebuild from the whole request would be."""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any
from uuid import UUID

import psycopg
import pytest

from agents.client import Client
from agents.core import transition as core
from agents.core.errors import StoreError
from agents.jobs.handlers import registry
from agents.jobs.runner import Runner
from agents.runtime import loop
from agents.runtime.inference import ScriptedProvider
from agents.runtime.loop import conversation, rebuild_conversation
from models.db import Database
from models.jobs_sql import take_due
from tests.support.db import expire_lease
from tests.support.keys import scoped
from tests.support.runs import FAST_RULES, run_all

pytestmark = pytest.mark.integration


def _script() -> dict[str, Any]:
    comment = {"repository": "acme/api", "issue": 7, "body": "Fixed"}
    return {
        "prompt": "Deal with the incident",
        "script": [
            {"tool_calls": [{"name": "slack_post", "arguments": {"channel": "C1", "text": "looking"}}]},
            {
                "tool_calls": [
                    {"name": "github_comment", "arguments": comment},
                    {"name": "slack_post", "arguments": {"channel": "C1", "text": "commenting"}},
                ]
            },
            {"tool_calls": [{"name": "github_comment", "arguments": comment}]},
            {"content": "Done."},
        ],
    }


def _record_what_the_model_is_sent(monkeypatch: pytest.MonkeyPatch) -> dict[int, list[dict[str, Any]]]:
    """What each plan step sent the model, by round (a retried step must send what its first attempt did); and every
    step must read the stored conversation, never rebuild it from the whole request."""
    sent: dict[int, list[dict[str, Any]]] = {}
    real = ScriptedProvider.complete

    def recording(self: ScriptedProvider, messages: Any, tools: Any, *, attempt: int = 1) -> Any:
        round_ = 1 + sum(1 for m in messages if m.get("role") == "assistant")
        assert sent.setdefault(round_, copy.deepcopy(list(messages))) == list(messages), f"round {round_} retried"
        return real(self, messages, tools, attempt=attempt)

    def no_rebuild(*args: Any) -> Any:
        raise AssertionError("a plan step rebuilt its conversation from the whole request")

    monkeypatch.setattr(ScriptedProvider, "complete", recording)
    monkeypatch.setattr(loop, "rebuild_conversation", no_rebuild)
    return sent


def _request(agent_id: UUID, round_: int, request_id: str = "req-1") -> tuple[UUID, str, str]:
    """The agent, the request and the key of its plan step of ``round_``: what that step's reads are given."""
    return agent_id, request_id, scoped(agent_id, f"{request_id}:plan:{round_}")


def _stored_conversations(db: Database, agent_id: UUID, request_id: str) -> dict[str, int]:
    """How many messages each of an agent's request's finished plan steps stores as its conversation (steps that
    store none left out); every one keeps its reply."""
    with psycopg.connect(db.libpq_url) as raw:
        rows = raw.execute(
            "SELECT key, result FROM jobs WHERE agent_id = %s AND request_id = %s AND operation = 'plan'"
            " AND status = 'succeeded'",
            (agent_id, request_id),
        ).fetchall()
    assert rows and all("reply" in result for _, result in rows), "every plan step keeps its reply"
    return {key: len(result["conversation"]) for key, result in rows if "conversation" in result}


def test_a_request_stores_its_conversation_once_on_its_latest_plan_step(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Storage per request grows linearly with its rounds, not with their square; each step still sends the model the
    whole conversation, read from one stored row — also a step retried after a failure."""
    rounds = 12
    step = {"tool_calls": [{"name": "slack_post", "arguments": {"channel": "C1", "text": "still looking"}}]}
    entries: list[dict[str, Any]] = [dict(step) for _ in range(rounds)]
    entries[2] = {**step, "error": "transient"}  # round 3 fails once, then is retried
    entries.append({"content": "Done."})
    sent = _record_what_the_model_is_sent(monkeypatch)
    agent = client.create_agent("long-talker")
    client.submit(agent.id, "req-1", {"prompt": "Keep at it", "script": entries})
    run_all(db, limit=100)
    assert client.get_state(agent.id).phase == "done"
    monkeypatch.undo()
    assert sorted(sent) == list(range(1, rounds + 2))
    for n, messages in sent.items():
        assert messages == rebuild_conversation(db, *_request(agent.id, n))[1], f"round {n}"
    assert _stored_conversations(db, agent.id, "req-1") == {
        scoped(agent.id, f"req-1:plan:{rounds + 1}"): 2 + 2 * rounds
    }


def test_a_plan_step_continues_the_stored_conversation_exactly_as_a_rebuild_would(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through an edited approval and a rejection (which supersedes the rest of its round and re-plans: that step
    drops its predecessor's conversation too)."""
    sent = _record_what_the_model_is_sent(monkeypatch)
    agent = client.create_agent("talker")
    client.submit(agent.id, "req-1", _script())
    run_all(db)
    waiting = client.get_state(agent.id)
    edited = {"repository": "acme/api", "issue": 7, "body": "Fixed in 1.2"}
    client.approve(waiting.id, expected_revision=waiting.revision, actor="ann", arguments=edited)
    run_all(db)
    waiting = client.get_state(agent.id)
    client.reject(waiting.id, expected_revision=waiting.revision, actor="bob", reason="enough comments")
    assert _stored_conversations(db, agent.id, "req-1") == {scoped(agent.id, "req-1:plan:3"): 7}, (
        "waiting on round 3: its plan step's only"
    )
    run_all(db)
    assert client.get_state(agent.id).phase == "done"
    monkeypatch.undo()
    assert sorted(sent) == [1, 2, 3, 4]
    for n, messages in sent.items():
        assert messages == rebuild_conversation(db, *_request(agent.id, n))[1], f"round {n}"
    last = sent[4]
    roles = ["system", "user", "assistant", "tool", "assistant", "tool", "tool", "assistant", "tool"]
    assert [m["role"] for m in last] == roles
    assert last[-1]["content"] == "A person rejected this call: enough comments"
    assert last[5]["content"].startswith("A person edited this call's arguments")
    assert _stored_conversations(db, agent.id, "req-1") == {scoped(agent.id, "req-1:plan:4"): 9}
    # A past round's conversation (dropped) and steps stored before plan results carried theirs are rebuilt.
    assert conversation(db, *_request(agent.id, 4)) == (_script(), last)
    with psycopg.connect(db.libpq_url, autocommit=True) as raw:
        raw.execute(
            "UPDATE jobs SET result = result - 'conversation' WHERE agent_id = %s AND request_id = 'req-1'", (agent.id,)
        )
    assert conversation(db, *_request(agent.id, 4)) == (_script(), last)


def test_a_replayed_plan_outcome_drops_its_predecessors_conversation_as_the_first_run_would_have(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plan step 2 staged its outcome, and the transition recording it failed: nothing of it was committed, so step
    1's conversation is still there; the replay commits the whole outcome, the drop with it."""
    slack = {"tool_calls": [{"name": "slack_post", "arguments": {"channel": "C1", "text": "x"}}]}
    agent = client.create_agent("replayer")
    client.submit(agent.id, "req-1", {"prompt": "Go", "script": [slack, slack, {"content": "Done."}]})
    runner = Runner(db, registry, worker="t", lease=timedelta(seconds=30), rules=FAST_RULES)
    assert runner.run(scoped(agent.id, "req-1:plan:1")).status == "succeeded"
    assert runner.run(scoped(agent.id, "req-1:tool:slack_post:1.call_0_0")).status == "succeeded"
    real = core.transition

    def failing(db_: Database, command: Any, **kw: Any) -> Any:
        if command.outcome is not None and command.outcome.key == scoped(agent.id, "req-1:plan:2"):
            outage = psycopg.OperationalError("terminating connection due to administrator command")
            raise StoreError("database error: terminating connection due to administrator command") from outage
        return real(db_, command, **kw)

    monkeypatch.setattr(core, "transition", failing)
    with pytest.raises(StoreError):
        runner.run(scoped(agent.id, "req-1:plan:2"))
    monkeypatch.undo()
    assert _stored_conversations(db, agent.id, "req-1") == {scoped(agent.id, "req-1:plan:1"): 2}, (
        "the failed transition dropped nothing"
    )
    expire_lease(db, scoped(agent.id, "req-1:plan:2"))
    with db.transaction() as cur:
        assert [d.key for d in take_due(cur, enqueue_timeout=timedelta(minutes=5), limit=5)] == [
            scoped(agent.id, "req-1:plan:2")
        ]
    assert runner.run(scoped(agent.id, "req-1:plan:2")).status == "succeeded"
    assert _stored_conversations(db, agent.id, "req-1") == {scoped(agent.id, "req-1:plan:2"): 4}
    run_all(db)
    assert client.get_state(agent.id).phase == "done"
    assert _stored_conversations(db, agent.id, "req-1") == {scoped(agent.id, "req-1:plan:3"): 6}


def test_a_step_after_an_old_row_without_a_conversation_rebuilds_it_and_stores_its_own(
    client: Client, db: Database
) -> None:
    slack = {"tool_calls": [{"name": "slack_post", "arguments": {"channel": "C1", "text": "x"}}]}
    agent = client.create_agent("upgraded")
    client.submit(agent.id, "req-1", {"prompt": "Go", "script": [slack, slack, {"content": "Done."}]})
    runner = Runner(db, registry, worker="t", lease=timedelta(seconds=30), rules=FAST_RULES)
    assert runner.run(scoped(agent.id, "req-1:plan:1")).status == "succeeded"
    with psycopg.connect(db.libpq_url, autocommit=True) as raw:  # as an earlier version stored it
        raw.execute(
            "UPDATE jobs SET result = result - 'conversation' WHERE key = %s", (scoped(agent.id, "req-1:plan:1"),)
        )
    run_all(db)
    assert client.get_state(agent.id).phase == "done"
    assert _stored_conversations(db, agent.id, "req-1") == {scoped(agent.id, "req-1:plan:3"): 6}
    _, last = conversation(db, *_request(agent.id, 3))
    assert last == rebuild_conversation(db, *_request(agent.id, 3))[1] and len(last) == 6
