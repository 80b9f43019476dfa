"""A test's own part of a Redis database: every key and channel it (and the Keel processes it starts) uses begins
with a prefix of its own, and cleaning up deletes exactly those keys — never a whole database."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis

from models.settings import Settings


@dataclass(frozen=True)
class Broker:
    """A Redis URL and the key prefix (``KEEL_BROKER_PREFIX``) a test owns on it."""

    url: str
    prefix: str

    @property
    def env(self) -> dict[str, str]:
        """What a Keel process started by the test needs to use this broker, and only its part of it."""
        return {"KEEL_BROKER_URL": self.url, "KEEL_BROKER_PREFIX": self.prefix}

    def settings(self, **overrides: Any) -> Settings:
        return Settings(broker_url=self.url, broker_prefix=self.prefix, **overrides)

    def key(self, name: str) -> str:
        """The Redis key Keel's Celery uses for ``name`` (a queue, say) under this prefix."""
        return self.prefix + name

    def redis(self) -> redis.Redis:
        """A plain client on the broker's database; name keys with :meth:`key`."""
        return redis.Redis.from_url(self.url)

    def keys(self) -> list[str]:
        """Every key under this test's prefix."""
        with self.redis() as client:
            return sorted(k.decode() for k in client.scan_iter(match=self.prefix + "*", count=1000))

    def wipe(self) -> int:
        """Delete every key under this test's prefix (what a broker that lost its data looks like to Keel)."""
        deleted = 0
        with self.redis() as client:
            batch: list[bytes] = []
            for key in client.scan_iter(match=self.prefix + "*", count=1000):
                batch.append(key)
                if len(batch) == 500:
                    deleted += client.delete(*batch)
                    batch = []
            if batch:
                deleted += client.delete(*batch)
        return deleted


def new_prefix() -> str:
    return f"keel-test-{uuid.uuid4().hex[:12]}:"


@contextmanager
def own_prefix(url: str) -> Iterator[Broker]:
    """A fresh prefix on the Redis database at ``url``; afterwards every key under it is deleted, nothing else."""
    broker = Broker(url, new_prefix())
    try:
        yield broker
    finally:
        broker.wipe()
