"""The one sentence every reader uses to say what a `keel audit verify` proved (agents/core/journal/verdict.py)."""

from __future__ import annotations

from datetime import UTC, datetime

from agents.core.journal.verdict import Verdict


def test_only_checked_events_are_called_verified_and_trusted_ones_carry_their_checkpoints_times() -> None:
    full = Verdict(ok=True, full=True, chains=2, checked=8)
    assert (
        full.text() == "ok: 8 events in 2 agent chains verified in this run (full: every chain walked from its start)"
    )
    at, later = datetime(2026, 12, 6, 3, 0, tzinfo=UTC), datetime(2026, 12, 6, 4, 0, tzinfo=UTC)
    quick = Verdict(ok=True, full=False, chains=2, checked=1, trusted=7, trusted_from=at, trusted_to=later)
    assert quick.text().startswith(
        "ok: 1 events in 2 agent chains verified in this run; 7 events trusted from checkpoints of 2026-12-06 03:00:00"
        " to 2026-12-06 04:00:00 UTC, not checked in this run"
    )
    assert not Verdict(ok=False, full=True, chains=1, checked=3).text().startswith("ok")
    assert "verified" not in Verdict(ok=False, full=True, chains=1, checked=3).text()


def test_a_recorded_verdict_reads_back_as_it_was_and_an_old_record_says_nothing_it_cannot() -> None:
    at = datetime(2026, 12, 6, 3, 0, tzinfo=UTC)
    quick = Verdict(ok=True, full=False, chains=2, checked=1, trusted=7, trusted_from=at, trusted_to=at)
    assert Verdict.recorded(ok=True, agents=2, details=quick.details()) == quick
    assert Verdict.recorded(ok=True, agents=2, details={"mode": "incremental", "read_events": 0}) is None
