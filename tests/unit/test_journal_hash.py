from __future__ import annotations

import uuid
from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

from agents.core.journal import canonical_json, event_hash

AGENT = uuid.UUID(int=5)


@dataclass(frozen=True)
class E:
    prev_hash: str = "0" * 64
    agent_id: uuid.UUID = AGENT
    seq: int = 3
    kind: str = "transition"
    event: str = "plan"
    actor: str = "worker"
    request_id: str | None = "r1"
    from_phase: str | None = "planning"
    to_phase: str | None = "executing"
    revision: int = 2
    decision: str = "accepted"
    details_json: str = canonical_json({"b": 1, "a": [1, 2]})
    at: datetime = datetime(2026, 1, 1, 12, 0, 0, 123456, tzinfo=UTC)


def h(e: E) -> str:
    return event_hash(**{f.name: getattr(e, f.name) for f in fields(e)})


def test_every_field_is_covered_by_the_hash() -> None:
    base = E()
    changed: dict[str, Any] = {
        "prev_hash": "1" * 64,
        "agent_id": uuid.UUID(int=6),
        "seq": 4,
        "kind": "rejected",
        "event": "finish",
        "actor": "mallory",
        "request_id": None,
        "from_phase": "idle",
        "to_phase": "done",
        "revision": 3,
        "decision": "stale_revision",
        "details_json": "{}",
        "at": base.at + timedelta(microseconds=1),
    }
    assert set(changed) == {f.name for f in fields(E)}
    for name, value in changed.items():
        assert h(replace(base, **{name: value})) != h(base), name


def test_the_same_instant_in_another_zone_hashes_the_same() -> None:
    base = E()
    shifted = replace(base, at=base.at.astimezone(timezone(timedelta(hours=5))))
    assert h(shifted) == h(base)


def test_canonical_json_is_key_order_independent() -> None:
    assert canonical_json({"a": 1, "b": 2}) == canonical_json({"b": 2, "a": 1}) == '{"a":1,"b":2}'
