"""A submit is checked against what its operation needs before anything is written, and a request id submitted
again must ask for the same request: bad input and conflicting retries are refused, naming what is wrong, and change
nothing."""

from __future__ import annotations

import json
import textwrap
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

import agents.runtime.loop  # noqa: F401 - registers plan
from agents.client import Client
from agents.core import transition as core
from agents.core.commands import Command, JobSpec
from agents.core.errors import InvalidInput, RequestConflict, StaleRevision, UnknownOperation
from agents.core.phases import Event
from agents.core.policies import DEFAULT_RULES
from agents.jobs.handlers import registry
from agents.jobs.runner import Runner
from models.db import Database
from models.jobs_sql import job_row
from models.settings import BadConfiguration, Settings
from tests.support.keys import scoped

pytestmark = pytest.mark.integration

registry.declare("free")  # an operation without an input model: any JSON goes


def _footprint(raw: psycopg.Connection[Any]) -> tuple[Any, ...]:
    """Everything a refused submit must leave as it was."""
    return (
        raw.execute("SELECT count(*) FROM audit.journal").fetchone(),
        raw.execute("SELECT id, revision, phase, request_id, journal_seq FROM agents ORDER BY id").fetchall(),
        raw.execute("SELECT count(*) FROM requests").fetchone(),
        raw.execute("SELECT count(*) FROM jobs").fetchone(),
    )


BAD_INPUT: list[tuple[str, Any, str]] = [
    ("null", None, "input: must be a JSON object, got null"),
    ("a string", "hello", "input: must be a JSON object, got a string"),
    ("a list", ["hello"], "input: must be a JSON object, got an array"),
    ("no prompt", {"script": [{"content": "hi"}]}, "input.prompt: is required"),
    ("empty prompt", {"prompt": ""}, "input.prompt: string should have at least 1 character"),
    ("prompt a number", {"prompt": 7}, "input.prompt: must be a string, got a number"),
    ("a typo", {"prompt": "hi", "scirpt": []}, "input.scirpt: is not a field here (a typo?)"),
    (
        "script of numbers",
        {"prompt": "hi", "script": [1, 2]},
        "input.script[0]: must be a JSON object, got a number (and 1 more)",
    ),
    ("script an object", {"prompt": "hi", "script": {"content": "x"}}, "input.script: must be a JSON array"),
    ("empty reply", {"prompt": "hi", "script": [{}]}, "input.script[0]: a reply needs content or tool_calls"),
    ("error alone", {"prompt": "hi", "script": [{"error": "transient"}]}, "input.script[0]: a reply needs content"),
    (
        "negative tokens",
        {"prompt": "hi", "script": [{"content": "x", "tokens": -1}]},
        "input.script[0].tokens: input should be greater than or equal to 0",
    ),
    (
        "unknown error",
        {"prompt": "hi", "script": [{"error": "boom", "content": "x"}]},
        "input.script[0].error: input should be 'transient', 'rate_limited' or 'invalid'",
    ),
    (
        "call without a name",
        {"prompt": "hi", "script": [{"tool_calls": [{"arguments": {}}]}]},
        "input.script[0].tool_calls[0].name: is required",
    ),
    (
        "arguments a list",
        {"prompt": "hi", "script": [{"tool_calls": [{"name": "slack_post", "arguments": [1]}]}]},
        "input.script[0].tool_calls[0].arguments: must be a JSON object, got an array",
    ),
    (
        "a dotted tool name",
        {"prompt": "hi", "script": [{"content": "x"}, {"tool_calls": [{"name": "slack.post"}]}]},
        "input.script[1].tool_calls[0].name: there is no tool named 'slack.post' (tools: ",
    ),
    (
        "a channel name, not an id",
        {
            "prompt": "hi",
            "script": [{"tool_calls": [{"name": "slack_post", "arguments": {"channel": "#general", "text": "hi"}}]}],
        },
        "input.script[0].tool_calls[0].arguments.channel: string should match pattern '^[CGD][A-Z0-9]{1,20}$'",
    ),
    (
        "arguments of another tool",
        {
            "prompt": "hi",
            "script": [{"content": "x"}, {"tool_calls": [{"name": "slack_post", "arguments": {"chan": 1}}]}],
        },
        "input.script[1].tool_calls[0].arguments.channel: is required (and 1 more)",
    ),
    (
        "a wrong type for an argument",
        {
            "prompt": "hi",
            "script": [
                {
                    "tool_calls": [
                        {"name": "github_comment", "arguments": {"repository": "a/b", "issue": "x", "body": "b"}}
                    ]
                }
            ],
        },
        "input.script[0].tool_calls[0].arguments.issue: input should be a valid integer",
    ),
]


@pytest.mark.parametrize(("value", "message"), [(v, m) for _, v, m in BAD_INPUT], ids=[n for n, _, _ in BAD_INPUT])
def test_plan_input_that_does_not_fit_is_refused_naming_the_field_and_changes_nothing(
    client: Client, raw: psycopg.Connection[Any], value: Any, message: str
) -> None:
    agent = client.create_agent("ops")
    before = _footprint(raw)
    with pytest.raises(InvalidInput) as info:
        client.submit(agent.id, "r1", value)
    assert str(info.value).startswith(f"input of operation 'plan': {message}"), str(info.value)
    assert _footprint(raw) == before


def test_an_unknown_operation_is_refused_naming_the_known_ones(client: Client, raw: psycopg.Connection[Any]) -> None:
    agent = client.create_agent("ops")
    before = _footprint(raw)
    with pytest.raises(UnknownOperation) as info:
        client.submit(agent.id, "r1", {"prompt": "hi"}, operation="summarize")
    assert str(info.value).startswith("operation 'summarize' is unknown: no handler is registered for it (known: ")
    assert {"plan", "free"} <= set(info.value.known)
    assert _footprint(raw) == before


def test_an_operation_without_an_input_model_takes_any_json(client: Client) -> None:
    agent = client.create_agent("ops")
    for n, value in enumerate([None, "hello", [1, 2], {"anything": {"at": "all"}}]):
        state = client.submit(agent.id, f"r{n}", value, operation="free")
        assert state.request_id == f"r{n}"
        core.transition(client.db, Command(agent.id, Event.FINISH, "w"))


def test_the_client_imports_keel_imports_and_checks_their_input_models(
    db: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer checks a submit against the same handlers the workers import (KEEL_IMPORTS)."""
    module = f"keel_test_greetings_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(
            """
            from pydantic import BaseModel, ConfigDict, Field

            from agents.jobs.handlers import JobContext, JobResult, handler


            class Greeting(BaseModel):
                model_config = ConfigDict(extra="forbid")
                name: str
                times: int = Field(ge=1, le=3)


            @handler("greet", input=Greeting)
            def greet(ctx: JobContext) -> JobResult:
                return JobResult()
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    client = Client(db, Settings(imports=[module]))
    agent = client.create_agent("greeter")
    with pytest.raises(InvalidInput, match=r"^input of operation 'greet': input.times: input should be less than"):
        client.submit(agent.id, "r1", {"name": "Ada", "times": 9}, operation="greet")
    assert client.submit(agent.id, "r1", {"name": "Ada", "times": 2}, operation="greet").phase == "planning"
    broken = Client(db, Settings(imports=["keel_no_such_module_here"]))
    with pytest.raises(BadConfiguration, match="KEEL_IMPORTS: module 'keel_no_such_module_here' cannot be"):
        broken.submit(agent.id, "r2", {"prompt": "hi"})


def test_a_script_that_reached_the_database_unchecked_fails_as_invalid_not_at_the_unknown_cap(
    client: Client, db: Database
) -> None:
    """Before, a script [1, 2] crashed the step three times (unknown) and failed the agent at the unknown cap."""
    agent = client.create_agent("ops")
    bad = {"prompt": "hi", "script": [1, 2]}
    command = Command(
        agent.id,
        Event.SUBMIT,
        "legacy",
        request_id="r1",
        jobs=(JobSpec("plan", "1", payload={"input": bad}),),
    )
    core.transition(db, command, input_json='{"prompt": "hi", "script": [1, 2]}')
    key = scoped(agent.id, "r1:plan:1")
    outcome = Runner(db, registry, worker="w", lease=timedelta(seconds=30), rules=DEFAULT_RULES).run(key)
    assert outcome.status == "failed"
    job = job_row(db, key)
    assert job is not None and (job["error_class"], job["attempts"]) == ("invalid", 1)
    assert job["last_error"] == (
        "the scripted provider cannot play this script: input.script[0]: must be a JSON object, got a number"
        " (and 1 more)"
    )
    assert client.journal(agent_id=agent.id)[-1].decision == "invalid_not_retried"


# --- the same request id again -------------------------------------------------------------------------------


ASK = {"prompt": "Summarise open incidents"}


def test_a_retry_as_it_was_is_a_suppressed_duplicate(client: Client) -> None:
    agent = client.create_agent("ops")
    first = client.submit(agent.id, "r1", ASK, soft_deadline=timedelta(minutes=5), hard_deadline=timedelta(hours=1))
    again = client.submit(
        agent.id, "r1", dict(ASK), soft_deadline=timedelta(minutes=5), hard_deadline=timedelta(hours=1)
    )
    assert again == first
    assert client.journal(agent_id=agent.id)[-1].decision == "duplicate_request"


@pytest.mark.parametrize(
    ("retry", "differs"),
    [
        ({"input": {"prompt": "Summarise closed incidents"}}, ("input",)),
        ({"operation": "free"}, ("operation",)),
        ({"input": {"prompt": "other"}, "operation": "free"}, ("input", "operation")),
        ({"hard_deadline": timedelta(hours=2)}, ("hard_deadline",)),
        ({"soft_deadline": None}, ("soft_deadline",)),
        ({"hard_deadline": datetime(2099, 1, 1, tzinfo=UTC)}, ("hard_deadline",)),
    ],
)
def test_a_retry_that_asks_for_something_else_is_a_request_conflict(
    client: Client, raw: psycopg.Connection[Any], retry: dict[str, Any], differs: tuple[str, ...]
) -> None:
    agent = client.create_agent("ops")
    terms: dict[str, Any] = {"soft_deadline": timedelta(minutes=5), "hard_deadline": timedelta(hours=1)}
    client.submit(agent.id, "r1", ASK, **terms)
    state = client.get_state(agent.id)
    asked = {"input": ASK, **terms, **retry}
    with pytest.raises(RequestConflict) as info:
        client.submit(agent.id, "r1", asked.pop("input"), **asked)
    assert info.value.differs == differs
    assert str(info.value) == (
        f"request id 'r1' was submitted to agent 'ops' before with a different {' and '.join(differs)}: a retry"
        " must repeat the request as it was; use a new request id for a new request"
    )
    assert client.get_state(agent.id).revision == state.revision, "nothing moved"
    assert raw.execute("SELECT input FROM requests WHERE request_id = 'r1'").fetchone() == (ASK,)
    last = client.journal(agent_id=agent.id)[-1]
    assert (last.kind, last.decision, last.details["differs"]) == ("rejected", "request_conflict", list(differs))


def test_a_late_retry_of_an_earlier_request_with_other_input_is_a_conflict_too(client: Client) -> None:
    agent = client.create_agent("ops")
    client.submit(agent.id, "r1", ASK)
    core.transition(client.db, Command(agent.id, Event.FINISH, "w"))
    client.submit(agent.id, "r2", ASK)
    with pytest.raises(RequestConflict, match="with a different input"):
        client.submit(agent.id, "r1", {"prompt": "changed my mind"})
    assert client.submit(agent.id, "r1", ASK).request_id == "r2", "as it was: still a suppressed duplicate"


def test_another_agents_request_id_is_a_new_request_of_this_agent_that_leaves_that_one_alone(
    client: Client, raw: psycopg.Connection[Any]
) -> None:
    """Request ids are each agent's own: beta may use the id of alpha's request; it is beta's own new request (no
    conflict, no duplicate), alpha's request is as it was, and beta's journal does not name alpha."""
    a, b = client.create_agent("alpha"), client.create_agent("beta")
    client.submit(a.id, "shared", ASK)
    alphas = client.get_request(a.id, "shared")
    alpha_state = client.get_state(a.id)
    other = {"prompt": "something else entirely"}
    submitted = client.submit(b.id, "shared", other)
    assert (submitted.phase, submitted.revision, submitted.request_id) == ("planning", 1, "shared")
    assert [j.key for j in submitted.pending_jobs] == [scoped(b.id, "shared:plan:1")]
    betas = client.get_request(b.id, "shared")
    assert (betas.agent_id, betas.input) == (b.id, other)
    assert client.get_request(a.id, "shared") == alphas and client.get_state(a.id) == alpha_state
    assert [j.key for j in client.request_jobs(a.id, "shared")] == [scoped(a.id, "shared:plan:1")]
    assert raw.execute("SELECT count(*) FROM requests WHERE request_id = 'shared'").fetchone() == (2,)
    # beta's journal is read by whoever may read beta (another tenant, over HTTP): it must not name alpha.
    events = client.journal(agent_id=b.id)
    assert [(e.kind, e.decision) for e in events] == [("created", "accepted"), ("transition", "accepted")]
    told = json.dumps([e.model_dump(mode="json") for e in events])
    assert "alpha" not in told and str(a.id) not in told and a.id.hex not in told


# --- errors name the agent; numbers that cannot be stored are refused -----------------------------------------


def test_errors_name_the_agent_as_typed(client: Client) -> None:
    client.create_agent("ops-bot")
    client.submit("ops-bot", "r1", ASK)
    with pytest.raises(StaleRevision, match=r"^stale revision for agent 'ops-bot': the command expected revision 0,"):
        client.cancel("ops-bot", expected_revision=0, actor="alice")


OUT_OF_RANGE: list[tuple[str, Any, str]] = [
    (
        "budget tokens",
        lambda c, a: c.create_agent("rich", budget_tokens=2**63),
        "budget_tokens: Input should be less than or equal to 9223372036854775807",
    ),
    ("budget cost", lambda c, a: c.create_agent("rich", budget_cost="1e30"), "budget_cost"),
    ("revision", lambda c, a: c.cancel(a.id, expected_revision=2**63, actor="x"), "expected_revision must be from 0"),
    ("approve", lambda c, a: c.approve(a.id, expected_revision=-1, actor="x"), "expected_revision must be from 0"),
    ("submit revision", lambda c, a: c.submit(a.id, "r9", ASK, expected_revision=2**64), "expected_revision must"),
    ("journal limit", lambda c, a: c.journal(limit=2**63), "limit must be from 1 to 9223372036854775807"),
    ("journal limit 0", lambda c, a: c.journal(limit=0), "limit must be from 1"),
    ("list limit", lambda c, a: c.list_agents(limit=2**63 - 1), "limit must be from 1 to 9223372036854775806"),
    ("list limit 0", lambda c, a: c.list_agents(limit=0), "limit must be from 1"),
    ("deadline", lambda c, a: c.submit(a.id, "r9", ASK, hard_deadline=timedelta(days=10**8)), "hard_deadline must"),
]


@pytest.mark.parametrize(("call", "message"), [(c, m) for _, c, m in OUT_OF_RANGE], ids=[n for n, _, _ in OUT_OF_RANGE])
def test_out_of_range_numbers_are_refused_as_invalid_input(
    client: Client, raw: psycopg.Connection[Any], call: Any, message: str
) -> None:
    agent = client.create_agent("ops")
    client.submit(agent.id, "r1", ASK)
    before = _footprint(raw)
    with pytest.raises(InvalidInput, match=message):
        call(client, client.get_state(agent.id))
    assert _footprint(raw) == before
