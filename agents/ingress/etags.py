"""Revisions as entity tags: an agent at revision 7 has the ETag ``"r7"``."""

from __future__ import annotations

import re

from agents.ingress.problems import BAD_REQUEST, PRECONDITION_REQUIRED, Problem

_TAG = re.compile(r'^(?:W/)?"r(\d{1,19})"$')


def etag(revision: int) -> str:
    return f'"r{revision}"'


def revision_of(header: str | None, *, name: str = "If-Match", required: bool = False) -> int | None:
    """The revision an ``If-Match`` (or ``If-None-Match``) header names; None if absent or ``*`` (any revision).
    A header that is not one ``"r<revision>"`` tag is a 400 naming the form; a required one that is absent a 428."""
    if header is None or not header.strip():
        if required:
            raise Problem(
                PRECONDITION_REQUIRED,
                f'send {name}: "r<revision>" with the revision you saw (GET the agent: its ETag), so a decision made'
                " on an old view of the agent is refused instead of applied",
            )
        return None
    value = header.strip()
    if value == "*":
        return None
    found = _TAG.fullmatch(value)
    if found is None:
        raise Problem(BAD_REQUEST, f'{name} must be one entity tag "r<revision>" (the agent\'s ETag), or *')
    return int(found.group(1))
