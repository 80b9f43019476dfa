"""Progress of long commands: plain lines when the output is not a terminal, a live display when it is."""

from __future__ import annotations

import io

from agents.cli.progress import Progress


def test_plain_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    progress = Progress(out)
    assert not progress.live
    progress.line("Keel demo")
    with progress.task("running 2 requests", total=2) as step:
        step.update(completed=1, status="planning 1")  # shown live only: no line for it here
        progress.line("  planning 1, done 1")
        step.advance()
    progress.table("KPIs:", ("KPI", "value"), [("failure rate", "0%")], ["  failure rate   0%"])
    lines = out.getvalue().splitlines()
    assert lines[:3] == ["Keel demo", "running 2 requests ...", "  planning 1, done 1"]
    assert lines[3].startswith("running 2 requests: done in ")
    assert lines[4:] == ["", "KPIs:", "  failure rate   0%"]
    assert "\x1b" not in out.getvalue(), "no terminal codes in a pipe"


def test_a_live_display_nests_steps_and_leaves_one_line_per_step() -> None:
    out = io.StringIO()
    progress = Progress(out, live=True)
    with progress.task("relay runs", total=2) as outer:
        with progress.task("seeding 50 outbox messages") as inner:
            inner.update(status="half")
        outer.advance(2)
    progress.table("KPIs:", ("KPI", "value"), [("failure rate", "0%")], ["unused"])
    text = out.getvalue()
    assert "seeding 50 outbox messages: done in" in text and "relay runs: done in" in text
    assert "failure rate" in text and "unused" not in text
