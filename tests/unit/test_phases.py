from __future__ import annotations

from pathlib import Path

from agents.core.phases import ACTIVE, MOVES, RESTING, Event, Phase, allowed_events, phases_markdown, target_of
from models.tables import PHASES

ROOT = Path(__file__).resolve().parents[2]


def test_schema_check_constraint_lists_exactly_the_phases() -> None:
    assert set(PHASES) == {p.value for p in Phase}


def test_each_source_and_event_leads_to_one_target() -> None:
    pairs = [(m.source, m.event) for m in MOVES]
    assert len(pairs) == len(set(pairs))


def test_every_phase_is_reachable_from_idle_and_every_request_can_end() -> None:
    seen, frontier = {Phase.IDLE}, [Phase.IDLE]
    while frontier:
        phase = frontier.pop()
        for event in allowed_events(phase):
            target = target_of(phase, event)
            assert target is not None
            if target not in seen:
                seen.add(target)
                frontier.append(target)
    assert seen == set(Phase)
    for phase in ACTIVE:
        assert target_of(phase, Event.CANCEL) is Phase.FAILED
        assert target_of(phase, Event.FAIL) is Phase.FAILED


def test_submit_starts_from_resting_phases_only() -> None:
    for phase in Phase:
        expected = Phase.PLANNING if phase in RESTING else None
        assert target_of(phase, Event.SUBMIT) is expected


def test_cancel_is_illegal_when_nothing_is_in_flight() -> None:
    for phase in RESTING:
        assert Event.CANCEL not in allowed_events(phase)


def test_approval_moves() -> None:
    assert target_of(Phase.WAITING_APPROVAL, Event.APPROVE) is Phase.EXECUTING
    assert target_of(Phase.WAITING_APPROVAL, Event.REJECT) is Phase.PLANNING
    assert target_of(Phase.EXECUTING, Event.APPROVE) is None


def test_docs_phase_diagram_is_generated_from_the_table() -> None:
    text = (ROOT / "docs" / "reference" / "phases.md").read_text()
    assert text == phases_markdown(), "docs/reference/phases.md is stale: run `keel docs phases`"
    for move in MOVES:
        assert f"{move.source.value} --> {move.target.value}: {move.event.value}" in text
