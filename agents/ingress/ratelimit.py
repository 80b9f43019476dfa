"""Rate control per API token, shared by every API process: one atomic Redis script call per request, GCRA (token-bucket
semantics: ``burst`` requests at once, refilled at ``rate`` a second) on Redis's own clock. Why a script of our own
rather than a library: docs/explanation/ingress-and-audit.md#rate-limits-gcra-in-redis."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from agents.core.outage import Outage
from models.settings import ScopeRateLimit

log = logging.getLogger("keel.ratelimit")

#: Under ``KEEL_BROKER_PREFIX``; then the token's id.
KEY_NAMESPACE = "keel:ratelimit:"

#: How long one check may wait on Redis (connect, then reply) with a client made by :meth:`RateLimiter.connect`.
#: Redis answers in well under a millisecond; past this the request goes through unlimited (see :meth:`check`).
TIMEOUT_SECONDS = 0.5

# What a policy's name may hold: it goes into the headers as a Structured Field string, unescaped.
_POLICY_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")

# KEYS[1]: the token's key; ARGV: the emission interval (microseconds per request, >= 1), the burst, and 1 to count
# the request or 0 to peek. Returns {allowed (1/0), remaining, microseconds until the bucket is full, microseconds
# until the next request is allowed}; the key expires when the bucket is full (a missing key is a full bucket).
_GCRA = """
local interval = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local count = ARGV[3] == '1'
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if tat < now then
  tat = now
end
local allow_at = tat + interval - interval * burst
if now < allow_at then
  return {0, 0, tat - now, allow_at - now}
end
local new_tat = tat + interval
if count then
  redis.call('SET', KEYS[1], string.format('%.0f', new_tat), 'PX', math.ceil((new_tat - now) / 1000))
end
return {1, math.floor((now - allow_at) / interval), new_tat - now, 0}
"""

# Take what is left of a bucket (it is empty now: the next request is allowed after one interval). KEYS, ARGV[1] and
# ARGV[2] as above. Returns nothing.
_DRAIN = """
local interval = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
local empty = now + interval * burst
if tat < empty then
  redis.call('SET', KEYS[1], string.format('%.0f', empty), 'PX', math.ceil((empty - now) / 1000))
end
return 0
"""


@dataclass(frozen=True)
class Policy:
    """A token's limit: ``burst`` requests at once, refilled at ``rate_per_second``; ``name`` is what the
    ``RateLimit`` headers call it (the scope it comes from)."""

    rate_per_second: float
    burst: int
    name: str

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate_per_second) and 0 < self.rate_per_second <= 1_000_000):
            raise ValueError(f"rate_per_second must be above 0 and at most 1000000, got {self.rate_per_second}")
        if isinstance(self.burst, bool) or not isinstance(self.burst, int) or self.burst < 1:
            raise ValueError(f"burst must be a whole number of at least 1, got {self.burst!r}")
        if not _POLICY_NAME.fullmatch(self.name):
            raise ValueError(f"name may hold only letters, digits and _ . : - (1 to 64), got {self.name[:70]!r}")

    @property
    def interval_microseconds(self) -> int:
        """The time one request's allowance takes to come back."""
        return max(1, round(1_000_000 / self.rate_per_second))

    @property
    def window_seconds(self) -> int:
        """Whole seconds an empty bucket takes to fill (the ``w`` of ``RateLimit-Policy``), rounded up, so the
        advertised ``burst`` per window never exceeds the rate."""
        return max(1, math.ceil(round(self.burst / self.rate_per_second, 6)))


@dataclass(frozen=True)
class Decision:
    """The answer for one request. ``remaining``: requests the token may still make at once after this one;
    ``reset_seconds``: until its bucket is full again; ``retry_after_seconds``: until the next request would be
    allowed (``None`` when this one was). ``enforced`` is false when Redis could not be asked and the request was
    let through unlimited (:meth:`RateLimiter.check`)."""

    allowed: bool
    remaining: int
    reset_seconds: float
    retry_after_seconds: float | None
    enforced: bool = True


def scope_policies(limits: Mapping[str, ScopeRateLimit]) -> dict[str, Policy]:
    """One :class:`Policy` per scope from ``Settings.api_rate_limits``; build it once per process."""
    return {scope: Policy(limit.rate, limit.burst, scope) for scope, limit in limits.items()}


def policy_for(scopes: Iterable[str], policies: Mapping[str, Policy]) -> Policy:
    """The policy of a token with these scopes: the most generous of theirs (highest rate, then largest burst)."""
    candidates = [policies[scope] for scope in scopes]
    if not candidates:
        raise ValueError("a token without scopes has no rate limit policy")
    return max(candidates, key=lambda policy: (policy.rate_per_second, policy.burst, policy.name))


def _whole_seconds(seconds: float) -> int:
    return max(0, math.ceil(round(seconds, 6)))


def headers(decision: Decision, policy: Policy) -> dict[str, str]:
    """The response headers for ``decision``, per draft-ietf-httpapi-ratelimit-headers-10 (RateLimit-Policy and
    RateLimit as Structured Field lists; ``w`` and ``t`` in whole seconds), plus ``Retry-After`` when refused.

    ``t`` is the seconds until the bucket is full again; on a refusal it is the ``Retry-After`` value instead (when
    the next request is allowed), because the draft says Retry-After should not point earlier than ``t``. Without
    an answer from Redis (``enforced`` false) only the policy is sent: the remaining allowance is unknown."""
    found = {"RateLimit-Policy": f'"{policy.name}";q={policy.burst};w={policy.window_seconds}'}
    if not decision.enforced:
        return found
    if decision.allowed:
        until = _whole_seconds(decision.reset_seconds)
    else:
        until = max(1, _whole_seconds(decision.retry_after_seconds or 0.0))
        found["Retry-After"] = str(until)
    found["RateLimit"] = f'"{policy.name}";r={decision.remaining};t={until}'
    return found


class RateLimiter:
    """Per-key GCRA limits in Redis under ``prefix`` (``Settings.broker_prefix``). Thread-safe; one per process."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        # EVALSHA, loading the script again when Redis lost it (a restart, SCRIPT FLUSH).
        self._script = client.register_script(_GCRA)
        self._drain = client.register_script(_DRAIN)
        self._outage = Outage("rate limiting: Redis", log)

    @classmethod
    def connect(cls, url: str, prefix: str) -> RateLimiter:
        """A limiter on its own client for ``url`` that waits at most :data:`TIMEOUT_SECONDS` per check and never
        retries (redis-py's default client retries ten times with backoff: seconds per request in an outage)."""
        client = redis.Redis.from_url(
            url,
            socket_connect_timeout=TIMEOUT_SECONDS,
            socket_timeout=TIMEOUT_SECONDS,
            retry=Retry(NoBackoff(), 0),
        )
        return cls(client, prefix)

    def close(self) -> None:
        """Close the client's connections (at the process's shutdown)."""
        self.client.close()

    def key(self, key: str) -> str:
        """The Redis key holding ``key``'s state."""
        return f"{self.prefix}{KEY_NAMESPACE}{key}"

    def check(self, key: str, policy: Policy, *, count: bool = True) -> Decision:
        """Count one request of ``key`` (a token id) against ``policy`` in one atomic script call; with ``count`` false,
        only say whether it would be allowed. Without an answer from Redis the request is allowed (``enforced`` false):
        the limiter protects capacity, correctness rests on PostgreSQL
        (docs/explanation/ingress-and-audit.md#rate-limits-gcra-in-redis)."""
        if self._outage.wait() > 0:
            return self._unenforced(policy)
        try:
            allowed, remaining, reset_us, retry_us = self._script(
                keys=[self.key(key)], args=[policy.interval_microseconds, policy.burst, 1 if count else 0]
            )
        except redis.RedisError as exc:
            self._outage.failed(exc)
            return self._unenforced(policy)
        self._outage.recovered()
        return Decision(
            allowed=bool(allowed),
            remaining=int(remaining),
            reset_seconds=int(reset_us) / 1_000_000,
            retry_after_seconds=None if allowed else int(retry_us) / 1_000_000,
        )

    def drain(self, key: str, policy: Policy) -> None:
        """Take what is left of ``key``'s allowance: its next request is allowed one interval from now. Nothing when
        Redis cannot be asked."""
        if self._outage.wait() > 0:
            return
        try:
            self._drain(keys=[self.key(key)], args=[policy.interval_microseconds, policy.burst])
        except redis.RedisError as exc:
            self._outage.failed(exc)
            return
        self._outage.recovered()

    @staticmethod
    def _unenforced(policy: Policy) -> Decision:
        return Decision(
            allowed=True, remaining=policy.burst, reset_seconds=0.0, retry_after_seconds=None, enforced=False
        )
