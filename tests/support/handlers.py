"""Job handlers the tests' real worker processes load (KEEL_IMPORTS=tests.support.handlers).

Each records every execution in the test database's ``executions`` table, so a test can count runs per key.
"""

from __future__ import annotations

import logging
import os
import time
from decimal import Decimal

import redis
import structlog

from agents.core.commands import JobSpec, Usage
from agents.core.errors import InvalidJob, RateLimited, TransientError
from agents.core.phases import Event
from agents.jobs.handlers import JobContext, JobResult, handler

EXECUTIONS_DDL = (
    "CREATE TABLE IF NOT EXISTS executions (id bigserial PRIMARY KEY, key text NOT NULL, attempt int NOT NULL,"
    " pid int NOT NULL, token bigint NOT NULL, phase text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())"
)


def record(ctx: JobContext, phase: str) -> None:
    with ctx.db.transaction() as cur:
        cur.execute(
            "INSERT INTO executions (key, attempt, pid, token, phase) VALUES (%s, %s, %s, %s, %s)",
            (ctx.key, ctx.attempt, os.getpid(), ctx.fencing_token, phase),
        )


@handler("count")
def count(ctx: JobContext) -> JobResult:
    record(ctx, "start")
    return JobResult(output={"pid": os.getpid()}, event=Event.FINISH)


@handler("noop")
def noop(ctx: JobContext) -> JobResult:
    return JobResult(event=Event.FINISH)


def released(key: str) -> bool:
    """Whether the test set ``release:{key}`` under its prefix on the broker's Redis (which may be restarting:
    then not yet)."""
    client = redis.Redis.from_url(os.environ["KEEL_BROKER_URL"], socket_connect_timeout=1, socket_timeout=1)
    try:
        return bool(client.exists(os.environ.get("KEEL_BROKER_PREFIX", "") + f"release:{key}"))
    except redis.RedisError:
        return False
    finally:
        client.close()


def wait_for_release(key: str) -> None:
    while not released(key):
        time.sleep(0.05)


@handler("block")
def block(ctx: JobContext) -> JobResult:
    """Runs until the test sets the Redis key ``release:{job key}`` (on the broker's Redis db)."""
    record(ctx, "start")
    wait_for_release(ctx.key)
    record(ctx, "finish")
    return JobResult(output={"released": True}, event=Event.FINISH)


@handler("gated")
def gated(ctx: JobContext) -> JobResult:
    """Step n of ``steps`` (the request input, as are the others): waits until the file ``gate`` exists (no Redis
    involved: it runs through a broker outage), then schedules step n+1, or finishes after the last."""
    record(ctx, "start")
    given = ctx.payload.get("input") or {}
    while not os.path.exists(given["gate"]):
        time.sleep(0.05)
    record(ctx, "finish")
    step = int(ctx.target)
    if step >= int(given["steps"]):
        return JobResult(event=Event.FINISH)
    return JobResult(jobs=(JobSpec("gated", str(step + 1), payload={"input": given}),))


@handler("hang")
def hang(ctx: JobContext) -> JobResult:
    """Ignores everything for 20 s, then records ``late``: past its run limit, that must never happen."""
    record(ctx, "start")
    time.sleep(20)
    record(ctx, "late")
    return JobResult(event=Event.FINISH)


@handler("slow")
def slow(ctx: JobContext) -> JobResult:
    record(ctx, "start")
    time.sleep(float(ctx.payload.get("seconds", 1)))
    record(ctx, "finish")
    return JobResult(event=Event.FINISH)


@handler("nap")
def nap(ctx: JobContext) -> JobResult:
    """Waits ``seconds`` (the request input) as a model call would, between a start and a finish record."""
    record(ctx, "start")
    time.sleep(float((ctx.payload.get("input") or {}).get("seconds", 1)))
    record(ctx, "finish")
    return JobResult(event=Event.FINISH)


@handler("flaky")
def flaky(ctx: JobContext) -> JobResult:
    """Fails transiently (spending 10 tokens each time) until attempt ``succeed_on``; never if it is 0."""
    record(ctx, "start")
    succeed_on = int((ctx.payload.get("input") or {}).get("succeed_on", 0))
    if succeed_on and ctx.attempt >= succeed_on:
        return JobResult(usage=Usage(5, Decimal("0.01")), event=Event.FINISH)
    raise TransientError(f"upstream 503 on attempt {ctx.attempt}", usage=Usage(10, Decimal("0.02")))


@handler("invalid")
def invalid(ctx: JobContext) -> JobResult:
    record(ctx, "start")
    raise InvalidJob("400 Bad Request: the prompt is empty")


@handler("ratelimited")
def ratelimited(ctx: JobContext) -> JobResult:
    """429 with Retry-After on the first attempt, then succeeds."""
    record(ctx, "start")
    if ctx.attempt == 1:
        raise RateLimited(
            "429 Too Many Requests", retry_after=float((ctx.payload.get("input") or {}).get("retry_after", 2))
        )
    return JobResult(event=Event.FINISH)


@handler("spend")
def spend(ctx: JobContext) -> JobResult:
    """Spends 100 tokens per step and schedules the next step, forever: only the budget stops it."""
    record(ctx, "start")
    step = int(ctx.target)
    return JobResult(usage=Usage(100, Decimal("0.10")), jobs=(JobSpec("spend", str(step + 1)),))


#: The settings that hold secrets, for :func:`spill`.
SECRET_SETTINGS = ("KEEL_SLACK_TOKEN", "KEEL_GITHUB_TOKEN", "KEEL_LLM_API_KEY", "KEEL_DATABASE_URL", "KEEL_AUDIT_KEYS")


@handler("spill")
def spill(ctx: JobContext) -> JobResult:
    """Writes every configured secret into the log every way careless code would — in a message, as structlog
    key-values, in a traceback — then fails with them in its error."""
    secrets = {name.lower(): os.environ.get(name, "") for name in SECRET_SETTINGS}
    log = logging.getLogger("keel.test.spill")
    log.warning("configured with %s", secrets)
    structlog.get_logger("keel.test.spill").warning("configured", **secrets)
    try:
        raise ConnectionError(f"could not connect with {secrets}")
    except ConnectionError:
        log.exception("connecting failed")
    raise RuntimeError(f"gave up; configured with {secrets}")


@handler("leaky")
def leaky(ctx: JobContext) -> JobResult:
    """Fails with an exception whose text carries credentials, as a careless client library's error would:
    the configured GitHub token (``KEEL_GITHUB_TOKEN``, whatever its shape) and a Slack-shaped token."""
    configured = os.environ.get("KEEL_GITHUB_TOKEN", "")
    raise RuntimeError(f"POST failed; sent token={configured} and Authorization: Bearer xoxb-12345-67890-leakedleaked")
