"""The tracing observer without services: when traces are on, what each unit of work's span is called, whose child
it is, what it says when the work failed; and what turns traces on."""

from __future__ import annotations

import io
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import structlog
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agents.core import observe
from agents.core.errors import TransientError
from agents.core.redaction import clear_secrets, register_settings
from agents.observability import logs
from agents.observability.tracing import WORKER, TracingObserver, configure_tracing, flush_tracing, traces_endpoint
from models.settings import BadConfiguration, Settings, load_settings

CALLER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
OTEL_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED")


@pytest.fixture
def no_otel_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def spans(no_otel_variables: None) -> Iterator[Callable[[], list[ReadableSpan]]]:
    exporter = InMemorySpanExporter()
    tracing = configure_tracing(Settings(otlp_endpoint="http://collector:4318"), WORKER, exporter=exporter)
    assert tracing is not None

    def finished() -> list[ReadableSpan]:
        assert tracing.flush()
        return list(exporter.get_finished_spans())

    yield finished
    tracing.shutdown()


def test_each_unit_of_work_is_a_span_named_for_it_and_current_while_it_runs(
    spans: Callable[[], list[ReadableSpan]],
) -> None:
    with observe.observe("job", "plan", job_key="r1:plan:1", request_id="r1", traceparent=CALLER) as job:
        traceparent = observe.current_traceparent()
        with observe.observe("model_call", "ScriptedProvider", request_id="r1"):
            pass
        with observe.observe("tool_call", "search") as tool:
            tool.outcome = "ok"
        job.outcome = "succeeded"
    (model, tool_span, job_span) = spans()
    assert [s.name for s in (model, tool_span, job_span)] == [
        "keel.model_call",
        "keel.tool_call search",
        "keel.job plan",
    ]
    # The job continues the trace it names; the work inside it is its child, not the named trace's.
    assert f"{job_span.context.trace_id:032x}" == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert job_span.parent is not None and f"{job_span.parent.span_id:016x}" == "00f067aa0ba902b7"
    assert model.parent is not None and model.parent.span_id == job_span.context.span_id
    assert tool_span.parent is not None and tool_span.parent.span_id == job_span.context.span_id
    assert traceparent == f"00-{job_span.context.trace_id:032x}-{job_span.context.span_id:016x}-01"
    assert job_span.attributes == {
        "keel.job_key": "r1:plan:1",
        "keel.request_id": "r1",
        "keel.outcome": "succeeded",
    }
    assert model.attributes is not None and model.attributes["keel.provider"] == "ScriptedProvider"
    assert observe.current_traceparent() is None  # nothing is current once the work is done


def test_a_traceparent_is_continued_only_by_work_that_runs_under_no_span(
    spans: Callable[[], list[ReadableSpan]],
) -> None:
    with observe.observe("transition", "submit"), observe.observe("job", "plan", traceparent=CALLER):
        pass
    with observe.observe("job", "plan", traceparent="00-not-a-trace-context"):
        pass
    nested, outer, malformed = spans()
    assert nested.parent is not None and nested.parent.span_id == outer.context.span_id
    assert outer.parent is None and malformed.parent is None  # a malformed one starts a new trace


def test_failed_work_is_an_error_span_without_the_exception_text(spans: Callable[[], list[ReadableSpan]]) -> None:
    with pytest.raises(TransientError), observe.observe("model_call", "OpenAICompatible"):
        raise TransientError("model endpoint error 503: key sk-5ecret in the text")
    with observe.observe("outbox_send", "slack", outbox_key="r1:slack:t") as send:
        send.outcome = "rate_limited"
    with observe.observe("http", "GET") as http:
        http.add(route="/v1/agents/{agent}", status=503)
        http.outcome = "503"
    with observe.observe("http", "GET") as fine:
        fine.add(route="/v1/agents/{agent}", status=404)
        fine.outcome = "404"
    model, sent, server_error, client_error = spans()
    assert (model.status.status_code.name, model.status.description) == ("ERROR", "TransientError")
    assert all("5ecret" not in str(event.attributes) for event in model.events)
    assert (sent.status.status_code.name, sent.status.description) == ("ERROR", "rate_limited")
    assert server_error.name == "HTTP GET /v1/agents/{agent}" and server_error.status.status_code.name == "ERROR"
    assert server_error.attributes is not None and server_error.attributes["http.response.status_code"] == 503
    assert client_error.status.status_code.name == "UNSET"  # the client's mistake, not the server's


def test_traces_are_off_without_an_endpoint_and_on_with_keels_or_the_standard_one(no_otel_variables: None) -> None:
    assert traces_endpoint(Settings(), {}) is None
    assert configure_tracing(Settings(), WORKER, exporter=InMemorySpanExporter()) is None
    assert not any(isinstance(o, TracingObserver) for o in observe.observers())
    assert observe.current_traceparent() is None
    keel = Settings(otlp_endpoint="http://collector:4318/")
    assert traces_endpoint(keel, {}) == "http://collector:4318/v1/traces"
    assert traces_endpoint(Settings(otlp_endpoint="http://c:4318/v1/traces"), {}) == "http://c:4318/v1/traces"
    standard = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://other:4318"}
    assert traces_endpoint(keel, standard) == "http://collector:4318/v1/traces"  # Keel's own setting wins
    assert traces_endpoint(Settings(), standard) == "http://other:4318/v1/traces"
    full = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://x/api/traces", **standard}
    assert traces_endpoint(Settings(), full) == "https://x/api/traces"
    assert traces_endpoint(keel, {"OTEL_SDK_DISABLED": "true"}) is None
    # A query (a collector's key) stays the query: the path alone gains /v1/traces.
    keyed = Settings(otlp_endpoint="http://c:4318?api_key=Q")
    assert traces_endpoint(keyed, {}) == "http://c:4318/v1/traces?api_key=Q"
    assert traces_endpoint(Settings(), {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://c/otlp/?k=v"}) == (
        "https://c/otlp/v1/traces?k=v"
    )


def test_a_bad_endpoint_is_refused_naming_the_setting() -> None:
    assert load_settings(otlp_endpoint=" ").otlp_endpoint is None
    with pytest.raises(BadConfiguration, match="KEEL_OTLP_ENDPOINT: must be an http:// or https:// URL"):
        load_settings(otlp_endpoint="collector:4317")


@pytest.fixture
def blackhole() -> Iterator[str]:
    """A collector that accepts connections and never answers: its URL."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:  # closed
                return

    accepting = threading.Thread(target=accept, daemon=True)
    accepting.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.shutdown(socket.SHUT_RDWR)  # wakes the accept() in progress
    accepting.join(10)
    server.close()
    for connection in held:
        connection.close()


#: Each export may wait this long for the collector: far beyond the bounds the tests hold Keel to.
HUNG_EXPORT = {"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "60"}


def test_a_flush_and_a_shutdown_keep_their_bounds_when_the_collector_hangs(
    blackhole: str, no_otel_variables: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name, value in HUNG_EXPORT.items():
        monkeypatch.setenv(name, value)
    tracing = configure_tracing(Settings(otlp_endpoint=blackhole), WORKER)
    assert tracing is not None
    with observe.observe("job", "plan"):
        pass
    started = time.monotonic()
    assert tracing.flush(200) is False, "the span could not be exported: said so"
    with caplog.at_level(logging.WARNING, "keel.tracing"):
        assert flush_tracing(0.2) is False
    assert "traces: the last spans were not exported within 0.2 s" in caplog.text
    assert tracing.shutdown(200) is False
    assert time.monotonic() - started < 20, "the collector's hang (60 s an export) held the caller"


def test_a_worker_process_that_ends_itself_does_not_wait_for_a_hung_collector(blackhole: str) -> None:
    script = (
        "import sys\n"
        "from agents.core.observe import observe\n"
        "from agents.observability.tracing import WORKER, configure_tracing\n"
        "from models.settings import Settings\n"
        "from tasks.jobs import end_process\n"
        "configure_tracing(Settings(otlp_endpoint=sys.argv[1]), WORKER)\n"
        "with observe('job', 'runaway', job_key='r1:runaway:1'):\n"
        "    pass\n"
        "print('ending', flush=True)\n"
        "end_process('r1:runaway:1')\n"
    )
    # A prefork child, the process that ends itself at once (a threads worker lets its other jobs finish first).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "OTEL_"))} | HUNG_EXPORT
    env["KEEL_WORKER_POOL"] = "prefork"
    started = time.monotonic()
    ended = subprocess.run(
        [sys.executable, "-c", script, blackhole], env=env, capture_output=True, text=True, timeout=120
    )
    assert ended.returncode == 70 and ended.stdout == "ending\n", ended.stderr
    # Prompt: the flush's bound (half a second) after the imports, not the collector's 60 s an export.
    assert time.monotonic() - started < 30, ended.stderr


def test_the_collectors_credentials_never_reach_a_log_line(
    no_otel_variables: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=HDRSECRET-abcdef123456")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "4")  # time for a retry, and its warning
    # Port 1: nothing listens; the exporter's own warnings quote the URL it failed to reach.
    settings = Settings(otlp_endpoint="http://127.0.0.1:1?api_key=QUERYSECRET-abcdef123456")
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    out = io.StringIO()
    try:
        register_settings(settings)
        logs.configure_logging("test", json=True, stream=out)
        tracing = configure_tracing(settings, WORKER)
        assert tracing is not None
        with observe.observe("job", "plan"):
            pass
        tracing.flush(10_000)
        logging.getLogger("keel.test").error("collector refused x-api-key=HDRSECRET-abcdef123456")
        tracing.shutdown()
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        observe.unregister(logs.LOG_CONTEXT)
        structlog.reset_defaults()
        clear_secrets()
    text = out.getvalue()
    assert "/v1/traces?api_key=***" in text, text
    assert "QUERYSECRET" not in text and "HDRSECRET" not in text
