"""Traces in one process: an HTTP submit that came with a ``traceparent``, its jobs run by the real runner, its
Slack message sent by the relay — every span in the caller's trace, each under the work that caused it; the trace
stored with the jobs and the message; a retried step in the same trace. Without an endpoint: nothing at all."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any
from uuid import UUID

import httpx
import psycopg
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import BaseModel

from agents.core import observe
from agents.ingress.app import create_app
from agents.ingress.tokens import create_token
from agents.jobs.handlers import registry
from agents.jobs.runner import Runner
from agents.observability.tracing import API, TracingObserver, configure_tracing
from agents.outbox.relay import Backoff, Relay
from agents.outbox.senders import SlackSender
from agents.runtime.tools import ToolContext, ToolOutput, tool
from models.db import Database
from models.settings import Settings
from tests.support.broker import Broker
from tests.support.fakes import FakeSlack
from tests.support.keys import scoped
from tests.support.runs import FAST_RULES, run_all

pytestmark = pytest.mark.integration

SLACK_TOKEN = "xoxb-test-5ecret-slack-token"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN}-01"
OTEL_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED")


class Query(BaseModel):
    q: str


@tool("trace_search", description="Search the notes.")
def search(args: Query, ctx: ToolContext) -> ToolOutput:
    return ToolOutput(f"2 notes about {args.q}")


# The first plan attempt fails (transient), the retry replies: two runs of one job, in one trace.
SCRIPT = {
    "prompt": "Look into the incident",
    "script": [
        {
            "tool_calls": [
                {"name": "trace_search", "arguments": {"q": "db"}},
                {"name": "slack_post", "arguments": {"channel": "C1", "text": "looking"}},
            ],
            "error": "transient",
            "times": 1,
        },
        {"content": "Two notes, both about the database."},
    ],
}


@pytest.fixture
def slack() -> Iterator[FakeSlack]:
    fake = FakeSlack(token=SLACK_TOKEN)
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture
def no_otel_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def exported(no_otel_variables: None) -> Iterator[Callable[[], list[ReadableSpan]]]:
    """Traces on in this process (an endpoint is configured), exported to memory instead of over OTLP/HTTP; what
    it yields returns the spans exported so far."""
    exporter = InMemorySpanExporter()
    tracing = configure_tracing(Settings(otlp_endpoint="http://127.0.0.1:4318"), API, exporter=exporter)
    assert tracing is not None

    def spans() -> list[ReadableSpan]:
        assert tracing.flush()
        return list(exporter.get_finished_spans())

    yield spans
    tracing.shutdown()
    assert observe.current_traceparent() is None


def submit_run_and_relay(db: Database, db_url: str, broker: Broker, slack: FakeSlack) -> httpx.Response:
    """POST a request with the caller's traceparent through the real app, run its jobs with the real runner, then
    one relay pass to the fake Slack. Returns the submit's response."""
    _, secret = create_token(db, "producer", ["producer"], actor="test")
    app = create_app(broker.settings(database_url=db_url))

    async def submit() -> httpx.Response:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app),
                base_url="http://keel.test",
                headers={"Authorization": f"Bearer {secret}"},
            ) as http,
        ):
            agent = await http.post("/v1/agents", json={"name": "analyst"})
            assert agent.status_code == 201, agent.text
            return await http.post(
                f"/v1/agents/{agent.json()['id']}/requests",
                json={"input": SCRIPT},
                headers={"Idempotency-Key": "req-1", "traceparent": TRACEPARENT},
            )

    submitted = asyncio.run(submit())
    assert submitted.status_code == 201, submitted.text
    agent_id = UUID(submitted.json()["agent_id"])
    assert run_all(db) == [
        scoped(agent_id, "req-1:plan:1"),
        scoped(agent_id, "req-1:plan:1"),  # the transient failure, then its retry
        scoped(agent_id, "req-1:tool:slack_post:1.call_0_1"),
        scoped(agent_id, "req-1:tool:trace_search:1.call_0_0"),
        scoped(agent_id, "req-1:plan:2"),
    ]
    relay = Relay(
        db,
        {"slack": SlackSender(SLACK_TOKEN, f"{slack.url}/api/", timeout=2.0)},
        lease=timedelta(seconds=10),
        concurrency=2,
        backoff=Backoff(0.05, 0.2, 3, 10),
        pass_seconds=10,
        secrets=(SLACK_TOKEN,),
    )
    try:
        assert relay.run_pass().sent == 1
    finally:
        relay.close()
    assert [m["text"] for m in slack.channels["C1"]] == ["looking"]
    return submitted


def stored(db: Database) -> dict[str, str | None]:
    """The traceparent stored with each job and outbox message, by key."""
    with psycopg.connect(db.libpq_url) as conn:
        rows = conn.execute("SELECT key, traceparent FROM jobs UNION ALL SELECT key, traceparent FROM outbox")
        return dict(rows.fetchall())


def span_id(span: ReadableSpan) -> str:
    return f"{span.context.span_id:016x}"


def parent_id(span: ReadableSpan) -> str | None:
    return None if span.parent is None else f"{span.parent.span_id:016x}"


def test_one_trace_follows_a_request_from_the_http_call_to_the_slack_message(
    db: Database, db_url: str, broker: Broker, slack: FakeSlack, exported: Callable[[], list[ReadableSpan]]
) -> None:
    submitted = submit_run_and_relay(db, db_url, broker, slack)
    agent_id = UUID(submitted.json()["agent_id"])
    spans = exported()
    by_id = {span_id(s): s for s in spans}

    def only(name: str, **attributes: Any) -> ReadableSpan:
        found = [s for s in spans if s.name == name and all(s.attributes.get(k) == v for k, v in attributes.items())]  # type: ignore[union-attr]
        assert len(found) == 1, (name, attributes, [s.name for s in spans])
        return found[0]

    def parent(span: ReadableSpan) -> ReadableSpan:
        found = parent_id(span)
        assert found in by_id, f"{span.name}'s parent {found} is not a span of this request"
        return by_id[found]

    # Creating the agent was a request of its own (no traceparent: a trace of its own). Every other span, in
    # whatever thread, is in the caller's trace; only the HTTP one has its parent outside (the caller's span).
    created = only("HTTP POST /v1/agents")
    spans = [s for s in spans if s.context.trace_id != created.context.trace_id]
    by_id = {span_id(s): s for s in spans}
    assert {f"{s.context.trace_id:032x}" for s in spans} == {TRACE_ID}
    http = only("HTTP POST /v1/agents/{agent}/requests")
    assert parent_id(http) == CALLER_SPAN and http.parent is not None and http.parent.is_remote
    assert http.attributes is not None and http.attributes["http.response.status_code"] == 201
    assert http.attributes["keel.request_id"] == "req-1"
    assert submitted.headers["traceresponse"] == f"00-{TRACE_ID}-{span_id(http)}-01"
    for span in spans:
        if span is not http:
            parent(span)

    submit = only("keel.transition submit")
    assert parent(submit) is http
    plans = sorted((s for s in spans if s.name == "keel.job plan"), key=lambda s: s.start_time or 0)
    first, retry, second_round = plans
    assert [s.attributes["keel.outcome"] for s in plans] == ["retrying", "succeeded", "succeeded"]  # type: ignore[index]
    # The retry continues the trace the submit stored with the job, as the first attempt did.
    assert parent(first) is submit and parent(retry) is submit
    assert first.attributes["keel.job_key"] == retry.attributes["keel.job_key"] == scoped(agent_id, "req-1:plan:1")  # type: ignore[index]
    assert first.status.status_code.name == "ERROR" and retry.status.status_code.name == "UNSET"
    model_calls = [s for s in spans if s.name == "keel.model_call"]
    assert sorted(parent(s).attributes["keel.job_key"] for s in model_calls) == [  # type: ignore[index]
        scoped(agent_id, "req-1:plan:1"),
        scoped(agent_id, "req-1:plan:1"),
        scoped(agent_id, "req-1:plan:2"),
    ]

    # The plan's outcome transition, inside the retry's run, schedules the tool steps: they continue from it.
    planned = only("keel.transition plan")
    assert parent(planned) is retry
    search_job = only("keel.job tool", **{"keel.job_key": scoped(agent_id, "req-1:tool:trace_search:1.call_0_0")})
    post_job = only("keel.job tool", **{"keel.job_key": scoped(agent_id, "req-1:tool:slack_post:1.call_0_1")})
    assert parent(search_job) is planned and parent(post_job) is planned
    assert parent(only("keel.tool_call trace_search")) is search_job
    assert parent(only("keel.tool_call slack_post")) is post_job

    # Each tool step's outcome transition runs in its span: the slack_post step's (it ran first) emits the message,
    # whose send continues from there; the other step's, the last one, joins: it schedules the next round.
    def outcome_of(job: ReadableSpan) -> ReadableSpan:
        (found,) = (s for s in spans if s.name.startswith("keel.transition ") and parent_id(s) == span_id(job))
        return found

    emitted, joined = outcome_of(post_job), outcome_of(search_job)
    send = only("keel.outbox_send slack")
    assert parent(send) is emitted
    assert send.attributes["keel.outbox_key"] == scoped(agent_id, "req-1:slack:tool.slack_post:1.call_0_1@post")  # type: ignore[index]
    assert send.attributes["keel.outcome"] == "sent"  # type: ignore[index]
    assert parent(second_round) is joined
    assert parent(only("keel.transition finish")) is second_round

    # A late copy of a finished job's message is suppressed, in the request's trace too.
    late = Runner(db, registry, worker="late", lease=timedelta(seconds=30), rules=dict(FAST_RULES))
    assert late.run(scoped(agent_id, "req-1:plan:1")).status == "suppressed"
    (suppressed,) = (s for s in exported() if (s.attributes or {}).get("keel.outcome") == "suppressed")
    assert suppressed.name == "keel.job plan" and parent_id(suppressed) == span_id(submit)

    # What the database holds: each row carries the trace context of the transition that inserted it.
    def traceparent(span: ReadableSpan) -> str:
        return f"00-{TRACE_ID}-{span_id(span)}-01"

    assert stored(db) == {
        scoped(agent_id, "req-1:plan:1"): traceparent(submit),
        scoped(agent_id, "req-1:tool:trace_search:1.call_0_0"): traceparent(planned),
        scoped(agent_id, "req-1:tool:slack_post:1.call_0_1"): traceparent(planned),
        scoped(agent_id, "req-1:plan:2"): traceparent(joined),
        scoped(agent_id, "req-1:slack:tool.slack_post:1.call_0_1@post"): traceparent(emitted),
    }


def test_without_an_endpoint_nothing_is_traced_stored_or_exported(
    db: Database, db_url: str, broker: Broker, slack: FakeSlack, no_otel_variables: None
) -> None:
    exporter = InMemorySpanExporter()
    assert configure_tracing(Settings(), API, exporter=exporter) is None
    assert not any(isinstance(o, TracingObserver) for o in observe.observers())
    submitted = submit_run_and_relay(db, db_url, broker, slack)
    assert "traceresponse" not in submitted.headers
    assert set(stored(db).values()) == {None}
    assert exporter.get_finished_spans() == ()


APPROVER_TRACE = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
APPROVER = f"00-{APPROVER_TRACE}-bbbbbbbbbbbbbbbb-01"
NEEDS_APPROVAL = {
    "prompt": "Comment on the issue",
    "script": [
        {"tool_calls": [{"name": "github_comment", "arguments": {"repository": "acme/api", "issue": 7, "body": "Ok"}}]},
        {"content": "Commented."},
    ],
}


def call(app: Any, secret: str | None, steps: Callable[[httpx.AsyncClient], Any]) -> Any:
    """Run ``steps`` against the app (its lifespan around them), as a client with ``secret`` (None: no token)."""

    async def run() -> Any:
        headers = {} if secret is None else {"Authorization": f"Bearer {secret}"}
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://keel.test", headers=headers
            ) as http,
        ):
            return await steps(http)

    return asyncio.run(run())


def trace_of(traceparent: str | None) -> str | None:
    return None if traceparent is None else traceparent.split("-")[1]


def test_an_approval_in_a_trace_of_its_own_keeps_the_request_in_the_requests_trace(
    db: Database, db_url: str, broker: Broker, exported: Callable[[], list[ReadableSpan]]
) -> None:
    _, secret = create_token(db, "person", ["producer", "approver"], actor="test")
    app = create_app(broker.settings(database_url=db_url))

    async def submit(http: httpx.AsyncClient) -> UUID:
        agent = await http.post("/v1/agents", json={"name": "commenter"})
        submitted = await http.post(
            f"/v1/agents/{agent.json()['id']}/requests",
            json={"input": NEEDS_APPROVAL},
            headers={"Idempotency-Key": "req-a", "traceparent": TRACEPARENT},
        )
        assert submitted.status_code == 201, submitted.text
        return UUID(agent.json()["id"])

    agent_id = call(app, secret, submit)
    assert run_all(db) == [scoped(agent_id, "req-a:plan:1"), scoped(agent_id, "req-a:gate:github_comment:1.call_0_0")]

    async def approve(http: httpx.AsyncClient) -> httpx.Response:
        state = await http.get(f"/v1/agents/{agent_id}")
        assert state.json()["phase"] == "waiting_approval"
        return await http.post(
            f"/v1/agents/{agent_id}/approve", headers={"If-Match": state.headers["ETag"], "traceparent": APPROVER}
        )

    approved = call(app, secret, approve)
    assert approved.status_code == 200, approved.text
    assert trace_of(approved.headers["traceresponse"]) == APPROVER_TRACE  # the approver's call is its own trace
    run_all(db)

    # The request's trace is stored with it; every job and message of the request carries it, those the approval
    # scheduled too.
    with psycopg.connect(db.libpq_url) as conn:
        (request_trace,) = conn.execute(  # type: ignore[misc]
            "SELECT traceparent FROM requests WHERE agent_id = %s AND request_id = 'req-a'", (agent_id,)
        ).fetchone()
    assert trace_of(request_trace) == TRACE_ID
    rows = stored(db)
    assert scoped(agent_id, "req-a:github:tool.github_comment:1.call_0_0@comment") in rows and len(rows) >= 3, rows
    assert {key: trace_of(value) for key, value in rows.items()} == dict.fromkeys(rows, TRACE_ID)

    spans = exported()
    (decision,) = (s for s in spans if s.name == "keel.transition approve")
    assert f"{decision.context.trace_id:032x}" == APPROVER_TRACE
    assert [f"{link.context.trace_id:032x}" for link in decision.links] == [TRACE_ID], "linked to the request"
    (http,) = (s for s in spans if s.name == "HTTP POST /v1/agents/{agent}/approve")
    assert http.attributes is not None and http.attributes["keel.request_id"] == "req-a"
    runs = [s for s in spans if s.name.startswith("keel.job ")]
    assert len(runs) >= 3 and {f"{s.context.trace_id:032x}" for s in runs} == {TRACE_ID}
    later = [s for s in spans if s.start_time and decision.start_time and s.start_time > decision.start_time]
    assert {f"{s.context.trace_id:032x}" for s in later if not s.name.startswith("HTTP ")} == {TRACE_ID}


def test_an_idempotency_key_names_the_request_only_once_the_submit_checked_it(
    db: Database, db_url: str, broker: Broker, exported: Callable[[], list[ReadableSpan]]
) -> None:
    _, secret = create_token(db, "producer", ["producer"], actor="test")
    app = create_app(broker.settings(database_url=db_url))

    async def unauthenticated(http: httpx.AsyncClient) -> list[int]:
        health = await http.get("/healthz", headers={"Idempotency-Key": "victim-request"})
        listed = await http.get("/v1/agents", headers={"Idempotency-Key": "victim-request"})
        return [health.status_code, listed.status_code]

    assert call(app, None, unauthenticated) == [200, 401]

    async def malformed(http: httpx.AsyncClient) -> int:
        agent = await http.post("/v1/agents", json={"name": "analyst"})
        bad = await http.post(
            f"/v1/agents/{agent.json()['id']}/requests",
            json={"input": NEEDS_APPROVAL},
            headers={"Idempotency-Key": "bad key!"},
        )
        return bad.status_code

    assert call(app, secret, malformed) == 422  # the key is refused: it names no request
    named = {s.name: (s.attributes or {}).get("keel.request_id") for s in exported() if s.name.startswith("HTTP ")}
    assert named == {
        "HTTP GET /healthz": None,
        "HTTP GET unmatched": None,  # refused by the token gate, before routing
        "HTTP POST /v1/agents": None,
        "HTTP POST /v1/agents/{agent}/requests": None,
    }
