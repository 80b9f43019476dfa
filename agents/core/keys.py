"""Deterministic keys: ``{request_id}:{operation}:{target}`` names a unit of work everywhere it appears."""

from __future__ import annotations

import re

from agents.core.errors import InvalidInput, quoted

# Request ids and operations are single key segments; a target may itself contain ':' (e.g. ``tool:search:c1``).
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,127}$")
_TARGET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-:/#@]{0,255}$")


def check_request_id(request_id: str) -> str:
    """Return ``request_id`` if it can be a key segment, else raise :class:`InvalidInput` naming the rule."""
    if not isinstance(request_id, str) or not _SEGMENT.fullmatch(request_id):
        raise InvalidInput(
            f"request_id {quoted(request_id)} is invalid: use 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return request_id


def make_key(request_id: str, operation: str, target: str) -> str:
    """The one way to build a key. The same inputs give the same key in every process, forever."""
    check_request_id(request_id)
    if not _SEGMENT.fullmatch(operation):
        raise InvalidInput(f"operation {quoted(operation)} is invalid: one segment of letters, digits, '.', '_', '-'")
    if not _TARGET.fullmatch(target):
        raise InvalidInput(f"target {quoted(target)} is invalid: 1-256 characters of letters, digits and ._-:/#@")
    return f"{request_id}:{operation}:{target}"


def split_key(key: str) -> tuple[str, str, str]:
    """Inverse of :func:`make_key`."""
    request_id, operation, target = key.split(":", 2)
    return request_id, operation, target
