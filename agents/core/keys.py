"""Deterministic keys: ``{request_id}:{operation}:{target}`` names a unit of work everywhere it appears.

:func:`make_key` builds a key from its parts; every key a step derives (the jobs it schedules, the messages it emits
or that are about it, the steps it reads) goes through :func:`derive` or :func:`step_message_key`, which take the
request from the step's own key.
"""

from __future__ import annotations

import hashlib
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


def derive(step_key: str, operation: str, target: str) -> str:
    """The key of ``operation`` on ``target`` that the step ``step_key`` derives (the next plan step, a round's tool
    steps, a step of the same request it reads): of the step's own request, taken from its key, never from elsewhere."""
    return make_key(split_key(step_key)[0], operation, target)


#: The longest message target; longer step-derived ones keep their head and end in ``#`` and a digest of the whole.
_MAX_TARGET = 256
_DIGEST_CHARS = 16


def step_message_key(step_key: str, channel: str, name: str) -> str:
    """The key of the message ``name`` that step ``step_key`` emits on ``channel`` (or that is about that step, as
    an approval notice is about its gate): ``{request}:{channel}:{operation}.{target}@{name}``, e.g.
    ``r1:slack:tool.slack_post:2.call_1@post``. Two steps never share a message key, whatever names their tools
    give their messages, and a model that reuses a call id in a later round gets a new step, so a new key."""
    _, operation, target = split_key(step_key)
    if not _TARGET.fullmatch(name):
        raise InvalidInput(f"message name {quoted(name)} is invalid: 1-256 characters of letters, digits and ._-:/#@")
    scoped = f"{operation}.{target}@{name}"  # not '/': a key is one segment of an HTTP path (/v1/outbox/{key})
    if len(scoped) > _MAX_TARGET:
        digest = hashlib.sha256(scoped.encode()).hexdigest()[:_DIGEST_CHARS]
        scoped = f"{scoped[: _MAX_TARGET - _DIGEST_CHARS - 1]}#{digest}"
    return derive(step_key, channel, scoped)
