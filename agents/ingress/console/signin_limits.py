"""How fast API tokens may be guessed, at the console's sign-in form and in the API's ``Authorization`` header alike:
failed attempts counted per client address and over every address together, with the ingress's rate limiter.
:meth:`SignInLimits.try_token` is the one place that decides which bucket is charged when. Why only failures are
charged, and why a spray cannot lock a person out:
docs/explanation/ingress-and-audit.md#guessing-tokens-the-sign-in-limits."""

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
