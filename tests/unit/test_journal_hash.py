from __future__ import annotations

import uuid
from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

from agents.core.journal import canonical_json, event_hash, event_mac
from models.audit_keys import AuditKeys

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


KEYS = AuditKeys.of({"k1": "a" * 32, "k2": "a" * 32, "k3": "b" * 32}, "k1")


def mac(e: E, key_id: str = "k1", keys: AuditKeys = KEYS) -> str:
    return event_mac(keys, key_id, **{f.name: getattr(e, f.name) for f in fields(e)})


def test_a_legacy_events_hash_is_the_one_keel_wrote_before_the_journal_was_keyed() -> None:
    """Legacy events are checked with this function: it must stay byte for byte what Keel before 0015 computed
    (this digest is that code's, for E())."""
    assert h(E()) == "b653f82a78e2e6867774e2daa032ff9d84070a2ca355960a2932d90b34d54c72"


def test_an_events_hmac_covers_every_field_the_key_id_and_the_secret() -> None:
    base = E()
    assert mac(base) != h(base), "a keyed link is not the plain sha256 anyone could compute"
    assert len(mac(base)) == 64 and mac(base) == mac(base)
    for name, value in CHANGED.items():
        assert mac(replace(base, **{name: value})) != mac(base), name
    assert mac(base, "k2") != mac(base), "the key id is covered: the same secret under another id links differently"
    assert mac(base, "k3") != mac(base), "another secret"
    other = AuditKeys.of({"k1": "c" * 32}, "k1")
    assert mac(base, "k1", other) != mac(base), "a forger's secret under the same id"


CHANGED: dict[str, Any] = {
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
    "at": E().at + timedelta(microseconds=1),
}


def test_every_field_is_covered_by_the_hash() -> None:
    base = E()
    assert set(CHANGED) == {f.name for f in fields(E)}
    for name, value in CHANGED.items():
        assert h(replace(base, **{name: value})) != h(base), name


def test_the_same_instant_in_another_zone_hashes_the_same() -> None:
    base = E()
    shifted = replace(base, at=base.at.astimezone(timezone(timedelta(hours=5))))
    assert h(shifted) == h(base)
    assert mac(shifted) == mac(base)


def test_canonical_json_is_key_order_independent() -> None:
    assert canonical_json({"a": 1, "b": 2}) == canonical_json({"b": 2, "a": 1}) == '{"a":1,"b":2}'
