"""Chains written before the journal was keyed (migration 0015): they keep verifying with plain sha256, sealed by the
upgrade, and the first keyed event links onto them; an edit of them after the upgrade is named by `keel audit verify`
and by the console's window alike, and they keep verifying once archived."""

from __future__ import annotations

from collections.abc import Iterator
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
from agents.core.journal import LegacyPart
from models import migrations
from models.db import Database
from models.migrations import DowngradeRefused
from models.settings import BadConfiguration
from models.tables import GENESIS_HASH
from models.urls import libpq_url
from tests.support.audit import TEST_KEY_ID, TEST_KEYS, as_superuser
from tests.support.tamper import COLUMNS, chain, edited_at, keel_verify, linked_fields, rewrite, with_sha256

pytestmark = pytest.mark.integration

ASK = {"prompt": "What changed?", "script": [{"content": "Nothing.", "cost": "0.5"}]}


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
                edited = edited_at(events, 2)
                rewrite(raw, a, edited[:3], with_sha256(keep_key_id=False), from_seq=2)
                as_superuser(raw, *_reinsert(events[3:]), _head(a, events[-1]))
            elif how == "a legacy event edited, the legacy chain and the keyed link relinked":
                rewrite(
                    raw,
                    a,
                    edited_at(events, 2),
                    lambda e: (journal.event_hash(**linked_fields(e)), e["key_id"]),
                    from_seq=2,
                )
            elif how == "a legacy event of a chain with no keyed event edited, relinked, the head moved":
                rewrite(raw, b, edited_at(events, 1), with_sha256(keep_key_id=False))
            elif how == "the newest legacy event cut off, the head rewound":
                rewrite(raw, b, events[:1], with_sha256(keep_key_id=False), from_seq=2)
            elif how == "a keyed event relabelled as unkeyed":
                as_superuser(raw, ("UPDATE audit.journal SET key_id = NULL WHERE id = %s", (events[3]["id"],)))
            elif how == "the seal removed":
                as_superuser(raw, ("DELETE FROM audit.legacy_chains WHERE agent_id = %s", (a,)))
            elif how == "a seal's head moved":
                rewrite(
                    raw, b, edited_at(events, 1), with_sha256(keep_key_id=False),
                    extra=(("UPDATE audit.legacy_chains SET head = (SELECT journal_head FROM agents WHERE id = %s)"
                            " WHERE agent_id = %s", (b, b)),),
                )  # fmt: skip
            elif how == "a keyed chain re-forged as legacy":
                rewrite(raw, c, edited_at(events, 2), with_sha256(keep_key_id=False))
            elif how == "a keyed chain re-forged as legacy, with a seal":
                rewrite(
                    raw, c, edited_at(events, 2), with_sha256(keep_key_id=False),
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
                    raw,
                    a,
                    edited_at(events, 2),
                    lambda e: (journal.event_hash(**linked_fields(e)), e["key_id"]),
                    from_seq=2,
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
