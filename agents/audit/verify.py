"""`keel audit verify` (the CLI's and the beat's, one function), its outcome recorded (``audit_verifications``) for
the ``audit_verify`` alert and the console with what it checked and what it trusted (agents/core/journal/verdict.py)."""

from __future__ import annotations

from typing import Literal

from agents.core import journal
from agents.core.journal import VerifyReport
from agents.core.journal.verdict import Verdict
from models.alerts_sql import record_verification
from models.db import Database


def verify_and_record(
    db: Database,
    source: Literal["cli", "beat"],
    *,
    full: bool = True,
    record: bool = True,
    chunk_chains: int = journal.VERIFY_CHUNK_CHAINS,
    chunk_events: int = journal.VERIFY_CHUNK_EVENTS,
) -> VerifyReport:
    """Walk the chains (:func:`agents.core.journal.verify` with ``db``'s audit keys), ``full`` from each chain's start
    or incremental from its checkpoint; with ``record``, move the intact chains' checkpoints and record the
    :class:`Verdict` (where a chain broke, never event contents), without it (the auditor's read-only role) write
    nothing. Why a pass that dies midway leaves only true checkpoints:
    docs/explanation/journal-and-transitions.md#saving-checkpoints."""
    report = journal.verify(
        db, full=full, save_checkpoints=record, chunk_chains=chunk_chains, chunk_events=chunk_events
    )
    if record:
        verdict = Verdict.of(report)
        record_verification(
            db,
            source=source,
            ok=report.ok,
            agents=report.agents,
            events=report.read_events,
            breaks=len(report.breaks),
            details={
                **verdict.details(),
                "breaks": [{"agent_id": str(b.agent_id), "seq": b.seq} for b in report.breaks[:20]],
                "unchecked_events": sum(u.events for u in report.unchecked),
                "unchecked": [
                    {"agent_id": str(u.agent_id), "key_id": u.key_id, "seq": u.seq, "events": u.events}
                    for u in report.unchecked[:20]
                ],
                "legacy_events": sum(p.events for p in report.legacy),
                "archive_problems": len(report.archive_problems),
                "checkpoint_problems": len(report.checkpoint_problems),
            },
        )
    return report
