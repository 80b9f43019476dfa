"""What a client reads from Keel's rate-limit headers, and which limit a token gets (no Redis here: the limiter
itself is tests/integration/test_ratelimit.py)."""

from __future__ import annotations

import pytest

from agents.ingress.ratelimit import Decision, Policy, headers, policy_for, scope_policies
from models.settings import DEFAULT_API_RATE_LIMITS, SCOPES, Settings

PRODUCER = Policy(rate_per_second=50, burst=100, name="producer")


def test_an_allowed_request_advertises_the_policy_and_what_is_left() -> None:
    decision = Decision(allowed=True, remaining=97, reset_seconds=0.06, retry_after_seconds=None)
    assert headers(decision, PRODUCER) == {
        "RateLimit-Policy": '"producer";q=100;w=2',  # 100 at once, refilled in 2 s (= 50/s)
        "RateLimit": '"producer";r=97;t=1',  # the bucket is full again within the second
    }


def test_a_refused_request_says_when_to_retry_in_whole_seconds_rounded_up() -> None:
    decision = Decision(allowed=False, remaining=0, reset_seconds=2.0, retry_after_seconds=0.02)
    found = headers(decision, PRODUCER)
    assert found["Retry-After"] == "1", "never 0: a client told 0 would retry at once"
    assert found["RateLimit"] == '"producer";r=0;t=1', "t does not point later than Retry-After"

    slow = Policy(rate_per_second=0.2, burst=3, name="auditor")
    decision = Decision(allowed=False, remaining=0, reset_seconds=15.0, retry_after_seconds=4.000001)
    assert headers(decision, slow) == {
        "RateLimit-Policy": '"auditor";q=3;w=15',
        "Retry-After": "5",
        "RateLimit": '"auditor";r=0;t=5',
    }


@pytest.mark.parametrize(
    ("rate", "burst", "window"),
    [(50, 100, 2), (5, 20, 4), (20, 50, 3), (0.3, 3, 10), (1000, 1, 1), (0.5, 1, 2)],
)
def test_the_advertised_window_never_promises_more_than_the_rate(rate: float, burst: int, window: int) -> None:
    policy = Policy(rate_per_second=rate, burst=burst, name="p")
    assert policy.window_seconds == window
    assert burst / window <= rate


def test_without_redis_only_the_policy_is_advertised() -> None:
    decision = Decision(allowed=True, remaining=100, reset_seconds=0.0, retry_after_seconds=None, enforced=False)
    assert headers(decision, PRODUCER) == {"RateLimit-Policy": '"producer";q=100;w=2'}


def test_a_token_with_several_scopes_gets_the_most_generous_limit() -> None:
    policies = scope_policies(Settings().api_rate_limits)
    assert policy_for(["approver"], policies) == Policy(5, 20, "approver")
    assert policy_for(["approver", "producer"], policies) == Policy(50, 100, "producer")
    assert policy_for(["auditor", "operator"], policies) == Policy(20, 50, "operator")
    # Same rate: the larger burst wins.
    tied = scope_policies(Settings(api_rate_limits={"auditor": {"rate": 20, "burst": 80}}).api_rate_limits)
    assert policy_for(["operator", "auditor"], tied) == Policy(20, 80, "auditor")


def test_every_scope_has_a_default_limit_and_overrides_keep_the_others() -> None:
    assert set(DEFAULT_API_RATE_LIMITS) == set(SCOPES)
    limits = Settings(api_rate_limits={"producer": {"rate": 500, "burst": 1000}}).api_rate_limits
    assert (limits["producer"].rate, limits["producer"].burst) == (500, 1000)
    assert limits["approver"] == DEFAULT_API_RATE_LIMITS["approver"]


@pytest.mark.parametrize(
    ("rate", "burst", "name", "message"),
    [
        (0, 1, "p", "rate_per_second must be above 0"),
        (float("nan"), 1, "p", "rate_per_second must be above 0"),
        (1, 0, "p", "burst must be a whole number of at least 1"),
        (1, 2.5, "p", "burst must be a whole number"),
        (1, 1, 'a"b', "name may hold only"),
        (1, 1, "", "name may hold only"),
    ],
)
def test_a_nonsense_policy_is_refused(rate: float, burst: int, name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Policy(rate_per_second=rate, burst=burst, name=name)
