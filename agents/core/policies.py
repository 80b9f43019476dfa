"""Policies as pure functions: retry or give up, deadlines, budgets. No database, no Celery, no clock of their own."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from enum import StrEnum


class ErrorClass(StrEnum):
    TRANSIENT = "transient"  # 5xx, timeouts, dropped connections: try again soon
    RATE_LIMITED = "rate_limited"  # 429: try again after the receiver's retry-after
    INVALID = "invalid"  # 4xx, bad input, unknown operation: retrying cannot help
    BUDGET = "budget"  # the agent has no budget left
    UNKNOWN = "unknown"  # an exception nobody classified


@dataclass(frozen=True, slots=True)
class RetryRule:
    """At most ``max_attempts`` failures of one class; then the job is dead. Backoff doubles from ``base``."""

    max_attempts: int
    base_seconds: float = 1.0
    max_seconds: float = 300.0
    jitter: float = 0.25  # up to +25% random delay, so retries of many jobs do not fire together


#: Retrying cannot help these, whatever the configuration says.
NEVER_RETRIED = frozenset({ErrorClass.INVALID, ErrorClass.BUDGET})

DEFAULT_RULES: dict[ErrorClass, RetryRule] = {
    ErrorClass.TRANSIENT: RetryRule(max_attempts=5, base_seconds=1.0, max_seconds=120.0),
    ErrorClass.RATE_LIMITED: RetryRule(max_attempts=8, base_seconds=5.0, max_seconds=600.0),
    ErrorClass.INVALID: RetryRule(max_attempts=1),
    ErrorClass.BUDGET: RetryRule(max_attempts=1),
    ErrorClass.UNKNOWN: RetryRule(max_attempts=3, base_seconds=2.0, max_seconds=120.0),
}


@dataclass(frozen=True, slots=True)
class Retry:
    delay: timedelta


@dataclass(frozen=True, slots=True)
class GiveUp:
    reason: str  # journaled as the policy decision


def decide_retry(
    error_class: ErrorClass,
    failures: int,
    *,
    retry_after: float | None = None,
    rules: dict[ErrorClass, RetryRule] = DEFAULT_RULES,
    rng: random.Random | None = None,
) -> Retry | GiveUp:
    """After the ``failures``-th failure of ``error_class`` (counting this one): retry after a delay, or give up.

    A rate limit's ``retry_after`` is a floor for the delay, never shortened by the backoff.
    """
    rule = rules[error_class]
    if failures >= rule.max_attempts:
        if error_class is ErrorClass.BUDGET:
            return GiveUp("budget_exhausted")
        if rule.max_attempts == 1:
            return GiveUp(f"{error_class.value}_not_retried")
        return GiveUp(f"{error_class.value}_cap_reached")
    backoff = min(rule.max_seconds, rule.base_seconds * 2 ** (failures - 1))
    backoff *= 1 + (rng or random).uniform(0, rule.jitter)
    if retry_after is not None:
        backoff = max(backoff, retry_after)
    return Retry(timedelta(seconds=backoff))


def over_budget(
    *, spent_tokens: int, spent_cost: Decimal, budget_tokens: int | None, budget_cost: Decimal | None
) -> bool:
    """True when no further spend is allowed: a budget exists and the spend has reached it."""
    return (budget_tokens is not None and spent_tokens >= budget_tokens) or (
        budget_cost is not None and spent_cost >= budget_cost
    )


def past(deadline: datetime | None, now: datetime) -> bool:
    return deadline is not None and deadline <= now


def rules_with(overrides: dict[str, dict[str, float]]) -> dict[ErrorClass, RetryRule]:
    """The default rules with per-class overrides, e.g. ``{"transient": {"max_attempts": 3}}`` (KEEL_RETRY_POLICY)."""
    rules = dict(DEFAULT_RULES)
    for name, fields in overrides.items():
        try:
            error_class = ErrorClass(name)
        except ValueError:
            known = ", ".join(c.value for c in ErrorClass)
            raise ValueError(f"retry policy names unknown error class {name!r} (known: {known})") from None
        unknown = set(fields) - {"max_attempts", "base_seconds", "max_seconds", "jitter"}
        if unknown:
            raise ValueError(f"retry policy for {name!r} has unknown fields {sorted(unknown)}")
        base = rules[error_class]
        rules[error_class] = RetryRule(
            max_attempts=int(fields.get("max_attempts", base.max_attempts)),
            base_seconds=float(fields.get("base_seconds", base.base_seconds)),
            max_seconds=float(fields.get("max_seconds", base.max_seconds)),
            jitter=float(fields.get("jitter", base.jitter)),
        )
        if rules[error_class].max_attempts < 1:
            raise ValueError(f"retry policy for {name!r}: max_attempts must be at least 1")
        if error_class in NEVER_RETRIED and rules[error_class].max_attempts != 1:
            raise ValueError(f"{name!r} failures are never retried: max_attempts must stay 1")
    return rules
