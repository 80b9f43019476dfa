"""Bare Celery, the benchmark's baseline: a no-op task under exactly Keel's Celery configuration (acks_late,
prefetch 1, reject on worker lost, task events off unless KEEL_WORKER_TASK_EVENTS) on the same broker, so the ratio
measures what Keel's job machinery costs and nothing else. Each run records its finish time in Redis, under the
run's key prefix."""

from __future__ import annotations

import os
import time
from functools import cache

import redis
from celery import Celery
from kombu import Queue  # type: ignore[attr-defined]

from bench.io_apps import wait as io_wait
from models.settings import Settings
from tasks.app import celery_config

BROKER = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("BENCH_BROKER_PREFIX", "keel-bench:")  # every key and channel of the run starts with it

app = Celery("bare")
app.config_from_object(
    {
        **celery_config(
            Settings(broker_url=BROKER, broker_prefix=PREFIX, database_url="postgresql://unused@localhost/unused")
        ),
        "task_default_queue": "bare",
        "task_queues": [Queue("bare")],  # type: ignore[no-untyped-call]
        "imports": [],
    }
)


@cache
def _redis(pid: int) -> redis.Redis:
    return redis.Redis.from_url(BROKER)


@app.task(name="bench.noop")  # type: ignore[untyped-decorator]
def noop(i: int) -> None:
    _redis(os.getpid()).rpush(PREFIX + "bench:done", time.time())


@app.task(name="bench.wait")  # type: ignore[untyped-decorator]
def wait(seconds: float, url: str | None) -> None:
    """The I/O workload's job (bench.io_peers): waits as a model call would, then records its finish."""
    io_wait(seconds, url)
    _redis(os.getpid()).rpush(PREFIX + "bench:done", time.time())
