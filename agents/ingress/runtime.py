"""What one API process holds while it serves: settings, the database, the client, the rate limiter, the listener."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis
from fastapi import Request

from agents.client import Client, Publisher
from agents.ingress.events import JournalListener
from agents.ingress.ratelimit import Policy, RateLimiter, policy_for
from agents.ingress.tokens import ApiToken
from models.db import Database
from models.embedded import broker_url_for
from models.settings import Settings


@dataclass
class Ingress:
    settings: Settings
    db: Database
    client: Client
    broker_url: str
    limiter: RateLimiter | None
    listener: JournalListener
    redis: redis.Redis | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def open(cls, settings: Settings, *, publisher: Publisher | None = None) -> Ingress:
        db = Database.from_settings(settings)
        client = Client(db, settings, publisher=publisher)
        broker_url = broker_url_for(settings)
        limiter = None
        connection = None
        if settings.api_rate_limit_enabled and broker_url.startswith(("redis://", "rediss://", "unix://")):
            connection = redis.Redis.from_url(broker_url, socket_timeout=2, socket_connect_timeout=2)
            limiter = RateLimiter(connection, settings.broker_prefix)
        return cls(
            settings=settings,
            db=db,
            client=client,
            broker_url=broker_url,
            limiter=limiter,
            listener=JournalListener(db.libpq_url),
            redis=connection,
        )

    def policy_for(self, token: ApiToken) -> Policy:
        return policy_for(self.settings, token.scopes)

    def public_url(self) -> str:
        return self.settings.api_public_url or f"http://{self.settings.api_host}:{self.settings.api_port}"

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()
        self.db.dispose()


def ingress(request: Request) -> Ingress:
    """A dependency: this process's :class:`Ingress`."""
    found = request.app.state.ingress
    assert isinstance(found, Ingress)
    return found
