"""Log lines: JSON or readable, the work's context on each line (nested units, threads), secrets masked."""

from __future__ import annotations

import contextvars
import io
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from agents.core import redaction
from agents.core.observe import annotate, observe, observers, unregister
from agents.core.redaction import clear_secrets, register_secrets
from agents.observability import logs
from models.settings import Settings
from tests.support.logs import log_lines


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def out() -> Iterator[io.StringIO]:
    """The root logger writing JSON lines to a buffer (as configure_logging sets it up); restored after."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    stream = io.StringIO()
    logs.configure_logging("test", json=True, stream=stream)
    yield stream
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    unregister(logs.LOG_CONTEXT)
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    clear_secrets()


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def context(line: dict[str, Any]) -> dict[str, Any]:
    return {k: line[k] for k in logs.CONTEXT_KEYS if k in line}


log = logging.getLogger("keel.test")


def test_json_unless_told_otherwise_and_readable_on_a_terminal() -> None:
    assert logs.choose_json(None, io.StringIO()) is True  # a file, a pipe, a container's log
    assert logs.choose_json(None, Terminal()) is False
    assert logs.choose_json("json", Terminal()) is True
    assert logs.choose_json("console", io.StringIO()) is False
    with pytest.raises(ValueError, match="unknown log format 'xml'; known: json, console"):
        logs.choose_json("xml")


def test_keel_log_format_is_a_setting_and_a_bad_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_LOG_FORMAT", "json")
    assert Settings().log_format == "json"
    monkeypatch.setenv("KEEL_LOG_FORMAT", "xml")
    with pytest.raises(ValueError, match="log_format"):
        Settings()


def test_a_json_line_and_a_readable_line_of_the_same_record(out: io.StringIO) -> None:
    with observe("job", "plan", request_id="r1", job_key="r1:plan:1"):
        log.warning("job %s: slow", "r1:plan:1")
    (line,) = lines(out)
    assert list(line)[:4] == ["timestamp", "level", "logger", "event"]
    assert line["timestamp"].endswith("Z") and line["level"] == "warning" and line["logger"] == "keel.test"
    assert line["event"] == "job r1:plan:1: slow" and line["role"] == "test" and isinstance(line["pid"], int)
    assert context(line) == {"request_id": "r1", "job_key": "r1:plan:1"}

    readable = io.StringIO()
    logs.configure_logging("test", stream=readable, setting="console")
    with observe("job", "plan", request_id="r1", job_key="r1:plan:1"):
        log.warning("job %s: slow", "r1:plan:1")
    text = readable.getvalue()
    assert "[warning" in text and "job r1:plan:1: slow [keel.test] job_key=r1:plan:1 request_id=r1" in text
    assert not text.startswith("{")


def test_nested_units_add_their_context_and_take_it_back_when_they_end(out: io.StringIO) -> None:
    with observe("http", "POST", request_id="r1"):
        annotate(actor="ingest")
        log.info("request")
        with observe("job", "plan", job_key="r1:plan:1") as job:
            job.add(agent_id="a1")  # learnt once the claim found it
            with observe("model_call", "OpenAI", request_id="r1", job_key="r1:plan:1"):
                log.info("model")
                with observe("transition", "progress", agent_id="a1", actor="worker:w1"):
                    log.info("transition")
                log.info("model again")
            log.info("job")
        log.info("request again")
    log.info("outside")
    got = {line["event"]: context(line) for line in lines(out)}
    request = {"request_id": "r1", "actor": "ingest"}
    job = {**request, "job_key": "r1:plan:1", "agent_id": "a1"}
    assert got == {
        "request": request,
        "model": job,
        "transition": {**job, "actor": "worker:w1"},
        "model again": job,
        "job": job,
        "request again": request,
        "outside": {},
    }


def test_context_learnt_on_another_thread_shows_and_a_copied_context_follows_a_thread(out: io.StringIO) -> None:
    with observe("http", "GET", request_id="r1"):
        # FastAPI runs a sync dependency on a worker thread in a copy of the context: what it names still counts.
        worker = threading.Thread(target=contextvars.copy_context().run, args=(annotate,), kwargs={"agent_id": "a1"})
        worker.start()
        worker.join()
        log.info("after the dependency")
        plain = threading.Thread(target=log.info, args=("plain thread",))
        plain.start()
        plain.join()
        copied = threading.Thread(target=contextvars.copy_context().run, args=(log.info, "copied context"))
        copied.start()
        copied.join()
    got = {line["event"]: context(line) for line in lines(out)}
    assert got["after the dependency"] == {"request_id": "r1", "agent_id": "a1"}
    assert got["plain thread"] == {}, "a thread does not inherit the context by itself"
    assert got["copied context"] == {"request_id": "r1", "agent_id": "a1"}


def test_the_line_itself_and_bound_values_win_over_the_unit(out: io.StringIO) -> None:
    with observe("job", "plan", request_id="r1", job_key="r1:plan:1"):
        log.info("extra", extra={"job_key": "r1:plan:2"})
        with logs.log_context(outbox_key="r1:slack:C1", agent_id=None):
            structlog.get_logger("keel.native").info("native", count=2)
    extra, native = lines(out)
    assert extra["job_key"] == "r1:plan:2" and extra["request_id"] == "r1"
    assert native["logger"] == "keel.native" and native["count"] == 2 and native["outbox_key"] == "r1:slack:C1"
    assert "agent_id" not in native


def test_the_current_span_names_the_trace(out: io.StringIO) -> None:
    span = NonRecordingSpan(SpanContext(0xABC, 0xDEF, is_remote=False, trace_flags=TraceFlags(1)))
    with trace.use_span(span):
        log.info("traced")
    log.info("untraced")
    traced, untraced = lines(out)
    assert traced["trace_id"] == f"{0xABC:032x}" and traced["span_id"] == f"{0xDEF:016x}"
    assert "trace_id" not in untraced and "span_id" not in untraced


def test_secrets_are_masked_in_messages_values_and_tracebacks(out: io.StringIO) -> None:
    register_secrets("opaque-secret-value-42")
    log.warning("token %s", "opaque-secret-value-42")
    structlog.get_logger("keel.native").warning(
        "configured", token="opaque-secret-value-42", nested={"k": ["Bearer abc"]}
    )
    try:
        raise RuntimeError("failed with opaque-secret-value-42")
    except RuntimeError:
        log.exception("boom")
    assert "opaque-secret-value-42" not in out.getvalue() and "Bearer abc" not in out.getvalue()
    message, native, boom = lines(out)
    assert message["event"] == "token ***"
    assert native["token"] == "***" and native["nested"] == {"k": ["Bearer ***"]}
    assert "Traceback" in boom["exception"] and "RuntimeError: failed with ***" in boom["exception"]


def test_the_observer_is_registered_once(out: io.StringIO) -> None:
    logs.use_structlog()
    assert [o for o in observers() if o is logs.LOG_CONTEXT] == [logs.LOG_CONTEXT]


def test_a_value_with_unicode_line_separators_stays_one_json_line(out: io.StringIO) -> None:
    value = "a\u2028b\x85c\u2029d é"
    log.warning("odd %s", value)
    text = out.getvalue()
    assert len(text.splitlines()) == 1, "a reader that splits on every line break still sees one line"
    assert "\\u2028" in text and "é" in text  # escaped, while other text stays readable UTF-8
    (line,) = log_lines(text)
    assert line["event"] == f"odd {value}"


def test_log_lines_splits_on_newlines_only() -> None:
    text = '{"event": "a\u2028b"}\n{"event": "c"}\n'
    assert [line["event"] for line in log_lines(text)] == ["a\u2028b", "c"]


def test_each_line_is_redacted_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    original = redaction.redact

    def counted(text: str) -> str:
        if "once-marker" in text:
            calls.append(text)
        return original(text)

    monkeypatch.setattr(redaction, "redact", counted)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(redaction.RedactingFilter())  # as Celery's handlers have it before Keel restyles them
    logs.restyle([handler], "test", json=True)
    logger = logging.getLogger("keel.test.once")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        redaction.install_log_redaction([logger])  # Keel's formatter redacts: no filter is put back
        assert not handler.filters
        logger.info("once-marker %s", "Bearer abcdef123456")
    finally:
        logger.removeHandler(handler)
    assert calls == ["once-marker Bearer abcdef123456"]
    assert [line["event"] for line in lines(stream)] == ["once-marker Bearer ***"]
