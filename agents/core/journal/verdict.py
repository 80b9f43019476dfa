"""What "verified" means, in one place: the verdict of one `keel audit verify` and the one sentence the CLI, the
beat's log and the console use to tell it. Only the events a pass read and checked in that run are called verified;
the events an incremental pass took from its checkpoints are called trusted, with the checkpoints' times
(docs/audit-retention.md says what each kind of pass proves)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from agents.core.journal.verification import VerifyReport


def _utc(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _time(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        return value
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value)
        except ValueError:
            return None
    return None


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one verify proved: ``checked`` events of ``chains`` chains read and checked in that run (the only ones
    called verified), ``trusted`` events taken from checkpoints made between ``trusted_from`` and ``trusted_to`` by
    earlier runs (an incremental pass; a full one trusts nothing)."""

    ok: bool
    full: bool
    chains: int
    checked: int
    trusted: int = 0
    trusted_from: datetime | None = None
    trusted_to: datetime | None = None

    @classmethod
    def of(cls, report: VerifyReport) -> Verdict:
        return cls(
            report.ok,
            report.full,
            report.agents,
            report.read_events,
            report.trusted,
            report.trusted_from,
            report.trusted_to,
        )

    @classmethod
    def recorded(cls, *, ok: bool, agents: int, details: Mapping[str, Any]) -> Verdict | None:
        """A recorded verify's verdict (a row of ``audit_verifications``); None for a row recorded before verify
        kept the checked events apart from the trusted ones: it cannot say which were checked."""
        if "checked_events" not in details:
            return None
        return cls(
            ok,
            details.get("mode") == "full",
            agents,
            int(details.get("checked_events") or 0),
            int(details.get("trusted_events") or 0),
            _time(details.get("trusted_from")),
            _time(details.get("trusted_to")),
        )

    def details(self) -> dict[str, Any]:
        """The verdict as a recorded verify's details keep it."""
        return {
            "mode": "full" if self.full else "incremental",
            "checked_events": self.checked,
            "trusted_events": self.trusted,
            "trusted_from": None if self.trusted_from is None else self.trusted_from.isoformat(),
            "trusted_to": None if self.trusted_to is None else self.trusted_to.isoformat(),
        }

    def scope(self) -> str:
        """What the run checked and what it trusted, as one clause."""
        said = f"{self.checked} events in {self.chains} agent chains verified in this run"
        if self.full:
            return f"{said} (full: every chain walked from its start)"
        if not self.trusted:
            return f"{said} (incremental: no chain had a checkpoint to start from)"
        when = _utc(self.trusted_from) if self.trusted_from is not None else "an unknown time"
        if self.trusted_to is not None and _utc(self.trusted_to) != when:
            when = f"{when} to {_utc(self.trusted_to)}"
        return (
            f"{said}; {self.trusted} events trusted from checkpoints of {when} UTC, not checked in this run"
            " (incremental: an edit below a checkpoint goes unseen; keel audit verify without --incremental walks"
            " every chain)"
        )

    def text(self) -> str:
        """The line a passing verify prints (and the beat logs)."""
        return f"ok: {self.scope()}" if self.ok else f"failed: {self.scope().replace(' verified', ' read')}"
