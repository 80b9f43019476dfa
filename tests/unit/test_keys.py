from __future__ import annotations

import pytest

from agents.core.errors import InvalidInput
from agents.core.keys import make_key, split_key


def test_key_scheme_is_request_operation_target() -> None:
    assert make_key("req-1", "tool", "search:call_7") == "req-1:tool:search:call_7"
    assert split_key("req-1:tool:search:call_7") == ("req-1", "tool", "search:call_7")


def test_same_inputs_same_key() -> None:
    assert make_key("r", "plan", "step-1") == make_key("r", "plan", "step-1")


@pytest.mark.parametrize(
    ("request_id", "operation", "target"),
    [
        ("", "plan", "x"),
        ("a:b", "plan", "x"),
        ("r", "pl an", "x"),
        ("r", "plan", ""),
        ("r", "plan", "x" * 300),
    ],
)
def test_bad_segments_are_refused(request_id: str, operation: str, target: str) -> None:
    with pytest.raises(InvalidInput):
        make_key(request_id, operation, target)
