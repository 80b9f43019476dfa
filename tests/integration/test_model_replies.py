"""Malformed chat-completions replies fail their step at once as ``invalid``, charged with the usage the provider
reported; odd tool call ids are mapped to key-safe ones while the model gets its own ids back.

Everything runs through a real HTTP fake of the chat-completions endpoint and the job runner.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from decimal import Decimal
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest
from pydantic import BaseModel

from agents.client import Client
from agents.core.commands import Usage
from agents.core.errors import InvalidJob
from agents.core.keys import make_key, request_key
from agents.core.policies import DEFAULT_RULES, ErrorClass, RetryRule
from agents.runtime import loop as runtime
from agents.runtime.inference import (
    OpenAICompatible,
    tool_call_key,  # type: ignore[attr-defined]
)
from agents.runtime.tools import ToolContext, ToolOutput, tool
from models.db import Database
from models.jobs_sql import job_row
from models.outbox_sql import message_row
from tests.support import runs
from tests.support.fakes import FakeLLM
from tests.support.keys import scoped

pytestmark = pytest.mark.integration

API_KEY = "sk-test-secret-key-123"
PRICES = {"m-1": {"input": 1.0, "output": 2.0}}
SEEN: list[str] = []


class Probe(BaseModel):
    q: str


@tool("probe_echo", description="Echo the query.")
def probe(args: Probe, ctx: ToolContext) -> ToolOutput:
    SEEN.append(ctx.call_id)
    return ToolOutput(f"echo {args.q}")


class RawLLM(FakeLLM):
    """The fake chat-completions server, able to answer with a body that is not JSON at all."""

    raw: bytes | None = None

    def route(self, request: BaseHTTPRequestHandler, method: str, raw: bytes) -> None:
        if self.raw is None:
            return super().route(request, method, raw)
        request.send_response(200)
        request.send_header("Content-Type", "text/html")
        request.send_header("Content-Length", str(len(self.raw)))
        request.end_headers()
        request.wfile.write(self.raw)


@pytest.fixture
def llm() -> Iterator[RawLLM]:
    fake = RawLLM(token=API_KEY, timeout_delay=1.5)
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture
def openai(llm: RawLLM) -> Iterator[RawLLM]:
    """Keel's runtime configured to call the fake server."""
    env = {
        "KEEL_LLM_PROVIDER": "openai",
        "KEEL_LLM_BASE_URL": f"{llm.url}/v1",
        "KEEL_LLM_API_KEY": API_KEY,
        "KEEL_LLM_MODEL": "m-1",
        "KEEL_LLM_PRICES": '{"m-1": {"input": 1.0, "output": 2.0}}',
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    runtime._settings.cache_clear()
    runtime._openai_client.cache_clear()
    try:
        yield llm
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


def run_all(db: Database, limit: int = 30) -> list[str]:
    return runs.run_all(db, limit, rules={**DEFAULT_RULES, ErrorClass.UNKNOWN: RetryRule(3, 0.0, 0.0, 0.0)})


USAGE = {"prompt_tokens": 1000, "completion_tokens": 200, "total_tokens": 1200}
CHARGED = Usage(1200, Decimal("0.0014"))


def _reply(message: Any) -> dict[str, Any]:
    return {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": message}], "usage": USAGE}


def _call(**fields: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [{"type": "function", **fields}]}


MALFORMED: list[tuple[str, Any, str]] = [
    ("no choices", {"id": "x", "usage": USAGE}, "no choices"),
    ("empty choices", {"choices": [], "usage": USAGE}, "no choices"),
    ("choice without message", {"choices": [{"index": 0}], "usage": USAGE}, "no message"),
    ("body is a list", [1, 2], "JSON array, not an object"),
    ("tool_calls not a list", _reply({"role": "assistant", "tool_calls": "kb_lookup"}), "tool_calls"),
    ("call without id", _reply(_call(function={"name": "probe_echo", "arguments": "{}"})), "has no id"),
    ("call id a number", _reply(_call(id=7, function={"name": "probe_echo", "arguments": "{}"})), "has no id"),
    ("call without function", _reply(_call(id="c1")), "function.name"),
    ("call without name", _reply(_call(id="c1", function={"arguments": "{}"})), "function.name"),
    ("arguments a list", _reply(_call(id="c1", function={"name": "probe_echo", "arguments": "[1, 2]"})), "object"),
    ("arguments a string", _reply(_call(id="c1", function={"name": "probe_echo", "arguments": '"q"'})), "object"),
    ("arguments not JSON", _reply(_call(id="c1", function={"name": "probe_echo", "arguments": "{q:"})), "malformed"),
    (
        "arguments nested 100,000 deep",  # was a RecursionError out of the step
        _reply(
            _call(id="c1", function={"name": "probe_echo", "arguments": '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"})
        ),
        "malformed arguments .*more than 64 deep",
    ),
    ("body nested 100,000 deep", b"[" * 100_000 + b"]" * 100_000, "not JSON"),
    (
        "text not Unicode",  # JSON may escape a lone surrogate; PostgreSQL cannot store it
        b'{"choices": [{"message": {"role": "assistant", "content": "bad \\ud800"}}], "usage": '
        b'{"prompt_tokens": 1000, "completion_tokens": 200, "total_tokens": 1200}}',
        "Unicode",
    ),
]


@pytest.mark.parametrize(("body", "problem"), [(b, p) for _, b, p in MALFORMED], ids=[n for n, _, _ in MALFORMED])
def test_a_malformed_reply_is_invalid_names_the_problem_and_carries_its_usage(
    llm: RawLLM, body: Any, problem: str
) -> None:
    if isinstance(body, bytes):
        llm.raw = body
    else:
        llm.custom = (200, body, {})
    client = OpenAICompatible(f"{llm.url}/v1", "m-1", API_KEY, timeout=2.0, prices=PRICES)
    try:
        with pytest.raises(InvalidJob, match=problem) as info:
            client.complete([{"role": "user", "content": "hi"}], [])
    finally:
        client.close()
    assert info.value.error_class == "invalid"
    has_usage = (isinstance(body, dict) and "usage" in body) or (isinstance(body, bytes) and b'"usage"' in body)
    reported = CHARGED if has_usage else Usage()
    assert info.value.usage == reported
    assert API_KEY not in str(info.value)


def test_a_body_that_is_not_json_is_invalid(llm: RawLLM) -> None:
    llm.raw = b"<html><body>502 Bad Gateway</body></html>"
    client = OpenAICompatible(f"{llm.url}/v1", "m-1", API_KEY, timeout=2.0)
    try:
        with pytest.raises(InvalidJob, match="not JSON"):
            client.complete([{"role": "user", "content": "hi"}], [])
    finally:
        client.close()


@pytest.mark.parametrize(
    "body",
    [
        {"id": "x", "usage": USAGE},
        _reply(_call(function={"name": "probe_echo", "arguments": "{}"})),
        _reply(_call(id="c1", function={"name": "probe_echo", "arguments": "[1]"})),
    ],
    ids=["no choices", "no id", "list arguments"],
)
def test_through_the_runner_a_malformed_reply_fails_at_once_and_is_charged(
    client: Client, db: Database, openai: RawLLM, body: Any
) -> None:
    openai.custom = (200, body, {})
    agent = client.create_agent("model-user")
    client.submit(agent.id, "r1", {"prompt": "hi"})
    assert run_all(db) == [scoped(agent.id, "r1:plan:1")]
    assert len(openai.requests_seen) == 1, "an invalid reply was asked for again"
    job = job_row(db, scoped(agent.id, "r1:plan:1"))
    assert job is not None
    assert (job["status"], job["attempts"], job["error_class"]) == ("failed", 1, "invalid")
    assert (job["failed_tokens"], job["failed_cost"]) == (1200, Decimal("0.0014"))
    state = client.get_state(agent.id)
    assert (state.phase, state.spent_tokens, state.spent_cost) == ("failed", 1200, Decimal("0.0014"))
    last = client.journal(agent_id=agent.id)[-1]
    assert (last.event, last.details["error_class"]) == ("fail", "invalid")


def test_a_reply_calling_a_tool_that_does_not_exist_fails_the_request_naming_it(
    client: Client, db: Database, openai: RawLLM
) -> None:
    """A model that calls a tool Keel does not have (here by its old dotted name) fails the request, visibly: in
    the state and the journal, with the tool and the tools there are, charged for the reply. Nothing is run."""
    comment = '{"repository": "acme/api", "issue": 7, "body": "Fixed"}'
    openai.replies = [
        {"tool_calls": [{"id": "c1", "name": "github.comment", "arguments": comment}]},
        {"content": "ok"},
    ]
    agent = client.create_agent("confused")
    client.submit(agent.id, "r1", {"prompt": "hi"})
    assert run_all(db) == [scoped(agent.id, "r1:plan:1")], "no tool step was scheduled"
    assert len(openai.requests_seen) == 1
    state = client.get_state(agent.id)
    assert state.phase == "failed" and state.spent_tokens > 0
    last = client.journal(agent_id=agent.id)[-1]
    assert (last.kind, last.event, last.to_phase, last.decision) == ("transition", "fail", "failed", "unknown_tool")
    assert last.details["tool"] == "github.comment"
    assert {"github_comment", "slack_post", "probe_echo"} <= set(last.details["known_tools"])
    job = job_row(db, scoped(agent.id, "r1:plan:1"))
    assert job is not None and (job["status"], job["error_class"]) == ("failed", "invalid")
    assert job["last_error"].startswith("the model called a tool that does not exist: 'github.comment' (tools: ")
    assert message_row(db, scoped(agent.id, "r1:github:tool.github_comment:1.c1@comment")) is None


ODD_IDS = ["call 1", "a/b:c", "ünï-côdé", "x" * 500, "", " ", "call_0_0:..#@"]


def test_odd_call_ids_are_mapped_for_keys_and_given_back_to_the_model_as_sent(
    client: Client, db: Database, openai: RawLLM
) -> None:
    SEEN.clear()
    calls = [{"id": cid, "name": "probe_echo", "arguments": f'{{"q": "{n}"}}'} for n, cid in enumerate(ODD_IDS)]
    calls.append({"id": "post/1", "name": "slack_post", "arguments": '{"channel": "C1", "text": "hello"}'})
    openai.replies = [{"tool_calls": calls}, {"content": "all done"}]
    agent = client.create_agent("odd")
    client.submit(agent.id, "r1", {"prompt": "hi"})
    run_all(db)
    assert client.get_state(agent.id).phase == "done"
    keys = [tool_call_key(c["id"]) for c in calls]
    assert len(set(keys)) == len(keys), "two ids mapped to one key"
    for key in keys:
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_\-]{0,63}", key), key
    assert tool_call_key("call_0_0") == "call_0_0", "ordinary ids are kept as they are"
    assert [tool_call_key(k) for k in keys] == keys, "a mapped id maps to itself"
    for n, key in enumerate(keys[:-1]):
        row = job_row(db, make_key(request_key(agent.id, "r1"), "tool", f"probe_echo:1.{key}"))
        assert row is not None and row["status"] == "succeeded", (ODD_IDS[n], row)
    assert sorted(SEEN) == sorted(keys[:-1]), "tools see the key-safe id"
    assert message_row(db, scoped(agent.id, f"r1:slack:tool.slack_post:1.{keys[-1]}@post")) is not None
    # The model gets its own ids back, each paired with its call's result.
    second = openai.requests_seen[-1]["messages"]
    results = [(m["tool_call_id"], m["content"]) for m in second if m["role"] == "tool"]
    assert results == [(cid, f"echo {n}") for n, cid in enumerate(ODD_IDS)] + [("post/1", "queued for C1")]
    assistant = next(m for m in second if m["role"] == "assistant")
    assert [c["id"] for c in assistant["tool_calls"]] == [c["id"] for c in calls]


def _to_approval_with_odd_id(client: Client, db: Database, openai: RawLLM) -> Any:
    comment = '{"repository": "acme/api", "issue": 7, "body": "Fixed"}'
    openai.replies = [
        {"tool_calls": [{"id": "call: 1/ü", "name": "github_comment", "arguments": comment}]},
        {"content": "ok"},
    ]
    agent = client.create_agent("approver")
    client.submit(agent.id, "r1", {"prompt": "hi"})
    run_all(db)
    waiting = client.get_state(agent.id)
    assert waiting.phase == "waiting_approval"
    assert waiting.pending_approval is not None and waiting.pending_approval["call_id"] == "call: 1/ü"
    return waiting


def test_an_approved_call_with_an_odd_id_runs_and_the_model_sees_its_id(
    client: Client, db: Database, openai: RawLLM
) -> None:
    waiting = _to_approval_with_odd_id(client, db, openai)
    client.approve(waiting.id, expected_revision=waiting.revision, actor="carol")
    run_all(db)
    assert client.get_state(waiting.id).phase == "done"
    odd = tool_call_key("call: 1/ü")
    assert message_row(db, scoped(waiting.id, f"r1:github:tool.github_comment:1.{odd}@comment")) is not None
    results = [m for m in openai.requests_seen[-1]["messages"] if m["role"] == "tool"]
    assert results == [{"role": "tool", "tool_call_id": "call: 1/ü", "content": "comment queued on acme/api#7"}]


def test_a_rejected_call_with_an_odd_id_is_reported_under_its_id(client: Client, db: Database, openai: RawLLM) -> None:
    waiting = _to_approval_with_odd_id(client, db, openai)
    client.reject(waiting.id, expected_revision=waiting.revision, actor="dana", reason="not today")
    run_all(db)
    assert client.get_state(waiting.id).phase == "done"
    results = [m for m in openai.requests_seen[-1]["messages"] if m["role"] == "tool"]
    assert results == [
        {"role": "tool", "tool_call_id": "call: 1/ü", "content": "A person rejected this call: not today"}
    ]
