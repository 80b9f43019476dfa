"""The one hook every unit of work runs under: observers see start, context and end; a failing one fails nothing."""

from __future__ import annotations

from typing import Any

import pytest

from agents.core import observe as obs


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str | None, dict[str, str]]] = []

    def start(self, op: obs.Op) -> str:
        self.seen.append(("start", op.name, op.outcome, dict(op.context)))
        return "token"

    def added(self, op: obs.Op, context: dict[str, Any]) -> None:
        self.seen.append(("added", op.name, op.outcome, dict(op.context)))

    def end(self, op: obs.Op, token: Any) -> None:
        assert token == "token" and op.seconds is not None and op.seconds >= 0
        self.seen.append(("end", op.name, op.outcome, dict(op.context)))


class Broken:
    def start(self, op: obs.Op) -> None:
        raise RuntimeError("observer bug")

    def added(self, op: obs.Op, context: dict[str, Any]) -> None:
        raise RuntimeError("observer bug")

    def end(self, op: obs.Op, token: Any) -> None:
        raise RuntimeError("observer bug")


@pytest.fixture
def recorder() -> Any:
    rec, broken = Recorder(), Broken()
    obs.register(broken)
    obs.register(rec)
    obs.register(rec)  # once only
    yield rec
    obs.unregister(rec)
    obs.unregister(broken)


def test_start_context_and_end_are_seen_once_each(recorder: Recorder) -> None:
    with obs.observe("job", "plan", job_key="r1:plan:0", agent_id=None) as op:
        assert obs.current() is op
        obs.annotate(agent_id="a1")
        op.outcome = "succeeded"
    assert obs.current() is None
    assert recorder.seen == [
        ("start", "plan", None, {"job_key": "r1:plan:0"}),
        ("added", "plan", None, {"job_key": "r1:plan:0", "agent_id": "a1"}),
        ("end", "plan", "succeeded", {"job_key": "r1:plan:0", "agent_id": "a1"}),
    ]


def test_an_exception_names_the_outcome_and_still_propagates(recorder: Recorder) -> None:
    with pytest.raises(KeyError), obs.observe("tool_call", "search"):
        raise KeyError("x")
    assert recorder.seen[-1] == ("end", "search", "KeyError", {})


def test_nested_work_annotates_the_innermost_and_restores_the_outer(recorder: Recorder) -> None:
    with obs.observe("http", "POST") as outer:
        with obs.observe("transition", "submit") as inner:
            obs.annotate(actor="alice")
        assert obs.current() is outer
    assert inner.context == {"actor": "alice"} and outer.context == {}


def test_without_observers_it_still_times_and_tracks_the_current_op() -> None:
    assert obs.observers() == ()
    with obs.observe("model_call", "ScriptedProvider") as op:
        assert obs.current() is op
    assert op.seconds is not None and obs.current_traceparent() is None
