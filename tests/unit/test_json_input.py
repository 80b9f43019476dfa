"""The one rule for JSON a person or producer sends: size, depth (brackets inside strings do not count), no NaN."""

from __future__ import annotations

import pytest

from agents.core.errors import InvalidInput
from agents.core.json_input import MAX_JSON_DEPTH, check_depth, parse_json

DEEP = f"more than {MAX_JSON_DEPTH} deep"


def test_json_nested_up_to_the_limit_parses_and_one_more_level_is_refused_naming_the_field() -> None:
    at_limit = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert parse_json("body", at_limit) is not None
    with pytest.raises(InvalidInput, match=f"^body: nests arrays and objects {DEEP}$"):
        parse_json("body", "[" + at_limit + "]")
    with pytest.raises(InvalidInput, match=DEEP):
        parse_json("body", '{"a": ' * 40_000)  # not even JSON: refused before the parser recurses


def test_brackets_inside_strings_do_not_count() -> None:
    text = '{"a": "' + "[" * 1000 + '\\"[[[", "b": ["]]]]{{{{"]}'
    assert parse_json("body", text)["b"] == ["]]]]{{{{"]


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("{oops", "input: not valid JSON: Expecting property name"),
        ('{"a": NaN}', "input: not valid JSON: NaN is not a JSON value"),
        (b'{"a": "\xff"}', "input: not UTF-8 (a bad byte at position 7)"),
        ("x" * 11, "input: must be at most 10 characters, got 11"),
    ],
)
def test_bad_json_is_refused_naming_the_field_and_the_rule(text: str | bytes, named: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        parse_json("input", text, limit=10 if len(text) == 11 else 1000)
    assert str(refused.value).startswith(named)


def test_a_value_given_as_objects_is_bounded_alike() -> None:
    value: list[object] = []
    deepest = value
    for _ in range(MAX_JSON_DEPTH - 1):
        deepest.append([])
        deepest = deepest[0]  # type: ignore[assignment]
    check_depth("input", value)
    with pytest.raises(InvalidInput, match=DEEP):
        check_depth("input", {"x": value})
    looped: list[object] = []
    looped.append(looped)
    with pytest.raises(InvalidInput, match=DEEP):
        check_depth("input", looped)
