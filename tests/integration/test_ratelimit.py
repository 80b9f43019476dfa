"""Per-token rate limits against a real Redis: a burst, then refusals saying when to come back; one limit shared by
every API process (their clocks too may disagree); atomic under concurrency; keys under the deployment's prefix
that expire; and when Redis is away, requests go through and the log says so once."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import libfaketime
import pytest
import redis

from agents.ingress.ratelimit import KEY_NAMESPACE, Decision, Policy, RateLimiter, headers
from tests.support.broker import Broker

pytestmark = pytest.mark.integration

#: One request's allowance takes 100 s to come back: nothing refills while a test runs.
SLOW = 0.01

Connect = Callable[[str, str], RateLimiter]


@pytest.fixture
def connect() -> Iterator[Connect]:
    """``RateLimiter.connect`` (one API process's limiter, with its own connections), closed after the test."""
    made: list[RateLimiter] = []

    def make(url: str, prefix: str) -> RateLimiter:
        made.append(RateLimiter.connect(url, prefix))
        return made[-1]

    yield make
    for limiter in made:
        limiter.close()


def test_a_burst_is_allowed_then_refused_until_one_request_has_come_back(broker: Broker, connect: Connect) -> None:
    limiter = connect(broker.url, broker.prefix)
    policy = Policy(rate_per_second=SLOW, burst=5, name="producer")

    allowed = [limiter.check("token-1", policy) for _ in range(5)]
    assert [d.allowed for d in allowed] == [True] * 5
    assert [d.remaining for d in allowed] == [4, 3, 2, 1, 0]

    refused = limiter.check("token-1", policy)
    assert not refused.allowed and refused.remaining == 0
    assert refused.retry_after_seconds is not None and 90 < refused.retry_after_seconds <= 100, "about 1/rate"
    sent = headers(refused, policy)
    assert sent["Retry-After"] == str(math.ceil(refused.retry_after_seconds))
    assert sent["RateLimit"] == f'"producer";r=0;t={sent["Retry-After"]}'

    again = limiter.check("token-1", policy)
    assert not again.allowed
    assert again.retry_after_seconds is not None and again.retry_after_seconds <= refused.retry_after_seconds, (
        "a refused request costs nothing: hammering does not push the next allowed one further out"
    )
    assert limiter.check("token-2", policy).allowed, "another token has a bucket of its own"


def test_after_waiting_retry_after_the_next_request_is_allowed(broker: Broker, connect: Connect) -> None:
    limiter = connect(broker.url, broker.prefix)
    policy = Policy(rate_per_second=5, burst=2, name="approver")
    assert limiter.check("token", policy).allowed and limiter.check("token", policy).allowed
    refused = limiter.check("token", policy)
    assert not refused.allowed and refused.retry_after_seconds is not None
    assert 0 < refused.retry_after_seconds <= 0.2
    time.sleep(refused.retry_after_seconds)  # what a client told Retry-After does
    assert limiter.check("token", policy).allowed


def test_a_peek_counts_nothing_and_a_drain_empties_the_bucket(broker: Broker, connect: Connect) -> None:
    limiter = connect(broker.url, broker.prefix)
    policy = Policy(rate_per_second=SLOW, burst=3, name="signin-address")
    assert [limiter.check("address", policy, count=False).remaining for _ in range(5)] == [2] * 5
    assert limiter.check("address", policy).remaining == 2
    assert limiter.check("address", policy, count=False).remaining == 1
    limiter.drain("address", policy)
    refused = limiter.check("address", policy, count=False)
    assert not refused.allowed and refused.retry_after_seconds is not None and 90 < refused.retry_after_seconds <= 100
    assert not limiter.check("address", policy).allowed
    limiter.drain("address", policy)  # an empty bucket stays as it is
    assert 90 < (limiter.check("address", policy).retry_after_seconds or 0) <= 100


def test_two_api_processes_share_one_limit(broker: Broker, connect: Connect) -> None:
    # Two limiters on two connections, as two API processes have.
    first = connect(broker.url, broker.prefix)
    second = connect(broker.url, broker.prefix)
    policy = Policy(rate_per_second=SLOW, burst=4, name="producer")
    assert first.check("token", policy).allowed and first.check("token", policy).allowed
    assert second.check("token", policy).allowed and second.check("token", policy).allowed
    assert not first.check("token", policy).allowed
    assert not second.check("token", policy).allowed


def _check_elsewhere(broker: Broker, offset: str, times: int) -> list[dict[str, Any]]:
    """``times`` checks from another process whose wall clock is ``offset`` off (libfaketime)."""
    code = (
        "import json, sys\n"
        "from dataclasses import asdict\n"
        "from agents.ingress.ratelimit import Policy, RateLimiter\n"
        f"limiter = RateLimiter.connect({broker.url!r}, {broker.prefix!r})\n"
        f"policy = Policy({SLOW}, 4, 'producer')\n"
        f"print(json.dumps([asdict(limiter.check('token', policy)) for _ in range({times})]))\n"
    )
    library = Path(libfaketime.__file__).parent / "vendor" / "libfaketime" / "src" / "libfaketime.so.1"
    env = {**os.environ, "LD_PRELOAD": str(library), "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    skewed = subprocess.run(
        [sys.executable, "-c", "import time; print(time.time())"], env=env, capture_output=True, text=True
    )
    assert abs(float(skewed.stdout) - time.time()) > 500, "the other process's clock really is off"
    decisions: list[dict[str, Any]] = json.loads(done.stdout)
    return decisions


def test_api_hosts_whose_clocks_disagree_by_minutes_share_one_limit(broker: Broker, connect: Connect) -> None:
    ahead = _check_elsewhere(broker, "+10m", 2)
    behind = _check_elsewhere(broker, "-10m", 1)
    assert [d["allowed"] for d in ahead + behind] == [True, True, True]
    assert [d["remaining"] for d in ahead + behind] == [3, 2, 1]
    here = connect(broker.url, broker.prefix)
    policy = Policy(rate_per_second=SLOW, burst=4, name="producer")
    last = here.check("token", policy)
    assert last.allowed and last.remaining == 0
    refused = here.check("token", policy)
    assert not refused.allowed and refused.retry_after_seconds is not None
    assert refused.retry_after_seconds <= 100, "Redis's clock decides: not ten minutes, one request's interval"


def test_concurrent_requests_never_get_more_than_the_burst(broker: Broker, connect: Connect) -> None:
    policy = Policy(rate_per_second=SLOW, burst=25, name="producer")
    limiters = [connect(broker.url, broker.prefix) for _ in range(8)]
    start = threading.Barrier(len(limiters))
    results: list[Decision] = []
    lock = threading.Lock()

    def hammer(limiter: RateLimiter) -> None:
        start.wait()
        mine = [limiter.check("token", policy) for _ in range(10)]
        with lock:
            results.extend(mine)

    threads = [threading.Thread(target=hammer, args=(limiter,)) for limiter in limiters]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 80 and all(d.enforced for d in results)
    assert sum(d.allowed for d in results) == 25
    assert sorted(d.remaining for d in results if d.allowed) == list(range(25)), "each allowance handed out once"


def test_keys_live_under_the_deployment_prefix_and_expire(
    own_redis: dict[str, Any], connect: Connect, request: pytest.FixtureRequest
) -> None:
    prefix = "keel-staging:"
    limiter = connect(own_redis["url"], prefix)
    limiter.check("token-1", Policy(rate_per_second=SLOW, burst=5, name="producer"))
    server = redis.Redis.from_url(own_redis["url"])
    request.addfinalizer(server.close)
    assert server.keys("*") == [f"{prefix}{KEY_NAMESPACE}token-1".encode()], "nothing outside the prefix"
    ttl = server.pttl(f"{prefix}{KEY_NAMESPACE}token-1")
    assert 90_000 < ttl <= 100_000, "it expires when the bucket is full again (one request: 1/rate)"

    limiter.check("token-2", Policy(rate_per_second=100, burst=3, name="producer"))
    deadline = time.monotonic() + 10
    while server.exists(f"{prefix}{KEY_NAMESPACE}token-2"):
        assert time.monotonic() < deadline, "an idle token's key did not expire"
        time.sleep(0.01)
    assert limiter.check("token-2", Policy(rate_per_second=100, burst=3, name="producer")).remaining == 2


def test_without_redis_requests_go_through_and_the_log_says_so_once(
    own_redis: dict[str, Any], connect: Connect, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="keel.ratelimit")
    limiter = connect(own_redis["url"], "keel:")
    policy = Policy(rate_per_second=SLOW, burst=1, name="producer")
    assert limiter.check("token", policy).allowed
    assert not limiter.check("token", policy).allowed

    own_redis["stop"]()
    during = [limiter.check("token", policy) for _ in range(50)]
    assert all(d.allowed and not d.enforced for d in during), "fail open: the limiter protects capacity only"
    assert "RateLimit" not in headers(during[0], policy), "no remaining count is invented"
    down = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(down) == 1 and "rate limiting: Redis down" in down[0].getMessage()

    own_redis["start"]()  # empty: no data, no scripts (EVALSHA finds none and loads it again)
    deadline = time.monotonic() + 15
    while not (decision := limiter.check("token", policy)).enforced:
        assert time.monotonic() < deadline, "the limiter did not go back to Redis"
        time.sleep(0.05)
    assert decision.allowed and not limiter.check("token", policy).allowed, "limits apply again"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "rate limiting: Redis back after" in warnings[1]
