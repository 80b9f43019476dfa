from __future__ import annotations

import random
from datetime import timedelta

import pytest

from agents.core.policies import DEFAULT_RULES, ErrorClass, GiveUp, Retry, decide_retry, over_budget, rules_with


def test_each_class_has_its_own_cap() -> None:
    rng = random.Random(1)
    assert decide_retry(ErrorClass.INVALID, 1, rng=rng) == GiveUp("invalid_not_retried")
    assert decide_retry(ErrorClass.BUDGET, 1, rng=rng) == GiveUp("budget_exhausted")
    cap = DEFAULT_RULES[ErrorClass.TRANSIENT].max_attempts
    assert all(isinstance(decide_retry(ErrorClass.TRANSIENT, n, rng=rng), Retry) for n in range(1, cap))
    assert decide_retry(ErrorClass.TRANSIENT, cap, rng=rng) == GiveUp("transient_cap_reached")


def test_backoff_doubles_with_bounded_jitter_and_a_ceiling() -> None:
    rng = random.Random(7)
    delays = []
    for n in range(1, 5):
        result = decide_retry(ErrorClass.TRANSIENT, n, rng=rng)
        assert isinstance(result, Retry)
        delays.append(result.delay.total_seconds())
    for n, delay in enumerate(delays, start=1):
        base = 2 ** (n - 1)
        assert base <= delay <= base * 1.25
    rule = DEFAULT_RULES[ErrorClass.UNKNOWN]
    capped = decide_retry(
        ErrorClass.UNKNOWN,
        2,
        rules={**DEFAULT_RULES, ErrorClass.UNKNOWN: rule.__class__(max_attempts=50, base_seconds=100, max_seconds=120)},
        rng=rng,
    )
    assert isinstance(capped, Retry) and capped.delay <= timedelta(seconds=150)


def test_retry_after_is_a_floor() -> None:
    result = decide_retry(ErrorClass.RATE_LIMITED, 1, retry_after=42.0, rng=random.Random(0))
    assert isinstance(result, Retry) and result.delay >= timedelta(seconds=42)


def test_overrides_and_their_errors() -> None:
    rules = rules_with({"transient": {"max_attempts": 2, "base_seconds": 0.5}})
    assert (rules[ErrorClass.TRANSIENT].max_attempts, rules[ErrorClass.TRANSIENT].base_seconds) == (2, 0.5)
    assert rules[ErrorClass.UNKNOWN] == DEFAULT_RULES[ErrorClass.UNKNOWN]
    with pytest.raises(ValueError, match="unknown error class 'flaky'"):
        rules_with({"flaky": {}})
    with pytest.raises(ValueError, match="unknown fields"):
        rules_with({"transient": {"tries": 3}})


def test_budget() -> None:
    from decimal import Decimal

    assert not over_budget(spent_tokens=99, spent_cost=Decimal(0), budget_tokens=100, budget_cost=None)
    assert over_budget(spent_tokens=100, spent_cost=Decimal(0), budget_tokens=100, budget_cost=None)
    assert over_budget(spent_tokens=0, spent_cost=Decimal("1.00"), budget_tokens=None, budget_cost=Decimal("1.00"))
    assert not over_budget(spent_tokens=10**9, spent_cost=Decimal(10**6), budget_tokens=None, budget_cost=None)


def test_invalid_and_budget_can_never_be_configured_to_retry() -> None:
    from pydantic import ValidationError

    from models.settings import Settings

    with pytest.raises(ValueError, match="never retried"):
        rules_with({"invalid": {"max_attempts": 3}})
    with pytest.raises(ValidationError, match="never retried"):
        Settings(retry_policy={"budget": {"max_attempts": 2}})
