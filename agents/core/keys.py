"""Deterministic keys: ``{request}:{operation}:{target}`` names a unit of work everywhere it appears. ``{request}``
is :func:`request_key`, the agent and the request id together, since a request id is its agent's own while a key is
unique across Keel (it is the Celery task id); every key a step derives goes through :func:`derive` or
:func:`step_message_key`, which take the request from the step's own key."""

from __future__ import annotations

import hashlib
import re
from uuid import UUID

from agents.core.errors import InvalidInput, quoted

# Request ids and operations are single key segments; a target may itself contain ':' (e.g. ``tool:search:c1``).
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,127}$")
_TARGET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-:/#@]{0,255}$")
# A request's key: ``{agent id as 32 hex digits}~{request id}`` (no request id has a ``~``: these never equal a bare
# one); a bare request id in keys written before migration 0028 and in Keel's own system requests (alerts, reports).
_REQUEST_KEY = re.compile(r"^(?:[0-9a-f]{32}~)?[A-Za-z0-9][A-Za-z0-9._\-]{0,127}$")


def check_request_id(request_id: str) -> str:
    """Return ``request_id`` if it can be a key segment, else raise :class:`InvalidInput` naming the rule."""
    if not isinstance(request_id, str) or not _SEGMENT.fullmatch(request_id):
        raise InvalidInput(
            f"request_id {quoted(request_id)} is invalid: use 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return request_id


def request_key(agent_id: UUID, request_id: str) -> str:
    """The first segment of every key of request ``request_id`` of agent ``agent_id``: unique across agents, so one
    tenant's request ids can neither occupy nor collide with another's, and the same in every process, forever."""
    return f"{agent_id.hex}~{check_request_id(request_id)}"


def current_request_key(agent_id: UUID, request_id: str | None, stored: str | None) -> str:
    """The key of an agent's request in flight: as stored on its row (a request submitted before migration 0028 keeps
    the bare id it was keyed by), else derived."""
    if stored is not None:
        return stored
    if request_id is None:
        raise InvalidInput("jobs and messages need a request in flight: their keys start with its key")
    return request_key(agent_id, request_id)


def make_key(request: str, operation: str, target: str) -> str:
    """The one way to build a key from a request's key (:func:`request_key`). The same inputs give the same key in
    every process, forever."""
    if not isinstance(request, str) or not _REQUEST_KEY.fullmatch(request):
        raise InvalidInput(f"request key {quoted(request)} is invalid: expected [<agent hex>~]<request id>")
    if not _SEGMENT.fullmatch(operation):
        raise InvalidInput(f"operation {quoted(operation)} is invalid: one segment of letters, digits, '.', '_', '-'")
    if not _TARGET.fullmatch(target):
        raise InvalidInput(f"target {quoted(target)} is invalid: 1-256 characters of letters, digits and ._-:/#@")
    return f"{request}:{operation}:{target}"


def split_key(key: str) -> tuple[str, str, str]:
    """Inverse of :func:`make_key`: the request's key, the operation, the target."""
    request, operation, target = key.split(":", 2)
    return request, operation, target


def request_id_of(key: str) -> str:
    """The request id a key names (for log lines and spans: the rows store it), without its agent part."""
    request = split_key(key)[0]
    _, tilde, request_id = request.partition("~")
    return request_id if tilde else request


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
