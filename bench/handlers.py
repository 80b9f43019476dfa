"""The benchmark's no-op job handler (KEEL_IMPORTS=bench.handlers)."""

from __future__ import annotations

from agents.handlers import JobContext, JobResult, handler
from agents.phases import Event


@handler("bench_noop")
def bench_noop(ctx: JobContext) -> JobResult:
    return JobResult(event=Event.FINISH)
