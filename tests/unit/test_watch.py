"""What `keel run/submit/wait --follow` shows on a terminal: numbers as every other command prints them."""

from __future__ import annotations

import io
from decimal import Decimal
from types import SimpleNamespace

from rich.console import Console

from agents.cli.common import fields_text
from agents.cli.watch import _panel


def test_the_live_view_prints_numbers_as_keel_state_does() -> None:
    """It printed `tokens 1641` where `keel state` prints `1,641`."""
    state = SimpleNamespace(
        name="ops-bot",
        request_id="r1",
        phase="executing",
        revision=7,
        spent_tokens=1641,
        spent_cost=Decimal("0.002000"),
        pending_approval=None,
    )
    out = io.StringIO()
    Console(file=out, width=200).print(_panel(state, ()))
    assert "tokens 1,641  cost 0.002" in out.getvalue(), out.getvalue()


def test_field_lists_spell_booleans_and_nothing_as_json() -> None:
    """`keel outbox show` printed Python's `False`."""
    text = fields_text({"needs_reconcile": False, "sent": True, "last_error": None, "attempts": 2})
    assert text.splitlines() == ["needs_reconcile  false", "sent             true", "last_error       null",
                                 "attempts         2"]  # fmt: skip
