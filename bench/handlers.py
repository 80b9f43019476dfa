"""The benchmark's no-op job handler (KEEL_IMPORTS=bench.handlers)."""

from __future__ import annotations

from agents.core.phases import Event
from agents.jobs.handlers import JobContext, JobResult, handler


@handler("bench_noop", repeatable=True)  # does nothing: run twice, no harm (not staged: docs/benchmarks.md)
def bench_noop(ctx: JobContext) -> JobResult:
    return JobResult(event=Event.FINISH)
