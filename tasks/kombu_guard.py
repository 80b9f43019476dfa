"""A guard for kombu's Redis transport: a worker that loses Redis while it holds an unacknowledged message reconnects
instead of stopping with ``Unrecoverable error: AttributeError("'NoneType' object has no attribute 'hostname'")``.
:mod:`tasks.app` applies it (docs/runbook.md#jobs says what an operator sees without it)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import redis.exceptions
from kombu.transport import redis as kombu_redis

ConnParams = Callable[..., dict[str, Any]]


def guard_redis_transport() -> None:
    """Make every kombu Redis channel keep the connection parameters it last built a pool from (once per process),
    so that closing a channel after Celery detached its transport restores its messages instead of crashing the
    worker. Why and when to remove it: docs/explanation/runtime-outbox-and-workers.md#kombus-lost-connection-crash."""
    channel = kombu_redis.Channel
    connparams = getattr(channel, "_connparams", None)  # a kombu without it is another one: the tests say so
    if connparams is not None and not getattr(connparams, "keel_guard", False):
        channel._connparams = _keeping(connparams)  # type: ignore[method-assign]


def _keeping(connparams: ConnParams) -> ConnParams:
    @functools.wraps(connparams)
    def kept_connparams(channel: Any, asynchronous: bool = False) -> dict[str, Any]:
        kept: dict[bool, dict[str, Any]] = channel.__dict__.setdefault("_keel_connparams", {})
        transport = channel.connection
        if transport is not None and transport.client is not None:
            kept[asynchronous] = connparams(channel, asynchronous)
        elif asynchronous not in kept:
            raise redis.exceptions.ConnectionError("this kombu channel's broker connection is closed")
        return dict(kept[asynchronous])

    kept_connparams.keel_guard = True  # type: ignore[attr-defined]
    return kept_connparams
