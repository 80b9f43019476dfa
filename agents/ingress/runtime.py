"""What one API process holds while it serves: settings, the database, the client, the rate limiters, the listener."""

from __future__ import annotations

from dataclasses import dataclass, field

import redis
from fastapi import Request

from agents.client import Client, Publisher
from agents.ingress.console.signin_limits import Attempt, SignInLimits, client_key
from agents.ingress.events import JournalListener
from agents.ingress.ratelimit import Policy, RateLimiter, policy_for, scope_policies
from agents.ingress.readiness import SharedCheck
from agents.ingress.streams import Streams
from agents.ingress.tokens import ApiToken, authenticate
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
    streams: Streams
    redis: redis.Redis | None = None
    policies: dict[str, Policy] = field(default_factory=dict)
    #: The console's sign-in limits (None: KEEL_CONSOLE_SIGNIN_LIMIT_ENABLED=false, or no Redis to count in).
    signin_limits: SignInLimits | None = None
    #: The last answer of /readyz's checks, shared by the probes of the next second or two.
    readiness: SharedCheck[dict[str, str]] = field(default_factory=SharedCheck)

    @classmethod
    def open(cls, settings: Settings, *, publisher: Publisher | None = None) -> Ingress:
        db = Database.from_settings(settings)
        client = Client(db, settings, publisher=publisher)
        broker_url = broker_url_for(settings)
        limiter = None
        connection = None
        signin_limits = None
        if broker_url.startswith(("redis://", "rediss://", "unix://")):
            # Short timeouts and no retries: a readiness check or a rate check must not stall on a lost Redis.
            limiter = RateLimiter.connect(broker_url, settings.broker_prefix)
            connection = limiter.client
            if settings.console_signin_limit_enabled:
                signin_limits = SignInLimits.from_settings(settings, limiter)
            if not settings.api_rate_limit_enabled:
                limiter = None
        return cls(
            settings=settings,
            db=db,
            client=client,
            broker_url=broker_url,
            limiter=limiter,
            listener=JournalListener(db, names=client.agent_names),
            streams=Streams(
                db,
                per_token=settings.api_max_streams_per_token,
                per_process=settings.api_max_streams_per_process,
            ),
            redis=connection,
            policies=scope_policies(settings.api_rate_limits),
            signin_limits=signin_limits,
        )

    def policy_for(self, token: ApiToken) -> Policy:
        return policy_for(token.scopes, self.policies)

    def try_token(self, host: str | None, secret: str) -> Attempt:
        """Authenticate ``secret`` sent from ``host``, the API's bearer token and the console's sign-in alike, under
        the limits on guessing (:meth:`SignInLimits.try_token`; none when they are off)."""
        if self.signin_limits is None:
            return Attempt(client_key(host), authenticate(self.db, secret), {})
        return self.signin_limits.try_token(host, lambda: authenticate(self.db, secret))

    def public_url(self) -> str:
        return self.settings.api_public_url or f"http://{self.settings.api_host}:{self.settings.api_port}"

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()
        self.db.dispose()


async def ingress(request: Request) -> Ingress:
    """A dependency: this process's :class:`Ingress` (async: a sync dependency would cost a hop to the thread pool
    on every request)."""
    found = request.app.state.ingress
    assert isinstance(found, Ingress)
    return found
