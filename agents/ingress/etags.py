"""Revisions as entity tags: an agent at revision 7 has the ETag ``"r7"``. ``If-Match`` compares strongly (RFC 9110
§13.1.1): one tag ``"r<revision>"`` — the revision the caller saw — or ``*`` where any revision will do.
``If-None-Match`` compares weakly and takes ``*`` or a list of tags."""

from __future__ import annotations

import re

from agents.ingress.problems import BAD_REQUEST, PRECONDITION_REQUIRED, Problem

_TAG = re.compile(r'^(W/)?"r(\d{1,19})"$')


def etag(revision: int) -> str:
    return f'"r{revision}"'


def if_match(header: str | None, *, required: bool = False) -> int | None:
    """The revision an ``If-Match`` header names; None if absent or ``*`` (any revision). Not one strong
    ``"r<revision>"`` tag: a 400 naming the form. ``required`` (a decision a person makes on what they saw): absent
    is a 428, and ``*`` a 400."""
    value = (header or "").strip()
    if not value:
        if required:
            raise Problem(
                PRECONDITION_REQUIRED,
                'send If-Match: "r<revision>" with the revision you saw (GET the agent: its ETag), so a decision made'
                " on an old view of the agent is refused instead of applied",
            )
        return None
    if value == "*":
        if required:
            raise Problem(BAD_REQUEST, 'this needs the revision you saw: If-Match: "r<revision>", not *')
        return None
    found = _TAG.fullmatch(value)
    if found is None or found.group(1):
        form = '"r<revision>"' if required else '"r<revision>" or *'
        why = " (If-Match compares strongly: no W/)" if found is not None else ""
        raise Problem(BAD_REQUEST, f"If-Match must be one entity tag {form}, the agent's ETag{why}")
    return int(found.group(2))


def none_match(header: str | None, revision: int) -> bool:
    """Whether ``If-None-Match`` matches the current ``revision`` (so a GET answers 304): ``*``, or a list of tags one
    of which is the current one (weak comparison). A tag that is not ours never matches; garbage is a 400."""
    value = (header or "").strip()
    if not value:
        return False
    if value == "*":
        return True
    seen = set()
    for part in value.split(","):
        found = _TAG.fullmatch(part.strip())
        if found is None:
            raise Problem(BAD_REQUEST, 'If-None-Match must be * or entity tags "r<revision>" (the agent\'s ETag)')
        seen.add(int(found.group(2)))
    return revision in seen
