"""`keel audit archive` (agents/audit/archive.py) against a real S3-compatible server (moto), and `keel audit verify`
once early events are archived.

The shared server's clock cannot move, so no month of a test database here is over: the checks take an id range, and
an archive is simulated — the sealed record made by the archive's own code inserted as a superuser, the archived rows
then deleted with every trigger off — which is exactly what verify sees after a real archive. The real detach and
drop, months apart: test_audit_archive_months.py (a private server whose clock the test moves)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from agents.audit.archive import (
    Archivable,
    ArchiveRefused,
    Partition,
    archive_partition,
    check_archivable,
    choose_partition,
    insert_record_txn,
    sealed_record,
)
from agents.audit.compare import verify_against
from agents.audit.ship import ship
from agents.audit.store import S3Store
from agents.client import Client
from agents.core import journal
from agents.core.commands import Command
from agents.core.phases import Event
from agents.core.transition import transition
from models.audit_destination import parse_store_url
from models.db import Database
from models.urls import libpq_url
from tests.support.cli import run_keel
from tests.support.roles import RoledDatabase
from tests.support.s3 import AWS_ENV, KEYS, KEYS_ENV, MotoS3, moto_s3

pytestmark = pytest.mark.integration

KEEL = str(Path(sys.executable).parent / "keel")
ASK = {"prompt": "What changed?", "script": [{"content": "Nothing.", "cost": "0.5"}]}


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoS3]:
    yield from moto_s3()


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in AWS_ENV.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def bucket(s3: MotoS3) -> str:
    return s3.bucket()


@pytest.fixture
def store(s3: MotoS3, bucket: str) -> S3Store:
    return S3Store(parse_store_url(f"s3://{bucket}/keel"), client=s3.client())


def destination(bucket: str) -> str:
    return f"s3://{bucket}/keel"


def history(client: Client) -> dict[str, Any]:
    """An agent whose every event comes early ('early'), then agents with events before and after the cut."""
    early = client.create_agent(f"early-{uuid.uuid4().hex[:6]}")
    client.submit(early.id, f"r-{early.id}", ASK)
    made = [client.create_agent(f"busy-{uuid.uuid4().hex[:6]}") for _ in range(3)]
    for agent in made:
        client.submit(agent.id, f"r-{agent.id}", ASK)
    for agent in made:
        transition(client.db, Command(agent.id, Event.PLAN, "worker", details={"model": "m"}))
    return {"early": early.id, "busy": [a.id for a in made]}


def later(client: Client, agents: list[Any]) -> None:
    for agent_id in agents:
        transition(client.db, Command(agent_id, Event.FINISH, "worker"))


def ship_all(db: Database, store: S3Store, bucket: str) -> None:
    ship(
        db,
        store,
        KEYS,
        destination=destination(bucket),
        segment_events=4,
        segment_age=timedelta(minutes=10),
        flush=True,
    )


def ids(raw: psycopg.Connection[Any]) -> list[int]:
    return [int(r[0]) for r in raw.execute("SELECT id FROM audit.journal ORDER BY id")]


def prove(db_url: str, store: S3Store, bucket: str, first_id: int, last_id: int) -> Archivable:
    with psycopg.connect(libpq_url(db_url)) as conn:
        row = conn.execute("SELECT count(*) FROM audit.journal WHERE id BETWEEN %s AND %s", (first_id, last_id))
        count = int(row.fetchone()[0])  # type: ignore[index]
        try:
            return check_archivable(
                conn,
                store,
                KEYS,
                what="ids under test",
                destination=destination(bucket),
                first_id=first_id,
                last_id=last_id,
                events=count,
            )
        finally:
            conn.rollback()


def cut(client: Client, raw: psycopg.Connection[Any]) -> int:
    """The last id of the 'early' part: every event up to the first transition of the busy agents."""
    first_plan = raw.execute("SELECT min(id) FROM audit.journal WHERE event = 'plan'").fetchone()
    assert first_plan is not None
    return int(first_plan[0])


def simulate_archive(raw: psycopg.Connection[Any], proved: Archivable, *, partition: str = "journal_legacy") -> None:
    """What a real archive leaves: the sealed record made by the archive's code, and the rows gone."""
    now = datetime.now(UTC)
    record = sealed_record(
        KEYS,
        proved,
        partition=partition,
        from_at=None,
        to_at=now,
        archived_by="test",
        archived_at=now,
    )
    insert_record_txn(raw, record)
    raw.execute("SET session_replication_role = replica")  # every trigger off, the append-only ones included
    try:
        raw.execute("DELETE FROM audit.journal WHERE id BETWEEN %s AND %s", (proved.first_id, proved.last_id))
    finally:
        raw.execute("RESET session_replication_role")


def nothing_archived(raw: psycopg.Connection[Any], before: list[int]) -> None:
    assert raw.execute("SELECT count(*) FROM audit.archived_partitions").fetchone() == (0,)
    assert ids(raw) == before


# --- check_archivable ---------------------------------------------------------------------------------------------


def test_a_range_every_event_of_which_is_shipped_is_archivable(
    client: Client, db: Database, db_url: str, raw: psycopg.Connection[Any], store: S3Store, bucket: str
) -> None:
    made = history(client)
    ship_all(db, store, bucket)
    upto = cut(client, raw)
    proved = prove(db_url, store, bucket, ids(raw)[0], upto)
    assert proved.events == len([i for i in ids(raw) if i <= upto])
    # Each agent's archived head is its last event in the range.
    with raw.cursor(row_factory=dict_row) as cur:
        cur.execute(
            "SELECT DISTINCT ON (agent_id) agent_id::text, seq, hash FROM audit.journal WHERE id <= %s"
            " ORDER BY agent_id, seq DESC",
            (upto,),
        )
        expected = {r["agent_id"]: (r["seq"], r["hash"]) for r in cur}
    assert {a: (h["last_seq"], h["hash"]) for a, h in proved.heads.items()} == expected
    assert proved.heads[str(made["early"])]["phase"] == "planning"  # the state its last transition left
    names = set(store.names())
    assert proved.manifests and all(m["manifest"] in names for m in proved.manifests)


def test_refused_while_events_are_not_shipped(
    client: Client, db: Database, db_url: str, raw: psycopg.Connection[Any], store: S3Store, bucket: str
) -> None:
    made = history(client)
    ship_all(db, store, bucket)
    later(client, made["busy"])  # three more events, not shipped
    before = ids(raw)
    with pytest.raises(ArchiveRefused) as refused:
        prove(db_url, store, bucket, before[0], before[-1])
    assert (
        f"ids under test: 3 events (ids {before[-3]}..{before[-1]}) are not in any shipped segment of"
        f" {destination(bucket)}; run 'keel audit ship'"
    ) == str(refused.value)
    nothing_archived(raw, before)


def test_refused_while_a_segment_is_missing(
    client: Client, db: Database, db_url: str, raw: psycopg.Connection[Any], store: S3Store, bucket: str, s3: MotoS3
) -> None:
    history(client)
    ship_all(db, store, bucket)
    bodies = sorted(k for k in s3.keys(bucket) if k.endswith(".jsonl"))
    s3.client().delete_object(Bucket=bucket, Key=bodies[1])  # the second segment's body
    before = ids(raw)
    with pytest.raises(ArchiveRefused, match=r"segment missing: journal/\S+\.jsonl \(its manifest is there, its body"):
        prove(db_url, store, bucket, before[0], before[-1])
    manifests = sorted(k for k in s3.keys(bucket) if k.endswith(".manifest.json"))
    s3.client().delete_object(Bucket=bucket, Key=manifests[1])  # and now its manifest too
    with pytest.raises(ArchiveRefused, match=r"segment missing: .* are not in the store"):
        prove(db_url, store, bucket, before[0], before[-1])
    nothing_archived(raw, before)


def test_refused_while_an_event_differs_from_its_shipped_line(
    client: Client, db: Database, db_url: str, raw: psycopg.Connection[Any], store: S3Store, bucket: str
) -> None:
    made = history(client)
    ship_all(db, store, bucket)
    victim = raw.execute(
        "SELECT id, seq FROM audit.journal WHERE agent_id = %s AND seq = 2", (made["early"],)
    ).fetchone()
    assert victim is not None
    raw.execute("SET session_replication_role = replica")
    raw.execute("UPDATE audit.journal SET actor = 'mallory' WHERE id = %s", (victim[0],))
    raw.execute("RESET session_replication_role")
    before = ids(raw)
    with pytest.raises(ArchiveRefused) as refused:
        prove(db_url, store, bucket, before[0], before[-1])
    text = str(refused.value)
    assert (
        "event 2 of agent 'early-" in text
        and f"(id {victim[0]}) differs from the shipped copy in segment journal/" in text
    )
    assert text.endswith(": actor")
    nothing_archived(raw, before)


def test_refused_while_a_manifest_is_tampered(
    client: Client, db: Database, db_url: str, raw: psycopg.Connection[Any], store: S3Store, bucket: str, s3: MotoS3
) -> None:
    history(client)
    ship_all(db, store, bucket)
    manifests = sorted(k for k in s3.keys(bucket) if k.endswith(".manifest.json"))
    body = s3.client().get_object(Bucket=bucket, Key=manifests[0])["Body"].read()
    data = json.loads(body)
    data["events"] += 0
    data["last_at"] = "2000-01-01T00:00:00.000000Z"  # any change the HMAC covers
    s3.client().put_object(Bucket=bucket, Key=manifests[0], Body=json.dumps(data).encode())
    before = ids(raw)
    with pytest.raises(ArchiveRefused, match=r"its HMAC \(key test-1\) does not match its content"):
        prove(db_url, store, bucket, before[0], before[-1])
    nothing_archived(raw, before)


# --- choosing the partition, and who may archive -------------------------------------------------------------------


def _month(year: int, month: int) -> datetime:
    return datetime(year, month, 1, tzinfo=UTC)


PARTS = [
    Partition("audit", "journal_legacy", None, _month(2027, 1)),
    Partition("audit", "journal_2027_01", _month(2027, 1), _month(2027, 2)),
]


def test_only_the_oldest_partition_whose_month_ended_past_the_grace_is_chosen() -> None:
    grace = timedelta(days=7)
    assert choose_partition(PARTS, None, now=_month(2027, 1) + timedelta(days=8), grace=grace) == PARTS[0]
    assert choose_partition(PARTS, "journal_legacy", now=_month(2027, 2), grace=grace) == PARTS[0]
    with pytest.raises(ArchiveRefused, match=r"less than 7 days ago \(KEEL_AUDIT_ARCHIVE_GRACE_DAYS\)"):
        choose_partition(PARTS, None, now=_month(2027, 1) + timedelta(days=6), grace=grace)
    with pytest.raises(ArchiveRefused, match=r"its month is not over \(it ends at 2027-01-01T00:00:00"):
        choose_partition(PARTS, None, now=_month(2026, 12) + timedelta(days=20), grace=grace)
    with pytest.raises(ArchiveRefused, match=r"journal_2027_01 is not the oldest attached \(journal_legacy is\)"):
        choose_partition(PARTS, "journal_2027_01", now=_month(2027, 3), grace=grace)
    with pytest.raises(ArchiveRefused, match=r"audit\.journal has no partition 'journal_1999_01'"):
        choose_partition(PARTS, "journal_1999_01", now=_month(2027, 3), grace=grace)
    with pytest.raises(ArchiveRefused, match="no partitions attached"):
        choose_partition([], None, now=_month(2027, 3), grace=grace)


def test_archive_is_refused_as_the_application_role_and_for_a_month_not_over(
    roles_db: RoledDatabase, store: S3Store, bucket: str
) -> None:
    with pytest.raises(ArchiveRefused) as refused:
        archive_partition(roles_db.app_url, store, KEYS, destination=destination(bucket), grace=timedelta(days=7))
    assert f"database role '{roles_db.names.app}' cannot detach partitions of audit.journal" in str(refused.value)
    # The test database's oldest partition is journal_legacy: everything before the month after its migration.
    with pytest.raises(ArchiveRefused, match=r"partition journal_legacy: its month is not over \(it ends at "):
        archive_partition(roles_db.url, store, KEYS, destination=destination(bucket), grace=timedelta(days=7))
    with psycopg.connect(libpq_url(roles_db.url)) as conn:
        assert conn.execute("SELECT count(*) FROM audit.archived_partitions").fetchone() == (0,)


def test_keel_audit_archive_refuses_by_name(roles_db: RoledDatabase, bucket: str, s3: MotoS3) -> None:
    as_app = keel(roles_db.app_url, "audit", "archive", "--against", destination(bucket), s3=s3)
    assert as_app.returncode == 1
    assert f"database role '{roles_db.names.app}' cannot detach partitions of audit.journal" in as_app.stderr
    not_over = keel(roles_db.url, "audit", "archive", "--against", destination(bucket), "--dry-run", s3=s3)
    assert not_over.returncode == 1 and "its month is not over" in not_over.stderr
    assert "Traceback" not in as_app.stderr + not_over.stderr


def test_archive_records_are_insert_only_and_the_application_cannot_write_one(roles_db: RoledDatabase) -> None:
    with psycopg.connect(libpq_url(roles_db.app_url)) as app:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            app.execute(
                "INSERT INTO audit.archived_partitions (partition, to_at, events, manifests, heads, archived_by,"
                " archived_at, key_id, seal) VALUES ('p', now(), 0, '[]', '{}', 'app', now(), 'k', 's')"
            )
    with psycopg.connect(libpq_url(roles_db.url), autocommit=True) as owner:
        owner.execute(
            "INSERT INTO audit.archived_partitions (partition, to_at, events, manifests, heads, archived_by,"
            " archived_at, key_id, seal) VALUES ('p', now(), 0, '[]', '{}', 'owner', now(), 'k', 's')"
        )
        for statement in (
            "UPDATE audit.archived_partitions SET seal = 't'",
            "DELETE FROM audit.archived_partitions",
            "TRUNCATE audit.archived_partitions",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="archived_partitions is insert-only"):
                owner.execute(statement)


# --- verify once early events are archived --------------------------------------------------------------------------


def keel(db_url: str, *args: str, s3: MotoS3 | None = None) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": "/usr/bin:/bin",
        "KEEL_DATABASE_URL": db_url,
        "KEEL_MIGRATION_DATABASE_URL": db_url,
        **KEYS_ENV,
        **AWS_ENV,
    }
    if s3 is not None:
        env["KEEL_AUDIT_S3_ENDPOINT_URL"] = s3.url
    return run_keel(args, env)


@pytest.fixture
def archived(
    client: Client, db: Database, db_url: str, raw: psycopg.Connection[Any], store: S3Store, bucket: str
) -> dict[str, Any]:
    """A journal whose early events (every 'early' one, the busy agents' first ones) were archived, then more
    events appended and shipped."""
    made = history(client)
    ship_all(db, store, bucket)
    upto = cut(client, raw)
    proved = prove(db_url, store, bucket, ids(raw)[0], upto)
    simulate_archive(raw, proved)
    later(client, made["busy"])
    ship_all(db, store, bucket)
    return {**made, "upto": upto, "proved": proved}


def test_verify_starts_each_chain_from_its_archived_head(
    archived: dict[str, Any],
    db: Database,
    db_url: str,
    raw: psycopg.Connection[Any],
    store: S3Store,
    bucket: str,
    s3: MotoS3,
) -> None:
    report = journal.verify(db)
    assert report.ok, (report.breaks, report.archive_problems)
    assert report.events == len(ids(raw))
    assert not raw.execute("SELECT 1 FROM audit.journal WHERE agent_id = %s", (archived["early"],)).fetchall()
    # An agent all of whose events are archived: its head is its archived head.
    assert journal.verify_chain(db, archived["early"]).ok
    against = verify_against(db, store, KEYS, destination=destination(bucket))
    assert against.ok, against.divergences
    said = keel(db_url, "audit", "verify")
    assert said.returncode == 0, said.stderr
    said = keel(db_url, "audit", "verify", "--against", destination(bucket), s3=s3)
    assert said.returncode == 0, said.stderr
    # The console's window stops at the archived head: nothing older to page to, and what it shows verifies.
    busy = archived["busy"][0]
    page = journal.journal_page(db, busy, before=None, limit=50)
    assert page is not None and page.broken is None and page.older is None
    assert page.first_seq == archived["proved"].heads[str(busy)]["last_seq"] + 1


def _tamper(raw: psycopg.Connection[Any], archived: dict[str, Any], how: str) -> None:
    raw.execute("SET session_replication_role = replica")
    busy = archived["busy"][0]
    if how == "the archive record altered":
        raw.execute(
            "UPDATE audit.archived_partitions SET heads = jsonb_set(heads, ARRAY[%s, 'last_seq'], '1')", (str(busy),)
        )
    elif how == "the archive record deleted":
        raw.execute("DELETE FROM audit.archived_partitions")
    elif how == "one more event deleted":
        raw.execute(
            "DELETE FROM audit.journal WHERE id = (SELECT min(id) FROM audit.journal WHERE agent_id = %s)", (busy,)
        )
    elif how == "an event inserted below the archived head":
        head = archived["proved"].heads[str(busy)]
        raw.execute(
            "INSERT INTO audit.journal (id, agent_id, seq, kind, event, actor, request_id, from_phase, to_phase,"
            " revision, decision, details, at, prev_hash, hash, key_id) SELECT nextval('audit.journal_id_seq'),"
            " agent_id, %s, kind, event, actor, request_id,"
            " from_phase, to_phase, revision, decision, details, at, prev_hash, hash, key_id FROM audit.journal"
            " WHERE agent_id = %s ORDER BY seq LIMIT 1",
            (head["last_seq"], busy),
        )
    else:
        raise AssertionError(how)
    raw.execute("RESET session_replication_role")


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("the archive record altered", "archive record journal_legacy does not match its seal under key 'test-1'"),
        ("the archive record deleted", "missing and no archive covers them"),
        ("one more event deleted", "event 4 is missing: the chain ends at event 3"),
        ("an event inserted below the archived head", "is at or below the head of the chain's archived part"),
    ],
)
def test_tampering_with_the_archived_part_is_caught(
    archived: dict[str, Any],
    db: Database,
    db_url: str,
    raw: psycopg.Connection[Any],
    store: S3Store,
    bucket: str,
    how: str,
    expected: str,
) -> None:
    _tamper(raw, archived, how)
    report = journal.verify(db)
    assert not report.ok
    said = [b.reason for b in report.breaks] + list(report.archive_problems)
    assert any(expected in text for text in said), said
    cli = keel(db_url, "audit", "verify")
    assert cli.returncode == 1 and expected in cli.stderr, cli.stderr
    if how != "an event inserted below the archived head":  # past the last shipped id: the store has no say
        assert not verify_against(db, store, KEYS, destination=destination(bucket)).ok


def test_verify_against_checks_each_archive_record_with_the_store(
    archived: dict[str, Any], db: Database, raw: psycopg.Connection[Any], store: S3Store, bucket: str
) -> None:
    """Even with the audit key, a record re-sealed with other manifests or heads does not pass against the store."""
    proved: Archivable = archived["proved"]
    early = str(archived["early"])
    forged = Archivable(
        proved.first_id,
        proved.last_id,
        proved.events - 1,
        [{"manifest": "journal/forged.manifest.json", "sha256": "0" * 64}, *proved.manifests[1:]],
        {**proved.heads, early: {**proved.heads[early], "hash": "f" * 64}},
    )
    raw.execute("SET session_replication_role = replica")
    raw.execute("DELETE FROM audit.archived_partitions")
    raw.execute("RESET session_replication_role")
    now = datetime.now(UTC)
    insert_record_txn(
        raw,
        sealed_record(
            KEYS, forged, partition="journal_legacy", from_at=None, to_at=now, archived_by="x", archived_at=now
        ),
    )
    report = verify_against(db, store, KEYS, destination=destination(bucket))
    texts = [d.text for d in report.divergences if d.kind == "archive"]
    assert any("journal/forged.manifest.json, which is not in the store" in t for t in texts), texts
    assert any(f"says {proved.events - 1} events" in t for t in texts), texts
    assert any(f"agent {early}'s archived head" in t for t in texts), texts
