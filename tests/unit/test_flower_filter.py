"""`keel flower`'s one filtered warning: Flower's unanswered start-up questions, and only while it starts."""

from __future__ import annotations

import logging
import time

from tasks.cli import _NO_REPLY, _START_SECONDS, _NoWorkerAnsweredYet


def test_flowers_unanswered_question_is_dropped_only_while_it_starts() -> None:
    """Found in review: the filter hid `Inspect method … failed` for Flower's whole life, every worker dead included."""
    record = logging.LogRecord("flower.inspector", logging.WARNING, __file__, 1, _NO_REPLY, ("stats",), None)
    other = logging.LogRecord("flower.inspector", logging.WARNING, __file__, 1, "Broker error %s", ("x",), None)
    assert not _NoWorkerAnsweredYet(time.monotonic()).filter(record)
    assert _NoWorkerAnsweredYet(time.monotonic()).filter(other)
    assert _NoWorkerAnsweredYet(time.monotonic() - _START_SECONDS - 1).filter(record)
