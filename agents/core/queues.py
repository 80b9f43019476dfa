"""Jobs as transitions schedule them: keys, queues, and the rows a transition inserts."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from agents.core.commands import LOW, JobSpec
from agents.core.keys import current_request_key, derive, make_key
from models.jobs_sql import NewJob
from models.schemas import AgentRow
from models.tables import JOBS_QUEUE, LOW_QUEUE

__all__ = ["JOBS_QUEUE", "LOW_QUEUE", "NORMAL_PRIORITY", "new_jobs", "queue_for"]
NORMAL_PRIORITY = 5


def queue_for(agent: AgentRow, spec: JobSpec) -> str:
    return LOW_QUEUE if agent.priority == LOW or spec.priority < NORMAL_PRIORITY else JOBS_QUEUE


def new_jobs(
    agent: AgentRow,
    specs: Sequence[JobSpec],
    now: datetime,
    *,
    publish_due: bool,
    traceparent: str | None = None,
    step: str | None = None,
) -> list[NewJob]:
    """The rows for ``specs`` under ``agent``'s current request, keyed from ``step``'s key when a step's outcome
    schedules them. Jobs due now are inserted already ``enqueued`` when the caller publishes them right after commit
    (the dispatcher re-publishes any that never arrive). ``traceparent``: the trace their runs continue (the
    scheduling work's), None when traces are off."""
    if specs and agent.request_id is None:
        raise ValueError("jobs need a request in flight")
    request = current_request_key(agent.id, agent.request_id, agent.request_key) if specs else ""
    rows = []
    for spec in specs:
        run_at = now + spec.delay if spec.delay else now
        due = run_at <= now
        rows.append(
            NewJob(
                key=(
                    derive(step, spec.operation, spec.target)
                    if step is not None
                    else make_key(request, spec.operation, spec.target)
                ),
                agent_id=agent.id,
                request_id=agent.request_id or "",
                operation=spec.operation,
                target=spec.target,
                payload=dict(spec.payload),
                status="enqueued" if publish_due and due else "pending",
                queue=queue_for(agent, spec),
                priority=min(spec.priority, 2) if agent.priority == LOW else spec.priority,
                run_at=run_at,
                traceparent=traceparent,
            )
        )
    return rows
