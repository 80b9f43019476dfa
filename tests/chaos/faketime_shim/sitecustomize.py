"""Imported at start-up only by the chaos tests' processes that run under libfaketime (``PYTHONPATH``).

They run with ``FAKETIME_DONT_FAKE_MONOTONIC=1`` (a faked monotonic clock hangs timed waits), and libfaketime 0.9.10
then refuses Python's ``time.sleep`` (``clock_nanosleep`` on an absolute monotonic deadline: EINVAL). Sleep with
``select`` instead, which it leaves alone.
"""

from __future__ import annotations

import select
import time


def _sleep(seconds: float) -> None:
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        select.select([], [], [], left)


time.sleep = _sleep
