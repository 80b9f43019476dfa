"""The tracing observer without services: when traces are on, what each unit of work's span is called, whose child
it is, what it says when the work failed; and what turns traces on."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agents.core import observe
from agents.core.errors import TransientError
from agents.observability.tracing import WORKER, TracingObserver, configure_tracing, traces_endpoint
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


def test_a_bad_endpoint_is_refused_naming_the_setting() -> None:
    assert load_settings(otlp_endpoint=" ").otlp_endpoint is None
    with pytest.raises(BadConfiguration, match="KEEL_OTLP_ENDPOINT: must be an http:// or https:// URL"):
        load_settings(otlp_endpoint="collector:4317")
