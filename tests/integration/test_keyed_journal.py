"""The keyed journal: every link is an HMAC under an audit key kept outside the database, so someone who can rewrite
the database — a superuser, past the append-only triggers — still cannot edit, delete, insert, reorder or recompute
events without `keel audit verify` naming the agent and the event; keys rotate; chains from before the upgrade keep
verifying."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest
from psycopg.rows import dict_row

from agents.audit.archive import check_archivable, insert_record_txn, sealed_record
from agents.audit.ship import ship
from agents.audit.store import FileStore
from agents.client import Client
from agents.core import journal
from agents.core.commands import Command
from agents.core.errors import StaleRevision
from agents.core.journal import LegacyPart, Unchecked
from agents.core.phases import Event
from agents.core.transition import transition
from models import migrations
from models.audit_keys import AuditKeyMissing, AuditKeys
from models.db import Database
from models.migrations import DowngradeRefused
from models.settings import BadConfiguration, Settings
from models.tables import GENESIS_HASH
from models.urls import libpq_url
from tests.support.audit import TEST_KEY_ID, TEST_KEYS, TEST_SECRET, as_superuser, clean_env

pytestmark = pytest.mark.integration

KEEL = str(Path(sys.executable).parent / "keel")
ASK = {"prompt": "What changed?", "script": [{"content": "Nothing.", "cost": "0.5"}]}
HASHED = journal.HASHED  # the linked fields, as the chain query names them
#: An event's columns in INSERT order (below), as chain() names them.
COLUMNS = ("agent_id", *HASHED[1:], "prev_hash", "hash", "key_id")
FORGER = "mallory-has-the-database-but-not-the-key-000"
KEY_A = "rotation-key-a-0123456789abcdefghijklmnopq"
KEY_B = "rotation-key-b-0123456789abcdefghijklmnopq"


def keel_verify(db_url: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KEEL, "audit", "verify"],
        env={**clean_env(), "KEEL_DATABASE_URL": db_url, "KEEL_HOME": str(tmp_path / ".keel"), **env},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )


def _history(client: Client, name: str = "audited") -> Any:
    """Six events: created, submit, plan, a refused cancel, a suppressed submit, finish."""
    agent = client.create_agent(name)
    client.submit(agent.id, f"{name}-r1", ASK)
    transition(client.db, Command(agent.id, Event.PLAN, "worker", details={"model": "m"}))
    with pytest.raises(StaleRevision):
        client.cancel(agent.id, expected_revision=0, actor="late")
    client.submit(agent.id, f"{name}-r1", ASK)
    transition(client.db, Command(agent.id, Event.FINISH, "worker"))
    return agent


# --- what an attacker with the database but without the key can do ------------------------------------------------

Link = Callable[[dict[str, Any]], tuple[str, str | None]]


def with_sha256(keep_key_id: bool = True) -> Link:
    """Relink with the plain sha256 anyone can compute (the pre-0015 link), keeping or dropping the key id."""
    return lambda e: (journal.event_hash(**_fields(e)), e["key_id"] if keep_key_id else None)


def under(keys: AuditKeys, key_id: str) -> Link:
    """Relink with an HMAC under a key of the attacker's own."""
    return lambda e: (journal.event_mac(keys, key_id, **_fields(e)), key_id)


def _fields(e: dict[str, Any]) -> dict[str, Any]:
    return {"agent_id": e["agent_id"], **{name: e[name] for name in HASHED}}


def chain(raw: psycopg.Connection[Any], agent_id: UUID) -> list[dict[str, Any]]:
    with raw.cursor(row_factory=dict_row) as cur:
        cur.execute(
            "SELECT id, agent_id, seq, kind, event, actor, request_id, from_phase, to_phase, revision, decision,"
            " details::text AS details_json, at, prev_hash, hash, key_id FROM audit.journal WHERE agent_id = %s"
            " ORDER BY seq",
            (agent_id,),
        )
        return cur.fetchall()


def rewrite(
    raw: psycopg.Connection[Any],
    agent_id: UUID,
    events: list[dict[str, Any]],
    link: Link,
    *,
    from_seq: int = 1,
    extra: tuple[tuple[str, tuple[Any, ...]], ...] = (),
) -> None:
    """Replace the agent's chain with ``events``, numbered 1..n and relinked with ``link`` from ``from_seq`` on (the
    ones before keep their links), and move the agent's head to the new last event — a chain recomputed by a
    superuser who does not hold the key."""
    prev, rows = GENESIS_HASH, []
    for seq, original in enumerate(events, start=1):
        e = {**original, "seq": seq, "prev_hash": prev}
        digest, key_id = (original["hash"], original["key_id"]) if seq < from_seq else link(e)
        rows.append({**e, "hash": digest, "key_id": key_id})
        prev = digest
    inserts = [
        (
            "INSERT INTO audit.journal (agent_id, seq, kind, event, actor, request_id, from_phase, to_phase, revision,"
            " decision, details, at, prev_hash, hash, key_id)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            tuple(r[c] for c in COLUMNS),
        )
        for r in rows
    ]
    as_superuser(
        raw,
        ("DELETE FROM audit.journal WHERE agent_id = %s", (agent_id,)),
        *inserts,
        ("UPDATE agents SET journal_seq = %s, journal_head = %s WHERE id = %s", (len(rows), prev, agent_id)),
        *extra,
    )


def _edited(events: list[dict[str, Any]], seq: int) -> list[dict[str, Any]]:
    return [{**e, "actor": "mallory"} if e["seq"] == seq else e for e in events]


def _tamper(raw: psycopg.Connection[Any], agent_id: UUID, how: str) -> None:
    events = chain(raw, agent_id)
    third = events[2]
    forged = {**third, "actor": "mallory", "event": "approve"}
    if how == "edited":
        as_superuser(raw, ("UPDATE audit.journal SET actor = 'mallory' WHERE id = %s", (third["id"],)))
    elif how == "edited, the chain relinked from it with sha256":
        rewrite(raw, agent_id, _edited(events, 3), with_sha256(), from_seq=3)
    elif how == "edited, the chain relinked from it as unkeyed":
        rewrite(raw, agent_id, _edited(events, 3), with_sha256(keep_key_id=False), from_seq=3)
    elif how == "deleted":
        as_superuser(raw, ("DELETE FROM audit.journal WHERE id = %s", (third["id"],)))
    elif how == "deleted, the rest renumbered and relinked":
        rewrite(raw, agent_id, events[:2] + events[3:], with_sha256(), from_seq=3)
    elif how == "inserted, the rest renumbered and relinked":
        rewrite(raw, agent_id, [*events[:2], forged, *events[2:]], with_sha256(), from_seq=3)
    elif how == "inserted at the end, the head moved":
        rewrite(raw, agent_id, [*events, {**forged, "kind": "suppressed"}], with_sha256(), from_seq=7)
    elif how == "reordered":
        as_superuser(
            raw,
            ("UPDATE audit.journal SET seq = seq + 1000 WHERE id IN (%s, %s)", (third["id"], events[3]["id"])),
            ("UPDATE audit.journal SET seq = 4 WHERE id = %s", (third["id"],)),
            ("UPDATE audit.journal SET seq = 3 WHERE id = %s", (events[3]["id"],)),
        )
    elif how == "reordered, relinked":
        rewrite(raw, agent_id, [*events[:2], events[3], events[2], *events[4:]], with_sha256(), from_seq=3)
    elif how == "wholly recomputed with sha256":
        rewrite(raw, agent_id, _edited(events, 3), with_sha256())
    elif how == "wholly recomputed with sha256, unkeyed":
        rewrite(raw, agent_id, _edited(events, 3), with_sha256(keep_key_id=False))
    elif how == "wholly recomputed with a wrong key":
        rewrite(raw, agent_id, _edited(events, 3), under(AuditKeys.of({TEST_KEY_ID: FORGER}, TEST_KEY_ID), TEST_KEY_ID))
    else:
        raise AssertionError(how)


@pytest.mark.parametrize(
    ("how", "seq", "reason"),
    [
        ("edited", 3, "the event's content does not match its HMAC under key 'test-1'"),
        ("edited, the chain relinked from it with sha256", 3, "does not match its HMAC under key 'test-1'"),
        ("edited, the chain relinked from it as unkeyed", 3, "event 3 has no key but follows keyed event 1"),
        ("deleted", 3, "event 3 is missing (found 4)"),
        ("deleted, the rest renumbered and relinked", 3, "does not match its HMAC under key 'test-1'"),
        ("inserted, the rest renumbered and relinked", 3, "does not match its HMAC under key 'test-1'"),
        ("inserted at the end, the head moved", 7, "does not match its HMAC under key 'test-1'"),
        ("reordered", 3, "prev_hash does not match the previous event's hash"),
        ("reordered, relinked", 3, "does not match its HMAC under key 'test-1'"),
        ("wholly recomputed with sha256", 1, "does not match its HMAC under key 'test-1'"),
        (
            "wholly recomputed with sha256, unkeyed",
            1,
            "event 1 has no key, and this chain had no events when the journal was keyed",
        ),
        ("wholly recomputed with a wrong key", 1, "does not match its HMAC under key 'test-1'"),
    ],
)
def test_verify_names_the_agent_and_event_of_any_tampering_without_the_key(
    client: Client, db: Database, raw: psycopg.Connection[Any], db_url: str, tmp_path: Path, how: str, seq: int,
    reason: str,
) -> None:  # fmt: skip
    agent = _history(client)
    bystander = _history(client, "bystander")
    assert journal.verify(db).ok
    _tamper(raw, agent.id, how)
    report = journal.verify(db)
    assert not report.ok and report.unchecked == ()
    assert [(b.agent_id, b.seq) for b in report.breaks] == [(agent.id, seq)], report.breaks
    assert reason in report.breaks[0].reason
    assert journal.verify_chain(db, bystander.id).ok
    said = keel_verify(db_url, tmp_path)
    assert said.returncode == 1
    assert f"BROKEN agent 'audited' ({agent.id}) at event {seq} " in said.stderr, said.stderr
    assert reason in said.stderr and "bystander" not in said.stderr


def test_a_chain_recomputed_under_a_key_of_its_own_is_not_called_intact(
    client: Client, db: Database, raw: psycopg.Connection[Any], db_url: str, tmp_path: Path
) -> None:
    agent = _history(client)
    rewrite(
        raw,
        agent.id,
        _edited(chain(raw, agent.id), 3),
        under(AuditKeys.of({"mallory-1": FORGER}, "mallory-1"), "mallory-1"),
    )
    report = journal.verify(db)
    assert not report.ok and report.breaks == ()
    assert report.unchecked == (Unchecked(agent.id, "mallory-1", 1, 6),)
    said = keel_verify(db_url, tmp_path)
    assert said.returncode == 1 and "ok:" not in said.stdout
    assert (
        "NOT CHECKED: 6 events in 1 chains are linked with key 'mallory-1', which KEEL_AUDIT_KEYS does not hold"
        " (it holds 'test-1')" in said.stderr
    )
    assert f"agent 'audited' ({agent.id}): 6 events, the first at event 1" in said.stderr


def test_every_event_is_linked_with_an_hmac_under_the_current_key(client: Client, raw: psycopg.Connection[Any]) -> None:
    agent = _history(client)
    events = chain(raw, agent.id)
    assert [e["key_id"] for e in events] == [TEST_KEY_ID] * 6
    for e in events:
        assert e["hash"] == journal.event_mac(TEST_KEYS, TEST_KEY_ID, **_fields(e))
        assert e["hash"] != journal.event_hash(**_fields(e))
    assert [e.key_id for e in client.journal(agent_id=agent.id)] == [TEST_KEY_ID] * 6


def test_the_key_never_reaches_the_journal(client: Client, raw: psycopg.Connection[Any]) -> None:
    """Every process registers its ring with the redaction the journal's details pass through."""
    agent = client.create_agent("leaky")
    client.submit(agent.id, "r1", ASK)
    transition(client.db, Command(agent.id, Event.PLAN, "worker", details={"note": f"the key is {TEST_SECRET}"}))
    stored = raw.execute("SELECT details::text FROM audit.journal WHERE agent_id = %s AND seq = 3", (agent.id,))
    row = stored.fetchone()
    assert row is not None and row[0] == '{"note":"the key is ***"}'
    everything = raw.execute("SELECT string_agg(j::text, ' ') FROM audit.journal j").fetchone()
    assert everything is not None and TEST_SECRET not in everything[0]


# --- rotation, and verifying without the key -----------------------------------------------------------------------


def _settings(db_url: str, ring: dict[str, str], current: str) -> Settings:
    return Settings(database_url=db_url, audit_keys=ring, audit_key_id=current)  # type: ignore[arg-type]


def test_keys_rotate_without_breaking_old_links(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KEEL_AUDIT_KEYS", "KEEL_AUDIT_KEY_ID"):  # the suite's key: not part of these rings
        monkeypatch.delenv(name)
    with Client.from_settings(_settings(db_url, {"A": KEY_A}, "A")) as old:
        agent = _history(old, "long-lived")
    with Client.from_settings(_settings(db_url, {"A": KEY_A, "B": KEY_B}, "B")) as both:
        both.submit(agent.id, "after-rotation", ASK)
        newer = both.create_agent("newer")
        assert [e.key_id for e in both.journal(agent_id=agent.id)] == ["A"] * 6 + ["B"]
        report = journal.verify(both.db)
        assert report.ok and report.events == 8 and report.key_ids == ("A", "B")
    ring_b = {"KEEL_AUDIT_KEYS": json.dumps({"B": KEY_B}), "KEEL_AUDIT_KEY_ID": "B"}
    with Client.from_settings(_settings(db_url, {"B": KEY_B}, "B")) as dropped:
        report = journal.verify(dropped.db)
        assert not report.ok and report.breaks == ()
        assert report.unchecked == (Unchecked(agent.id, "A", 1, 6),)
        assert journal.verify_chain(dropped.db, newer.id).ok
    said = keel_verify(db_url, tmp_path, **ring_b)
    assert said.returncode == 1 and "BROKEN" not in said.stderr and "tamper" not in said.stderr
    assert (
        "NOT CHECKED: 6 events in 1 chains are linked with key 'A', which KEEL_AUDIT_KEYS does not hold (it holds 'B'):"
        " their links could not be checked" in said.stderr
    )
    restored = keel_verify(
        db_url, tmp_path, KEEL_AUDIT_KEYS=json.dumps({"A": KEY_A, "B": KEY_B}), KEEL_AUDIT_KEY_ID="B"
    )
    assert restored.returncode == 0 and "ok: 8 events in 2 agent chains verified" in restored.stdout


def test_without_a_key_nothing_is_journaled_and_verify_does_not_claim_ok(client: Client, db_url: str) -> None:
    agent = client.create_agent("keyed")
    client.submit(agent.id, "r1", ASK)
    keyless = Database(db_url)
    try:
        unkeyed = Client(keyless)
        with pytest.raises(AuditKeyMissing, match=r"^no audit key: Keel links journal events only with a key kept"):
            unkeyed.create_agent("unkeyed")
        with pytest.raises(AuditKeyMissing):
            transition(keyless, Command(agent.id, Event.CANCEL, "x", expected_revision=1))
        assert [a.name for a in client.list_agents().agents] == ["keyed"]
        assert client.get_state(agent.id).revision == 1 and len(client.journal()) == 2
        report = journal.verify(keyless)
        assert not report.ok and report.breaks == () and report.key_ids == ()
        assert report.unchecked == (Unchecked(agent.id, TEST_KEY_ID, 1, 2),)
    finally:
        keyless.dispose()


# --- chains from before the upgrade ---------------------------------------------------------------------------------


def _legacy_agent(conn: psycopg.Connection[Any], name: str, events: int) -> UUID:
    """An agent with ``events`` journal events as Keel before 0015 wrote them: no key id, plain sha256 links."""
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(
            "INSERT INTO agents (name, created_at, updated_at) VALUES (%s, clock_timestamp(), clock_timestamp())"
            " RETURNING id, created_at",
            (name,),
        )
        row = cur.fetchone()
        assert row is not None
    prev, statements = GENESIS_HASH, []
    for seq in range(1, events + 1):
        fields: dict[str, Any] = {
            "agent_id": row["id"],
            "seq": seq,
            "kind": "created" if seq == 1 else "rejected",
            "event": "create" if seq == 1 else "approve",
            "actor": "cli",
            "request_id": None,
            "from_phase": "idle",
            "to_phase": "idle",
            "revision": 0,
            "decision": "accepted" if seq == 1 else "illegal_transition",
            "details_json": journal.canonical_json({} if seq == 1 else {"error": "agent is idle"}),
            "at": row["created_at"],
        }
        digest = journal.event_hash(prev_hash=prev, **fields)
        statements.append(
            (
                "INSERT INTO audit.journal (agent_id, seq, kind, event, actor, request_id, from_phase, to_phase,"
                " revision, decision, details, at, prev_hash, hash)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                (*fields.values(), prev, digest),
            )
        )
        prev = digest
    statements.append(
        ("UPDATE agents SET journal_seq = %s, journal_head = %s WHERE id = %s", (events, prev, row["id"]))
    )
    as_superuser(conn, *statements)
    return UUID(str(row["id"]))


@pytest.fixture
def legacy(empty_db_url: str) -> Iterator[tuple[str, UUID, UUID]]:
    """A database with two chains written before the journal was keyed (3 and 2 events), upgraded to head with the
    test key: (its URL, the two agents' ids)."""
    migrations.upgrade(empty_db_url, "0011")
    with psycopg.connect(libpq_url(empty_db_url), autocommit=True) as conn:
        a, b = _legacy_agent(conn, "old-a", 3), _legacy_agent(conn, "old-b", 2)
    migrations.upgrade(empty_db_url, audit_keys=TEST_KEYS)
    yield empty_db_url, a, b


def _seals(url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(libpq_url(url)) as conn:
        return conn.execute("SELECT agent_id, seq, key_id FROM audit.legacy_chains ORDER BY seq DESC").fetchall()


def test_existing_chains_keep_verifying_and_the_first_keyed_event_links_onto_them(
    legacy: tuple[str, UUID, UUID], tmp_path: Path
) -> None:
    url, a, b = legacy
    assert _seals(url) == [(a, 3, TEST_KEY_ID), (b, 2, TEST_KEY_ID)]
    db = Database(url, audit_keys=TEST_KEYS)
    try:
        report = journal.verify(db)
        assert report.ok and set(report.legacy) == {LegacyPart(a, 3), LegacyPart(b, 2)}
        client = Client(db)
        legacy_head = client.agent_row(a).journal_head
        client.submit(a, "after-upgrade", ASK)
        events = client.journal(agent_id=a)
        assert [e.key_id for e in events] == [None, None, None, TEST_KEY_ID]
        assert events[3].prev_hash == legacy_head == events[2].hash
        report = journal.verify(db)
        assert report.ok and set(report.legacy) == {LegacyPart(a, 3), LegacyPart(b, 2)} and report.events == 6
    finally:
        db.dispose()
    said = keel_verify(url, tmp_path)
    assert said.returncode == 0, said.stderr
    assert (
        "legacy: 5 events in 2 chains were written before the journal was keyed (plain sha256; sealed with the key at"
        " the upgrade, so protected from then on, not before):" in said.stdout
    )
    assert f"  agent 'old-a' ({a}): events 1-3" in said.stdout and f"  agent 'old-b' ({b}): events 1-2" in said.stdout
    assert "ok: 6 events in 2 agent chains verified" in said.stdout


@pytest.mark.parametrize(
    ("how", "who", "seq", "reason"),
    [
        ("a legacy event edited", "a", 2, "the event's content does not match its hash"),
        (
            "a legacy event edited, the legacy chain relinked",
            "a",
            3,
            "events 1-3 were written before the journal was keyed, but they no longer end at the head sealed then",
        ),
        (
            "a legacy event edited, the legacy chain and the keyed link relinked",
            "a",
            3,
            "they no longer end at the head sealed then",
        ),
        (
            "a legacy event of a chain with no keyed event edited, relinked, the head moved",
            "b",
            2,
            "they no longer end at the head sealed then",
        ),
        ("the newest legacy event cut off, the head rewound", "b", 2, "the chain ends at event 1 but it had 2 events"),
        ("a keyed event relabelled as unkeyed", "a", 4, "event 4 has no key, but only events 1-3 of this chain"),
        ("the seal removed", "a", 1, "event 1 has no key, and this chain had no events when the journal was keyed"),
        (
            "a seal's head moved",
            "b",
            2,
            "does not match its HMAC under key 'test-1': it was not written by the upgrade",
        ),
        ("a keyed chain re-forged as legacy", "c", 1, "event 1 has no key, and this chain had no events when the"),
        ("a keyed chain re-forged as legacy, with a seal", "c", 2, "does not match its HMAC under key 'test-1'"),
        ("a legacy chain removed with its agent", "b", 2, "it now has no event, no row and no tombstone"),
    ],
)
def test_legacy_events_are_protected_from_the_upgrade_on(
    legacy: tuple[str, UUID, UUID], how: str, who: str, seq: int, reason: str
) -> None:
    url, a, b = legacy
    db = Database(url, audit_keys=TEST_KEYS)
    try:
        client = Client(db)
        client.submit(a, "after-upgrade", ASK)
        c = client.create_agent("new-c").id
        client.archive(c, actor="carol")
        assert journal.verify(db).ok
        with psycopg.connect(libpq_url(url), autocommit=True) as raw:
            events = chain(raw, {"a": a, "b": b, "c": c}[who])
            if how == "a legacy event edited":
                as_superuser(raw, ("UPDATE audit.journal SET actor = 'mallory' WHERE id = %s", (events[1]["id"],)))
            elif how == "a legacy event edited, the legacy chain relinked":
                edited = _edited(events, 2)
                rewrite(raw, a, edited[:3], with_sha256(keep_key_id=False), from_seq=2)
                as_superuser(raw, *_reinsert(events[3:]), _head(a, events[-1]))
            elif how == "a legacy event edited, the legacy chain and the keyed link relinked":
                rewrite(
                    raw, a, _edited(events, 2), lambda e: (journal.event_hash(**_fields(e)), e["key_id"]), from_seq=2
                )
            elif how == "a legacy event of a chain with no keyed event edited, relinked, the head moved":
                rewrite(raw, b, _edited(events, 1), with_sha256(keep_key_id=False))
            elif how == "the newest legacy event cut off, the head rewound":
                rewrite(raw, b, events[:1], with_sha256(keep_key_id=False), from_seq=2)
            elif how == "a keyed event relabelled as unkeyed":
                as_superuser(raw, ("UPDATE audit.journal SET key_id = NULL WHERE id = %s", (events[3]["id"],)))
            elif how == "the seal removed":
                as_superuser(raw, ("DELETE FROM audit.legacy_chains WHERE agent_id = %s", (a,)))
            elif how == "a seal's head moved":
                rewrite(
                    raw, b, _edited(events, 1), with_sha256(keep_key_id=False),
                    extra=(("UPDATE audit.legacy_chains SET head = (SELECT journal_head FROM agents WHERE id = %s)"
                            " WHERE agent_id = %s", (b, b)),),
                )  # fmt: skip
            elif how == "a keyed chain re-forged as legacy":
                rewrite(raw, c, _edited(events, 2), with_sha256(keep_key_id=False))
            elif how == "a keyed chain re-forged as legacy, with a seal":
                rewrite(
                    raw, c, _edited(events, 2), with_sha256(keep_key_id=False),
                    extra=(("INSERT INTO audit.legacy_chains (agent_id, seq, head, key_id, seal)"
                            " SELECT id, journal_seq, journal_head, 'test-1', repeat('f', 64) FROM agents"
                            " WHERE id = %s",
                            (c,)),),
                )  # fmt: skip
            elif how == "a legacy chain removed with its agent":
                as_superuser(
                    raw,
                    ("DELETE FROM audit.journal WHERE agent_id = %s", (b,)),
                    ("DELETE FROM agents WHERE id = %s", (b,)),
                )
            else:
                raise AssertionError(how)
        report = journal.verify(db)
        target = {"a": a, "b": b, "c": c}[who]
        assert [(x.agent_id, x.seq) for x in report.breaks] == [(target, seq)], report.breaks
        assert reason in report.breaks[0].reason
    finally:
        db.dispose()


def _reinsert(events: list[dict[str, Any]]) -> list[tuple[str, tuple[Any, ...]]]:
    return [
        (
            "INSERT INTO audit.journal (agent_id, seq, kind, event, actor, request_id, from_phase, to_phase, revision,"
            " decision, details, at, prev_hash, hash, key_id)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            tuple(e[c] for c in COLUMNS),
        )
        for e in events
    ]


def _head(agent_id: UUID, last: dict[str, Any]) -> tuple[str, tuple[Any, ...]]:
    return (
        "UPDATE agents SET journal_seq = %s, journal_head = %s WHERE id = %s",
        (last["seq"], last["hash"], agent_id),
    )


def test_the_legacy_seals_are_written_once(legacy: tuple[str, UUID, UUID]) -> None:
    url, _, _ = legacy
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        for sql in (
            "UPDATE audit.legacy_chains SET seq = seq + 1",
            "DELETE FROM audit.legacy_chains",
            "TRUNCATE audit.legacy_chains",
            "INSERT INTO audit.legacy_chains SELECT gen_random_uuid(), 1, 'x', 'test-1', 'y'",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="written once, by migration 0015"):
                conn.execute(sql)
    assert len(_seals(url)) == 2


def test_downgrade_works_until_an_event_is_keyed_then_refuses_and_changes_nothing(
    legacy: tuple[str, UUID, UUID],
) -> None:
    url, a, _ = legacy
    migrations.downgrade(url, "0011")
    with psycopg.connect(libpq_url(url)) as conn:
        assert conn.execute("SELECT to_regclass('audit.legacy_chains')").fetchone() == (None,)
    migrations.upgrade(url, audit_keys=TEST_KEYS)  # seals the same chains again
    migrations.check(url)
    db = Database(url, audit_keys=TEST_KEYS)
    try:
        Client(db).submit(a, "after-upgrade", ASK)
        # A request in flight keyed by its agent (0028) would refuse the downgrade first: it has ended.
        Client(db).cancel(a, actor="test", reason="before the downgrade")
        with pytest.raises(
            DowngradeRefused, match="cannot downgrade below 0015: the journal holds 2 events linked with"
        ):
            migrations.downgrade(url, "0011")
        assert migrations.revision_at(url) == migrations.head()
        report = journal.verify(db)
        assert report.ok and report.events == 7
    finally:
        db.dispose()


def test_upgrading_a_journal_with_events_needs_the_key(empty_db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    migrations.upgrade(empty_db_url, "0011")
    with psycopg.connect(libpq_url(empty_db_url), autocommit=True) as conn:
        _legacy_agent(conn, "old", 2)
    monkeypatch.delenv("KEEL_AUDIT_KEYS")
    monkeypatch.delenv("KEEL_AUDIT_KEY_ID")
    monkeypatch.setenv("KEEL_ENVIRONMENT", "production")
    monkeypatch.setenv("KEEL_DATABASE_URL", empty_db_url)
    monkeypatch.setenv("KEEL_BROKER_URL", "redis://127.0.0.1:1/0")
    with pytest.raises(BadConfiguration, match="KEEL_AUDIT_KEYS: production needs the journal's key ring"):
        migrations.upgrade(empty_db_url)
    assert migrations.revision_at(empty_db_url) == "0011"


@pytest.mark.parametrize(
    "how",
    [
        "intact",
        "a legacy event edited, the legacy chain and the keyed link relinked",
        "a keyed event relabelled as unkeyed",
        "a keyed event edited",
        "the seal removed",
    ],
)
def test_the_console_window_judges_an_event_as_verify_does(legacy: tuple[str, UUID, UUID], how: str) -> None:
    """The console's window over events 2-4 (legacy 2-3, sealed at 3; 4 the first keyed) and keel audit verify's full
    walk give the same verdict, at the same event, in the same words: one check judges both."""
    url, a, _ = legacy
    db = Database(url, audit_keys=TEST_KEYS)
    try:
        Client(db).submit(a, "after-upgrade", ASK)  # event 4, the first keyed one, links onto the sealed head
        with psycopg.connect(libpq_url(url), autocommit=True) as raw:
            events = chain(raw, a)
            if how == "a legacy event edited, the legacy chain and the keyed link relinked":
                # Before, the window checked legacy events by their plain hash alone and passed this.
                rewrite(
                    raw, a, _edited(events, 2), lambda e: (journal.event_hash(**_fields(e)), e["key_id"]), from_seq=2
                )
            elif how == "a keyed event relabelled as unkeyed":
                as_superuser(raw, ("UPDATE audit.journal SET key_id = NULL WHERE id = %s", (events[3]["id"],)))
            elif how == "a keyed event edited":
                as_superuser(raw, ("UPDATE audit.journal SET actor = 'mallory' WHERE id = %s", (events[3]["id"],)))
            elif how == "the seal removed":
                as_superuser(raw, ("DELETE FROM audit.legacy_chains WHERE agent_id = %s", (a,)))
        full = journal.verify_chain(db, a)
        # A window that starts at event 2, except where the break is event 1's (the seal's absence shows there).
        first = 1 if how == "the seal removed" else 2
        page = journal.journal_page(db, a, before=None, limit=5 - first)
        assert page is not None and (page.first_seq, page.last_seq) == (first, 4)
        if how == "intact":
            assert full.broken is None and page.broken is None
            return
        assert full.broken is not None and page.broken is not None, (full.broken, page.broken)
        assert (page.broken.seq, page.broken.journal_id, page.broken.reason) == (
            full.broken.seq,
            full.broken.journal_id,
            full.broken.reason,
        )
    finally:
        db.dispose()


def test_legacy_chains_verify_after_their_legacy_part_is_archived(
    legacy: tuple[str, UUID, UUID], tmp_path: Path
) -> None:
    """Archiving legacy events (as a real archive leaves it: the sealed record, the rows gone) keeps their chains
    verifying: each walk resumes from the archived head, legacy count, keyed boundary and seal included."""
    url, a, b = legacy
    db = Database(url, audit_keys=TEST_KEYS)
    try:
        Client(db).submit(a, "after-upgrade", ASK)  # a's event 4, keyed, after its 3 legacy ones
        store = FileStore(tmp_path)
        ship(db, store, TEST_KEYS, destination=str(tmp_path), segment_events=2, segment_age=timedelta(minutes=9),
             flush=True)  # fmt: skip
        with psycopg.connect(libpq_url(url), autocommit=True) as raw:
            upto = raw.execute("SELECT max(id) FROM audit.journal WHERE key_id IS NULL").fetchone()[0]  # type: ignore[index]
            with raw.transaction():
                proved = check_archivable(
                    raw, store, TEST_KEYS, what="legacy", destination=str(tmp_path), first_id=1, last_id=upto, events=5
                )
            assert proved.heads[str(a)]["legacy"] == 3 and proved.heads[str(b)]["last_seq"] == 2
            now = datetime.now(UTC)
            insert_record_txn(
                raw,
                sealed_record(TEST_KEYS, proved, partition="journal_legacy", from_at=None, to_at=now,
                              archived_by="test", archived_at=now),
            )  # fmt: skip
            as_superuser(raw, ("DELETE FROM audit.journal WHERE id <= %s", (upto,)))
        report = journal.verify(db)
        assert report.ok, (report.breaks, report.archive_problems)
        assert report.events == 1 and set(report.legacy) == {LegacyPart(a, 3), LegacyPart(b, 2)}
        with psycopg.connect(libpq_url(url), autocommit=True) as raw:  # an unkeyed event after the keyed one
            as_superuser(raw, ("UPDATE audit.journal SET key_id = NULL WHERE agent_id = %s AND seq = 4", (a,)))
        broken = journal.verify(db).breaks
        assert [(x.agent_id, x.seq) for x in broken] == [(a, 4)]
        assert "event 4 has no key, but only events 1-3 of this chain" in broken[0].reason
    finally:
        db.dispose()
