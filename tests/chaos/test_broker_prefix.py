"""KEEL_BROKER_PREFIX through real processes: every key and channel a worker, beat and a control broadcast use on a
Redis server of the test's own starts with the prefix (seen with MONITOR, command by command)."""

from __future__ import annotations

import codecs
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

from agents.client import Client
from tasks.app import make_app
from tests.chaos.conftest import Stack, wait_until
from tests.support.broker import Broker, new_prefix
from tests.support.keys import scoped

pytestmark = pytest.mark.chaos

_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_CHANNEL_ARGS = {"PUBLISH": slice(1, 2), "SPUBLISH": slice(1, 2)}
_SUBSCRIPTIONS = {"SUBSCRIBE", "PSUBSCRIBE", "UNSUBSCRIBE", "PUNSUBSCRIBE", "SSUBSCRIBE", "SUNSUBSCRIBE"}


@contextmanager
def monitored(url: str) -> Iterator[list[list[bytes]]]:
    """Every command the server runs meanwhile (MONITOR), as argument lists."""
    commands: list[list[bytes]] = []
    stop = b"keel-test-monitor-stop"
    # No read timeout (redis-py's default is 5 s): the worker may issue no command for longer while it starts.
    client = redis.Redis.from_url(url, socket_timeout=None)
    monitor = client.monitor().__enter__()

    def read() -> None:
        while True:
            line = monitor.connection.read_response()
            text = line.decode() if isinstance(line, bytes) else str(line)
            args = [codecs.escape_decode(part.encode())[0] for part in _QUOTED.findall(text.split("] ", 1)[1])]
            if args == [b"ECHO", stop]:
                return
            commands.append(args)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield commands
    finally:
        with redis.Redis.from_url(url) as other:
            other.echo(stop)
        reader.join(10)
        monitor.__exit__(None, None, None)
        client.close()


def names_used(url: str, commands: list[list[bytes]]) -> tuple[set[bytes], set[str]]:
    """The keys and channels ``commands`` name (Redis itself says which arguments are keys), and the command names."""
    names: set[bytes] = set()
    kinds: set[str] = set()
    with redis.Redis.from_url(url) as client:
        for args in {tuple(c) for c in commands if c}:
            kind = args[0].decode().upper()
            kinds.add(kind)
            if kind in _CHANNEL_ARGS:
                names.update(args[_CHANNEL_ARGS[kind]])
            elif kind in _SUBSCRIPTIONS:
                names.update(args[1:])
            elif kind not in {"MONITOR", "EXEC", "MULTI", "DISCARD"}:
                try:
                    names.update(k if isinstance(k, bytes) else str(k).encode() for k in client.command_getkeys(*args))
                except redis.ResponseError:  # a command without keys (PING, CLIENT, SCRIPT, …)
                    pass
    return names, kinds


def test_worker_beat_and_a_revoke_use_only_keys_and_channels_under_the_prefix(
    db_url: str, own_redis: dict[str, Any], tmp_path: Path, client: Client
) -> None:
    broker = Broker(own_redis["url"], new_prefix())
    stack = Stack(db_url, broker, tmp_path)
    try:
        with monitored(broker.url) as commands:
            stack.worker("w1")
            stack.beat()
            done, revoked = client.create_agent("done"), client.create_agent("revoked")
            client.submit(done.id, "req-done", None, operation="block")
            client.submit(revoked.id, "req-revoked", None, operation="block")
            wait_until("both jobs to be claimed or waiting", lambda: len(stack.query("SELECT 1 FROM executions")) >= 1)
            celery = make_app(broker.settings(database_url=db_url))
            try:
                celery.control.revoke(scoped(revoked.id, "req-revoked:block:1"))  # a broadcast on the pidbox channel
            finally:
                celery.close()
            wait_until("the revoke to cancel its request", lambda: client.get_state(revoked.id).phase == "failed", 30)
            stack.release(scoped(done.id, "req-done:block:1"))
            stack.release(scoped(revoked.id, "req-revoked:block:1"))
            wait_until("the other request to finish", lambda: client.get_state(done.id).phase == "done", 60)
        stack.stop_all()
        names, kinds = names_used(broker.url, commands)
        assert {"BRPOP", "LPUSH", "PUBLISH", "PSUBSCRIBE", "EVALSHA", "HSET", "ZADD"} <= kinds, sorted(kinds)
        assert broker.key("/0.celery.pidbox").encode() in names, "the revoke went out on the prefixed channel"
        outside = sorted(n for n in names if not n.startswith(broker.prefix.encode()))
        assert outside == [], f"keys or channels outside {broker.prefix!r}: {outside}"
        with redis.Redis.from_url(broker.url) as plain:
            left = sorted(plain.scan_iter(count=1000))
        assert left and all(key.startswith(broker.prefix.encode()) for key in left), left
    finally:
        stack.stop_all()
