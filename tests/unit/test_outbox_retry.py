"""The relay's retry decision (pure) and the outbox settings that bound it."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from uuid import uuid4

import pytest
from pydantic import ValidationError

from agents.outbox.relay import Backoff, GiveUp, Retry, next_step
from agents.outbox.senders import SendFailed
from models.outbox_sql import ClaimedMessage
from models.settings import Settings

BACKOFF = Backoff(1.0, 60.0, max_attempts=12, max_rate_limited=200)
MESSAGE = ClaimedMessage("r:slack:t", "slack", "C1", {"text": "x"}, 1, 0, 1, False, datetime.now(UTC), uuid4())


def test_eleven_rate_limits_leave_every_attempt_for_other_failures() -> None:
    limited = replace(MESSAGE, attempts=1, rate_limited_attempts=11)
    assert isinstance(next_step(limited, SendFailed("ambiguous", "HTTP 500"), "HTTP 500", BACKOFF), Retry)
    assert isinstance(next_step(limited, SendFailed("rate_limited", "429", 2.0), "429", BACKOFF), Retry)


def test_rate_limits_wait_as_asked_and_end_at_their_own_cap() -> None:
    step = next_step(replace(MESSAGE, rate_limited_attempts=3), SendFailed("rate_limited", "429", 7.0), "429", BACKOFF)
    assert isinstance(step, Retry) and 7.0 <= step.delay <= 7.1
    capped = replace(MESSAGE, attempts=0, rate_limited_attempts=199)
    step = next_step(capped, SendFailed("rate_limited", "429", 7.0), "429", BACKOFF)
    assert step == GiveUp("rate limited 200 times (KEEL_OUTBOX_MAX_RATE_LIMITED): 429")


def test_other_failures_end_at_max_attempts_and_permanent_ones_at_once() -> None:
    assert next_step(replace(MESSAGE, attempts=12), SendFailed("transient", "x"), "x", BACKOFF) == GiveUp(
        "gave up after 12 attempts: x"
    )
    assert isinstance(next_step(replace(MESSAGE, attempts=11), SendFailed("transient", "x"), "x", BACKOFF), Retry)
    assert next_step(MESSAGE, SendFailed("permanent", "404"), "404", BACKOFF) == GiveUp("404")


def test_a_reconciliation_budget_must_fit_in_the_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_OUTBOX_LEASE_SECONDS", "30")
    monkeypatch.setenv("KEEL_HTTP_TIMEOUT_SECONDS", "10")
    monkeypatch.setenv("KEEL_OUTBOX_RECONCILE_SECONDS", "20")
    with pytest.raises(ValidationError, match="KEEL_OUTBOX_RECONCILE_SECONDS \\+ KEEL_HTTP_TIMEOUT_SECONDS"):
        Settings()
    monkeypatch.setenv("KEEL_OUTBOX_RECONCILE_SECONDS", "15")
    assert Settings().outbox_reconcile_seconds == 15
    monkeypatch.delenv("KEEL_OUTBOX_RECONCILE_SECONDS")
    assert (Settings().outbox_reconcile_seconds, Settings().outbox_max_rate_limited) == (None, 200)
