"""Any tool call id the model sends can be part of a job key; the mapping is deterministic and collision-free."""

from __future__ import annotations

import pytest

from agents.core.keys import make_key
from agents.runtime.inference import tool_call_key
from agents.runtime.loop import step_target


@pytest.mark.parametrize("call_id", ["call_0_0", "call_abc123XYZ", "toolu_01A-b", "x" * 64])
def test_key_safe_ids_are_kept(call_id: str) -> None:
    assert tool_call_key(call_id) == call_id


ODD = ["", " ", "call 1", "a/b:c", "ünï-côdé", "x" * 500, "x" * 65, "_lead", "call_0_0:..#@", "\ud800", "é", "è"]


@pytest.mark.parametrize("call_id", ODD)
def test_odd_ids_map_to_a_stable_key_safe_id(call_id: str) -> None:
    key = tool_call_key(call_id)
    assert key == tool_call_key(call_id) and tool_call_key(key) == key
    assert 1 <= len(key) <= 64
    make_key("r1", "tool", step_target("probe_echo", 3, call_id))  # raises if not key-safe


def test_different_ids_never_share_a_key() -> None:
    keys = [tool_call_key(c) for c in ODD]
    assert len(set(keys)) == len(ODD)
    assert tool_call_key("call 1").startswith("call_1-")
