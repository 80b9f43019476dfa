from __future__ import annotations

import pytest

from agents.core.errors import InvalidInput
from agents.core.keys import derive, make_key, split_key, step_message_key


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


def test_a_step_derives_keys_in_its_own_request() -> None:
    step = "req-1:tool:slack_post:2.call_1"
    assert derive(step, "plan", "3") == "req-1:plan:3"
    assert derive("other:plan:1", "plan", "2") == "other:plan:2", "the request comes from the step's key"


def test_a_step_message_key_names_the_step_and_the_message() -> None:
    assert step_message_key("r1:tool:slack_post:1.call_1", "slack", "post") == "r1:slack:tool.slack_post:1.call_1@post"
    assert step_message_key("r1:gate:deploy:1.c", "slack", "approval") == "r1:slack:gate.deploy:1.c@approval"
    # The same call id in two rounds, or one name in two steps: never the same key.
    keys = {
        step_message_key(step, "slack", name)
        for step in ("r1:tool:slack_post:1.call_1", "r1:tool:slack_post:2.call_1", "r1:tool:other:1.call_1")
        for name in ("post", "summary")
    }
    assert len(keys) == 6


def test_a_long_step_message_key_is_bounded_and_still_distinct() -> None:
    step = "r" * 128 + ":tool:" + "t" * 64 + ":12." + "c" * 64
    one, two = (step_message_key(step, "github", "n" * 200 + end) for end in ("a", "b"))
    for key in (one, two):
        request, channel, target = split_key(key)
        assert (request, channel, len(target)) == ("r" * 128, "github", 256)
        assert target.startswith("tool." + "t" * 64 + ":12.")
    assert one != two
    assert make_key(*split_key(one)) == one, "a bounded key is still a valid key"


@pytest.mark.parametrize("name", ["", "a b", "x" * 257, "/lead"])
def test_a_bad_message_name_is_refused(name: str) -> None:
    with pytest.raises(InvalidInput, match="message name"):
        step_message_key("r1:tool:t:1.c", "slack", name)
