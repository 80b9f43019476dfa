"""The threads handlers run on, kept from one job to the next."""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("keel.runner")  # part of running a job: the runner's logger


class HandlerThreads:
    """The threads handlers run on, kept for the next job: a thread started per job costs more than a short step.
    A handler runs on a thread of its own so that its run limit holds even when it never returns; a thread whose
    handler did not return in time is never given another job (its process ends: :func:`tasks.jobs.end_process`)."""

    def __init__(self) -> None:
        self._idle: list[_HandlerThread] = []
        self._lock = threading.Lock()

    def run(self, name: str, context: contextvars.Context, call: Callable[[], None], limit: float) -> bool:
        """Run ``call`` in ``context`` on a free thread named ``name``; True if it returned within ``limit``."""
        with self._lock:
            thread = self._idle.pop() if self._idle else None
        if thread is None or not thread.is_alive():  # none free (or one inherited across a fork: dead)
            thread = _HandlerThread()
        if not thread.call(name, context, call, limit):
            return False
        with self._lock:
            self._idle.append(thread)
        return True


class _HandlerThread:
    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[str, contextvars.Context, Callable[[], None], threading.Event]]
        self._calls = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="keel-job", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def call(self, name: str, context: contextvars.Context, call: Callable[[], None], limit: float) -> bool:
        done = threading.Event()
        self._calls.put((name, context, call, done))
        return done.wait(limit)

    def _serve(self) -> None:
        me = threading.current_thread()
        while True:
            name, context, call, done = self._calls.get()
            me.name = name
            try:
                context.run(call)
            except BaseException:  # what a handler raised past Exception: the step ends without a result
                log.exception("a handler thread ended its call with an exception it did not catch")
            finally:
                me.name = "keel-job"
                done.set()
