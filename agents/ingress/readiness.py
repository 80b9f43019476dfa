"""One answer shared by the callers of an expensive check (``/readyz``: a database connection, a schema read and a Redis
ping): reused for a second or two, and computed once for every caller that comes while it is being computed. Per
process, in its event loop: unauthenticated probes cost the dependencies at most one check per process per
:data:`READY_CACHE_SECONDS`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")

#: How long a readiness answer is reused: short next to any prober's interval (compose's is 10 s).
READY_CACHE_SECONDS = 1.5


class SharedCheck(Generic[T]):
    """The last answer of a check, reused for ``cache_seconds`` after it came; callers that arrive while a check is
    running wait for that one (a caller that goes away does not cancel it for the others)."""

    def __init__(self, cache_seconds: float = READY_CACHE_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.cache_seconds = cache_seconds
        self.clock = clock
        self._answer: tuple[float, T] | None = None
        self._running: asyncio.Future[T] | None = None

    async def get(self, check: Callable[[], Awaitable[T]]) -> T:
        """The answer of ``check()``: the last one if it is fresh, else the one being computed, else a new one."""
        if self._answer is not None and self.clock() - self._answer[0] < self.cache_seconds:
            return self._answer[1]
        if self._running is None:
            self._running = asyncio.ensure_future(self._run(check))
        return await asyncio.shield(self._running)

    async def _run(self, check: Callable[[], Awaitable[T]]) -> T:
        try:
            found = await check()
            self._answer = (self.clock(), found)
            return found
        finally:
            self._running = None
