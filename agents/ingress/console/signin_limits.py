"""How fast API tokens may be guessed, at the console's sign-in form and in the API's ``Authorization`` header
alike: failed attempts (an unknown or revoked token) counted per client address and over every address together,
with the ingress's rate limiter (GCRA in Redis, :mod:`agents.ingress.ratelimit`). :meth:`SignInLimits.try_token` is
the one place that decides which bucket is charged when; both doors go through it.

Only failures are charged, never a token that turns out to be real. An address over its own allowance is refused
(429) before its token is looked up, a correct token too (otherwise a guesser would simply keep guessing: only its
failures would be refused). The ceiling over every address never refuses a token by itself, so a spray from many
addresses cannot lock out a person at an address of their own: while it is exceeded, a failure costs its address the
rest of its allowance, so each spraying address gets one guess per refill instead of a burst. The address's bucket is
peeked before the lookup and charged after a failure: concurrent failures from one address may overshoot its burst by
as many as are in flight, the price of a single Redis call for every good token.

The client address is the connection's, or — when ``keel serve`` believes the proxy it came through
(``KEEL_API_FORWARDED_ALLOW_IPS``) — the one that proxy names in ``X-Forwarded-For`` (uvicorn sets it as the ASGI
``client`` before the app sees the request). An IPv6 address counts by its /64 network: one host usually holds a
whole /64, so counting single addresses would give it billions of buckets.

Like the API's limits this fails open: without an answer from Redis an attempt is not limited (tokens are 256-bit
random secrets: the limit slows guessing and spares the database, it does not make a guess feasible or not)."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import dataclass, replace

from agents.ingress.ratelimit import Policy, RateLimiter
from agents.ingress.ratelimit import headers as rate_headers
from agents.ingress.tokens import ApiToken
from models.settings import Settings

#: Under the rate limiter's namespace: one key per client address, one over every address (both doors share them).
ADDRESS_KEY = "signin:address:"
GLOBAL_KEY = "signin:all"
#: What the ``RateLimit`` headers call the two limits.
ADDRESS_POLICY = "signin-address"
GLOBAL_POLICY = "signin-all"


def client_key(host: str | None) -> str:
    """The bucket a sign-in from ``host`` (the ASGI client address) counts in: the address itself (an IPv4-mapped
    IPv6 address as IPv4), an IPv6 address's /64 network, or ``other`` for what is not an IP address (a Unix socket's
    peer) — those share one bucket."""
    try:
        address = ipaddress.ip_address((host or "").strip())
    except ValueError:
        return "other"
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


@dataclass(frozen=True)
class Attempt:
    """One try of a token: the token, if it was looked up and found (a live one); ``retry_after`` (whole seconds, at
    least 1) when the address was over its allowance and nothing was looked up; ``headers``: the address's
    ``RateLimit`` headers."""

    address: str
    token: ApiToken | None
    headers: dict[str, str]
    retry_after: int | None = None

    @property
    def refused(self) -> bool:
        return self.retry_after is not None


@dataclass(frozen=True)
class SignInLimits:
    """The two limits on guessing tokens of one API process, on its rate limiter."""

    limiter: RateLimiter
    per_address: Policy
    overall: Policy

    @classmethod
    def from_settings(cls, settings: Settings, limiter: RateLimiter) -> SignInLimits:
        return cls(
            limiter,
            Policy(settings.console_signin_per_minute / 60, settings.console_signin_burst, ADDRESS_POLICY),
            Policy(settings.console_signin_global_per_minute / 60, settings.console_signin_global_burst, GLOBAL_POLICY),
        )

    def try_token(self, host: str | None, lookup: Callable[[], ApiToken | None]) -> Attempt:
        """Try a token from ``host`` (the ASGI client address): refused if the address is over its allowance, else
        ``lookup()`` it; a failure is charged to the address and to every address together (see the module)."""
        address = client_key(host)
        key = ADDRESS_KEY + address
        own = self.limiter.check(key, self.per_address, count=False)
        if not own.allowed:
            found = rate_headers(own, self.per_address)
            return Attempt(address, None, found, retry_after=int(found["Retry-After"]))
        token = lookup()
        if token is not None:
            return Attempt(address, token, {})  # a success is charged nowhere
        failed = self.limiter.check(key, self.per_address)
        if not self.limiter.check(GLOBAL_KEY, self.overall).allowed:
            self.limiter.drain(key, self.per_address)
            failed = replace(failed, remaining=0)
        return Attempt(address, None, rate_headers(failed, self.per_address))
