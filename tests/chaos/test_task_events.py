"""Celery's task events (what Flower's task views show) are off by default (KEEL_WORKER_TASK_EVENTS): they cost broker
messages on every job. A running Flower turns them on with its ``enable_events`` broadcast, so its views still work.
A real worker, a real event receiver on the test's own broker prefix."""

from __future__ import annotations

import threading
from typing import Any

import pytest

import tests.support.handlers  # noqa: F401 - registers the `count` handler submitted to here
from agents.client import Client
from tests.chaos.conftest import Stack, wait_until
from tests.support.keys import scoped

pytestmark = pytest.mark.chaos


def _watch(stack: Stack) -> tuple[list[dict[str, Any]], threading.Event, Any]:
    """Collect every task event on the test's broker, on a thread, until the returned event is set."""
    from tasks.app import make_app

    celery = make_app(stack.broker.settings(database_url=stack.db_url))
    seen: list[dict[str, Any]] = []
    stop, listening = threading.Event(), threading.Event()

    def run() -> None:
        with celery.connection_for_read() as conn:
            receiver = celery.events.Receiver(conn, handlers={"*": seen.append})
            listening.set()
            for _ in receiver.itercapture(limit=None, timeout=0.5, wakeup=False):
                if stop.is_set():
                    return

    thread = threading.Thread(target=lambda: _until_stopped(run, stop), daemon=True)
    thread.start()
    listening.wait(10)
    return seen, stop, celery


def _until_stopped(run: Any, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            run()
        except TimeoutError:  # no event within the timeout: look at the stop flag, listen again
            continue


def _idle(celery: Any) -> bool:
    """The worker answers and holds no active request (its main process has finished the last one's bookkeeping)."""
    replies = celery.control.inspect(timeout=1.0).active()
    return bool(replies) and not any(replies.values())


def _succeeded(seen: list[dict[str, Any]]) -> set[str]:
    return {e["uuid"] for e in list(seen) if e.get("type") == "task-succeeded"}


def test_task_events_are_off_until_flower_asks_for_them(stack: Stack, client: Client) -> None:
    seen, stop, celery = _watch(stack)
    try:
        stack.worker("w1", concurrency=1)
        stack.beat()
        first, second = client.create_agent("first"), client.create_agent("second")
        client.submit(first.id, "req-quiet", None, operation="count")
        wait_until("the first job", lambda: client.get_state(first.id).phase == "done", 60)
        # The row commits inside the task; the worker's own bookkeeping of the request (where task-succeeded would be
        # sent) ends a moment later. Turn events on only once the worker holds no active request, or the first job's
        # own event may rightly be sent under the new setting.
        wait_until("the worker idle", lambda: _idle(celery), 30)
        # Its worker's heartbeats arrive (they are not task events): the receiver hears the worker, just no tasks.
        wait_until("a worker heartbeat", lambda: any(e.get("type") == "worker-heartbeat" for e in list(seen)), 30)
        assert not [e for e in list(seen) if str(e.get("type", "")).startswith("task-")], "task events while off"

        celery.control.enable_events()  # what a running Flower broadcasts (its --enable_events, on by default)
        client.submit(second.id, "req-seen", None, operation="count")
        wait_until("the second job", lambda: client.get_state(second.id).phase == "done", 60)
        wait_until("its task events", lambda: scoped(second.id, "req-seen:count:1") in _succeeded(seen), 30)
        assert scoped(first.id, "req-quiet:count:1") not in _succeeded(seen)
    finally:
        stop.set()
        celery.close()
