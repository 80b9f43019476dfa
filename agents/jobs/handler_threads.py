"""The threads handlers run on, kept from one job to the next, and the count of work left running past its limit."""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("keel.runner")  # part of running a job: the runner's logger


class StuckWork:
    """Work of this process that ran past its limit and still runs (a handler, a tool's thread): nothing can stop a
    Python thread, so it is counted, and the process is replaced once the count reaches its limit."""

    def __init__(self) -> None:
        self._running: list[Callable[[], bool]] = []
        self._lock = threading.Lock()

    def add(self, running: Callable[[], bool]) -> None:
        """Count work that ``running()`` says still runs."""
        with self._lock:
            self._running.append(running)

    def count(self) -> int:
        with self._lock:
            self._running = [running for running in self._running if running()]
            return len(self._running)


#: This process's stuck work: the runner's handlers and the agent loop's tools report to it.
STUCK = StuckWork()


class HandlerThreads:
    """The threads handlers run on, kept for the next job: a thread started per job costs more than a short step.
    A handler runs on a thread of its own so that its run limit holds even when it never returns; a thread whose
    handler did not return in time is never given another job: it ends when its handler does (:data:`STUCK`)."""

    def __init__(self, stuck: StuckWork = STUCK) -> None:
        self._idle: list[_HandlerThread] = []
        self._lock = threading.Lock()
        self._stuck = stuck

    def run(self, name: str, context: contextvars.Context, call: Callable[[], None], limit: float) -> bool:
        """Run ``call`` in ``context`` on a free thread named ``name``; True if it returned within ``limit``."""
        with self._lock:
            thread = self._idle.pop() if self._idle else None
        if thread is None or not thread.is_alive():  # none free (or one inherited across a fork: dead)
            thread = _HandlerThread()
        if not thread.call(name, context, call, limit):
            self._stuck.add(thread.busy)
            return False
        with self._lock:
            self._idle.append(thread)
        return True


class _HandlerThread:
    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[str, contextvars.Context, Callable[[], None], threading.Event]]
        self._calls = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._abandoned = False
        self._busy = False
        self._thread = threading.Thread(target=self._serve, name="keel-job", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def busy(self) -> bool:
        """Whether the call it was given is still running."""
        with self._lock:
            return self._busy

    def call(self, name: str, context: contextvars.Context, call: Callable[[], None], limit: float) -> bool:
        done = threading.Event()
        with self._lock:
            self._busy = True
        self._calls.put((name, context, call, done))
        if done.wait(limit):
            return True
        with self._lock:  # the call may have ended since: then the thread is as good as new
            if not self._busy:
                return True
            self._abandoned = True  # it ends once its call does
        return False

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
                with self._lock:
                    self._busy = False
                    abandoned = self._abandoned
                done.set()
            if abandoned:
                return
