"""Last-Event-ID: the journal seq a live-events client resumes after; anything else is refused by name."""

from __future__ import annotations

import pytest

from agents.core.errors import InvalidInput
from agents.ingress.events import MAX_SEQ, InvalidEventId, parse_last_event_id


@pytest.mark.parametrize(("value", "seq"), [(None, 0), ("", 0), ("0", 0), ("17", 17), (str(MAX_SEQ), MAX_SEQ)])
def test_a_journal_seq_is_where_the_stream_resumes(value: str | None, seq: int) -> None:
    assert parse_last_event_id(value) == seq


@pytest.mark.parametrize("value", ["-1", "abc", "1.5", "+3", " 3", "3 ", "1_000", "\u0663", "0x10"])
def test_anything_but_a_non_negative_integer_is_refused_naming_the_header_and_value(value: str) -> None:
    with pytest.raises(InvalidEventId) as info:
        parse_last_event_id(value)
    assert str(info.value) == f"Last-Event-ID {value!r} is not a journal sequence number (a non-negative integer)"
    assert isinstance(info.value, InvalidInput)  # the HTTP layer's 400


def test_a_seq_no_journal_can_hold_is_refused() -> None:
    with pytest.raises(InvalidEventId, match="larger than any journal sequence number"):
        parse_last_event_id(str(MAX_SEQ + 1))


def test_a_seq_past_the_agents_last_event_is_refused() -> None:
    assert parse_last_event_id("12", head=12) == 12
    with pytest.raises(InvalidEventId, match=r"Last-Event-ID '13' is past the agent's last journal event \(12\)"):
        parse_last_event_id("13", head=12)
