"""`keel audit verify` with its outcome recorded (``audit_verifications``), for the ``audit_verify`` alert."""

from __future__ import annotations

from typing import Literal

from agents.core import journal
from agents.core.journal import VerifyReport
from models.alerts_sql import record_verification
from models.db import Database


def verify_and_record(db: Database, source: Literal["cli", "beat"]) -> VerifyReport:
    """Walk every chain (:func:`agents.core.journal.verify`, a full pass) and record whether it held, and where not
    (agent ids and event numbers, never event contents)."""
    report = journal.verify(db)
    record_verification(
        db,
        source=source,
        ok=report.ok,
        agents=report.agents,
        events=report.events,
        breaks=len(report.breaks),
        details={"breaks": [{"agent_id": str(b.agent_id), "seq": b.seq} for b in report.breaks[:20]]},
    )
    return report
