"""How fast the console's sign-in may be tried: failed sign-ins counted per client address and over every address
together, with the ingress's rate limiter (GCRA in Redis, :mod:`agents.ingress.ratelimit`).

Every attempt is counted before its token is looked up, against the address's bucket and then the global one; an
attempt either bucket refuses is answered 429 without a lookup, so a correct token is refused too until the
allowance comes back (otherwise a guesser would simply keep guessing: only its failures would be refused). An attempt
whose token turns out to exist is given back to both buckets: only failures count. Counting first and giving back
after, rather than looking first and counting failures after, keeps the limit exact under concurrent attempts.

The client address is the connection's, or — when ``keel serve`` believes the proxy it came through
(``KEEL_API_FORWARDED_ALLOW_IPS``) — the one that proxy names in ``X-Forwarded-For`` (uvicorn sets it as the ASGI
``client`` before the app sees the request). An IPv6 address counts by its /64 network: one host usually holds a
whole /64, so counting single addresses would give it billions of buckets.

Like the API's limits this fails open: without an answer from Redis a sign-in is not limited (tokens are 256-bit
random secrets: the limit slows guessing and spares the database, it does not make a guess feasible or not)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from agents.ingress.ratelimit import Decision, Policy, RateLimiter
from agents.ingress.ratelimit import headers as rate_headers
from models.settings import Settings

#: Under the rate limiter's namespace: one key per client address, one over every address.
ADDRESS_KEY = "console-signin:address:"
GLOBAL_KEY = "console-signin:all"
#: What the ``RateLimit`` headers call the two limits.
ADDRESS_POLICY = "console-signin-address"
GLOBAL_POLICY = "console-signin-all"


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
    """One counted sign-in attempt: allowed (its token may be looked up) or refused (``retry_after`` seconds, whole,
    at least 1; ``everyone``: the global ceiling refused it, not the address's own limit)."""

    address: str
    allowed: bool
    headers: dict[str, str]
    retry_after: int | None = None
    everyone: bool = False
    counted: tuple[tuple[str, Policy, Decision], ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class SignInLimits:
    """The two sign-in limits of one API process, on its rate limiter."""

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

    def attempt(self, host: str | None) -> Attempt:
        """Count one sign-in attempt from ``host``: first against its address, then against every address (an
        attempt the global ceiling refuses is given back to the address: a refused attempt costs nothing)."""
        address = client_key(host)
        own = self.limiter.check(ADDRESS_KEY + address, self.per_address)
        if not own.allowed:
            return self._refused(address, own, self.per_address, everyone=False)
        overall = self.limiter.check(GLOBAL_KEY, self.overall)
        if not overall.allowed:
            self.limiter.refund(ADDRESS_KEY + address, self.per_address, own)
            return self._refused(address, overall, self.overall, everyone=True)
        return Attempt(
            address,
            True,
            rate_headers(own, self.per_address),
            counted=((ADDRESS_KEY + address, self.per_address, own), (GLOBAL_KEY, self.overall, overall)),
        )

    def forgive(self, attempt: Attempt) -> None:
        """Give ``attempt`` back to both buckets: its token was a real one, so it was no failed guess."""
        for key, policy, decision in attempt.counted:
            self.limiter.refund(key, policy, decision)

    @staticmethod
    def _refused(address: str, decision: Decision, policy: Policy, *, everyone: bool) -> Attempt:
        found = rate_headers(decision, policy)
        return Attempt(address, False, found, retry_after=int(found["Retry-After"]), everyone=everyone)
