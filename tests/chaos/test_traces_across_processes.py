"""One trace follows a request across real processes: `keel serve`, a prefork `keel worker` and `keel beat` export
their spans over OTLP/HTTP to a collector this test runs; the spans they send (decoded from the wire's protobuf)
form one tree under the caller's span, from the HTTP submit to the Slack message's send."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from uuid import UUID

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from models.db import Database
from tests.chaos.conftest import Stack, wait_until
from tests.support.api import running_api
from tests.support.broker import Broker
from tests.support.fakes import FakeSlack
from tests.support.keys import scoped

pytestmark = pytest.mark.chaos

SLACK_TOKEN = "xoxb-trace-slack-token-000"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


#: The spans of the request, in the order they start.
EXPECTED = [
    "HTTP POST /v1/agents/{agent}/requests",
    "keel.transition submit",
    "keel.job plan",  # the first attempt (transient failure) ...
    "keel.model_call",
    "keel.transition progress",  # ... its outcome (retry), journaled
    "keel.job plan",  # ... and the retry
    "keel.model_call",
    "keel.transition plan",
    "keel.job tool",
    "keel.tool_call slack_post",
    "keel.transition observe",  # the tool's outcome, which emits the message and joins into the next round
    "keel.outbox_send slack",
    "keel.job plan",
    "keel.model_call",
    "keel.transition finish",
]


@dataclass(frozen=True)
class Received:
    service: str
    instance: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    attributes: dict[str, str]


class Collector:
    """An OTLP/HTTP trace receiver on 127.0.0.1: ``POST /v1/traces`` with a protobuf ExportTraceServiceRequest."""

    def __init__(self) -> None:
        self.spans: list[Received] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                collector.receive(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def receive(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received = Received(
                        service=resource["service.name"],
                        instance=resource["service.instance.id"],
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(),
                        name=span.name,
                        attributes={a.key: a.value.string_value or str(a.value.int_value) for a in span.attributes},
                    )
                    with self.lock:
                        self.spans.append(received)

    def of_trace(self, trace_id: str) -> list[Received]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]


@pytest.fixture
def collector() -> Iterator[Collector]:
    running = Collector()
    running.thread.start()
    yield running
    running.server.shutdown()
    running.server.server_close()


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_one_trace_follows_a_request_across_the_api_the_worker_and_the_relay(
    stack: Stack, db: Database, db_url: str, broker: Broker, tmp_path: Path, collector: Collector, pool: str
) -> None:
    slack = FakeSlack(token=SLACK_TOKEN).start()
    assert isinstance(slack, FakeSlack)
    try:
        traced = {
            "KEEL_OTLP_ENDPOINT": collector.url,
            "OTEL_BSP_SCHEDULE_DELAY": "200",  # export every 0.2 s, not 5 s: the test does not wait long
            "KEEL_SLACK_TOKEN": SLACK_TOKEN,
            "KEEL_SLACK_API_URL": f"{slack.url}/api/",
        }
        stack.env.update(traced)
        stack.worker("w1", concurrency=2, KEEL_WORKER_POOL=pool)  # prefork: each child sets up its own exporter
        stack.beat()
        with running_api(db, db_url, broker, tmp_path, env=traced) as api, api.http(api.token("producer")) as http:
            agent = http.post("/v1/agents", json={"name": "traced"}).json()
            script = [
                {
                    "tool_calls": [{"name": "slack_post", "arguments": {"channel": "C1", "text": "on it"}}],
                    "error": "transient",  # the first attempt fails: its retry stays in the trace
                    "times": 1,
                },
                {"content": "Posted."},
            ]
            submitted = http.post(
                f"/v1/agents/{agent['id']}/requests",
                json={"input": {"prompt": "Tell the channel", "script": script}},
                headers={"Idempotency-Key": "req-x", "traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"},
            )
            assert submitted.status_code == 201, submitted.text
            assert submitted.headers["traceresponse"].startswith(f"00-{TRACE_ID}-")
            wait_until("the request done", lambda: http.get(f"/v1/agents/{agent['id']}").json()["phase"] == "done", 90)
        wait_until("the message sent", lambda: stack.query("SELECT status FROM outbox") == [("sent",)], 60)
        wait_until("every span exported", lambda: len(collector.of_trace(TRACE_ID)) >= len(EXPECTED), 30)
        assert [m["text"] for m in slack.channels["C1"]] == ["on it"]
    finally:
        slack.stop()

    spans = collector.of_trace(TRACE_ID)
    by_id = {s.span_id: s for s in spans}
    names = sorted(s.name for s in spans)
    assert names == sorted(EXPECTED), names
    (http_span,) = (s for s in spans if s.name.startswith("HTTP "))
    assert http_span.parent_id == CALLER_SPAN and http_span.service == "keel-api"
    for span in spans:
        if span is not http_span:
            assert span.parent_id in by_id, f"{span.name}: its parent is not in the trace"
    # Each process role exported its own part: the API its request and submit, the worker the runs and the send
    # (in prefork its children: the parent runs no task).
    assert {s.service for s in spans} == {"keel-api", "keel-worker"}
    assert {s.service for s in spans if s.name.startswith(("HTTP ", "keel.transition submit"))} == {"keel-api"}
    (send,) = (s for s in spans if s.name == "keel.outbox_send slack")
    assert send.service == "keel-worker" and send.attributes["keel.outbox_key"] == scoped(
        UUID(agent["id"]), "req-x:slack:tool.slack_post:1.call_0_0@post"
    )
    worker_pids = {s.instance.rsplit(":", 1)[1] for s in spans if s.service == "keel-worker"}
    if pool == "prefork":
        assert str(stack.procs["w1"].pid) not in worker_pids
    else:
        assert worker_pids == {str(stack.procs["w1"].pid)}
    # The trace stored with the rows is this one.
    stored = stack.query("SELECT traceparent FROM jobs UNION ALL SELECT traceparent FROM outbox")
    assert stored and all(row[0].split("-")[1] == TRACE_ID for row in stored)
    assert "traces: keel-beat spans go to" in stack.log("beat")
