"""JSON a person or producer sends, parsed and bounded by one rule: :func:`parse_json`. The API's bodies, the
console's edit-and-approve form and the ``keel`` command's ``--input``, ``--arguments`` and ``--script`` all go
through it: at most ``limit`` characters, arrays and objects nested at most :data:`MAX_JSON_DEPTH` deep (checked
before parsing, so a deep document never reaches the recursive parser), no NaN or Infinity (PostgreSQL's jsonb
has neither). Anything else is :class:`InvalidInput` naming the field and the rule."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from agents.core.errors import InvalidInput

#: How deep arrays and objects may nest: far beyond any real input, far below what would exhaust a parser's stack.
MAX_JSON_DEPTH = 64
#: The default size limit (characters): the API's default body limit.
MAX_JSON_CHARS = 256 * 1024

# A JSON string (escapes included) or one bracket: strings are skipped, brackets counted.
_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.S)


def too_deep(text: str) -> bool:
    """Whether ``text`` nests arrays and objects more than :data:`MAX_JSON_DEPTH` deep (brackets inside strings do
    not count; a document that is not JSON at all may pass, for the parser to refuse)."""
    depth = 0
    for token in _TOKENS.finditer(text):
        bracket = token.group()
        if bracket in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return True
        elif bracket in "]}":
            depth -= 1
    return False


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def parse_json(field: str, text: str | bytes, *, limit: int = MAX_JSON_CHARS) -> Any:
    """The value the JSON ``text`` holds, if it is at most ``limit`` characters (bytes, given bytes), nested at most
    :data:`MAX_JSON_DEPTH` deep and valid JSON; else :class:`InvalidInput` naming ``field`` and the rule (where the
    JSON breaks, by line and column; never the text itself)."""
    if len(text) > limit:
        raise InvalidInput(f"{field}: must be at most {limit} characters, got {len(text)}")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInput(f"{field}: not UTF-8 (a bad byte at position {exc.start})") from None
    if too_deep(text):
        raise InvalidInput(f"{field}: nests arrays and objects more than {MAX_JSON_DEPTH} deep")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"{field}: not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except ValueError as exc:
        raise InvalidInput(f"{field}: not valid JSON: {exc}") from None


def check_depth(field: str, value: Any) -> None:
    """The same bound for a value given as Python objects (a producer's input, a person's edited arguments through
    the client): arrays and objects nested more than :data:`MAX_JSON_DEPTH` deep are :class:`InvalidInput`."""
    level = [value]
    depth = 0
    while level:
        containers = [v for v in level if isinstance(v, Mapping | list | tuple)]
        if not containers:
            return
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise InvalidInput(f"{field}: nests arrays and objects more than {MAX_JSON_DEPTH} deep")
        level = [item for c in containers for item in (c.values() if isinstance(c, Mapping) else c)]
