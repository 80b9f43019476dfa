"""Shipping the journal to a separate store (`keel audit ship`) and comparing the two (`keel audit verify --against`),
against a real S3-compatible server (moto's server mode, in this process) with faults injected by a proxy in front
of it, and against a local directory."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from agents.audit.ship import (
    ShipError,
    ShipperBusy,
    manifest_name,
    segment_name,
    ship,
    verify_against,
)
from agents.audit.store import FileStore, S3Store, SegmentConflict, StoreError
from agents.client import Client
from agents.core.commands import Command
from agents.core.phases import Event
from agents.core.transition import transition
from models.audit_destination import StoreUrl, parse_store_url
from models.db import Database
from models.settings import Settings
from models.urls import libpq_url
from tasks.leader import LeaderDuties
from tests.support.http_proxy import FaultyProxy
from tests.support.roles import RoledDatabase
from tests.support.s3 import AWS_ENV, KEYS, KEYS_ENV, RING, MotoS3, moto_s3

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


def history(client: Client, agents: int = 4) -> None:
    """A few agents with a handful of events each, interleaved."""
    made = [client.create_agent(f"shipped-{uuid.uuid4().hex[:8]}") for _ in range(agents)]
    for agent in made:
        client.submit(agent.id, f"r-{agent.id}", ASK)
    for agent in made:
        transition(client.db, Command(agent.id, Event.PLAN, "worker", details={"model": "m"}))
    for agent in made[::2]:
        transition(client.db, Command(agent.id, Event.FINISH, "worker"))


def journal_ids(raw: psycopg.Connection[Any]) -> list[int]:
    return [r[0] for r in raw.execute("SELECT id FROM audit.journal ORDER BY id")]


def store_for(s3: MotoS3, bucket: str, *, endpoint: str | None = None, **kwargs: Any) -> S3Store:
    return S3Store(
        parse_store_url(f"s3://{bucket}/keel"),
        client=s3.client(
            endpoint, retries={"mode": "standard", "total_max_attempts": 3}, read_timeout=2, connect_timeout=2
        ),
        **kwargs,
    )


def ship_all(db: Database, store: Any, destination: str, **kwargs: Any) -> Any:
    kwargs.setdefault("segment_events", 5)
    return ship(db, store, KEYS, destination=destination, segment_age=timedelta(minutes=10), flush=True, **kwargs)


def shipped_ids(store: Any) -> list[int]:
    """Every event id in every segment body of the store, in order, duplicates kept; each body has its manifest."""
    names = list(store.names())
    bodies = [n for n in names if n.endswith(".jsonl")]
    assert sorted(n for n in names if n.endswith(".manifest.json")) == sorted(
        n.removesuffix(".jsonl") + ".manifest.json" for n in bodies
    )
    ids: list[int] = []
    for name in sorted(bodies):
        ids += [json.loads(line)["id"] for line in store.get(name).decode().splitlines()]
    return ids


def assert_shipped_once(store: Any, raw: psycopg.Connection[Any]) -> None:
    ids = shipped_ids(store)
    assert ids == journal_ids(raw)  # every event, once, in id order
    assert len(set(ids)) == len(ids)


# --- shipping ------------------------------------------------------------------------------------------------------


def test_ship_seals_segments_with_keyed_chained_manifests(
    client: Client, db: Database, raw: psycopg.Connection[Any], s3: MotoS3
) -> None:
    history(client)
    bucket = s3.bucket()
    store = store_for(s3, bucket)
    report = ship_all(db, store, f"s3://{bucket}/keel")
    ids = journal_ids(raw)
    assert [s.events for s in report.segments] == [5] * (len(ids) // 5) + ([len(ids) % 5] if len(ids) % 5 else [])
    assert all(k.startswith("keel/journal/") for k in s3.keys(bucket))
    assert_shipped_once(store, raw)
    manifests = [json.loads(store.get(s.manifest)) for s in report.segments]
    assert manifests[0]["previous"] is None and manifests[0]["after_id"] == 0
    for before, after in itertools.pairwise(manifests):
        assert after["after_id"] == before["last_id"]
        assert after["previous"]["manifest"] == manifest_name(before["first_id"], before["last_id"])
    assert {m["key_id"] for m in manifests} == {"test-1"}
    assert verify_against(db, store, KEYS, destination=f"s3://{bucket}/keel").ok
    # Nothing new: nothing shipped, nothing rewritten.
    again = ship_all(db, store, f"s3://{bucket}/keel")
    assert again.segments == () and again.last_id == ids[-1]
    rows = raw.execute("SELECT first_id, last_id FROM audit_shipments ORDER BY last_id").fetchall()
    assert [(r[0], r[1]) for r in rows] == [(s.first_id, s.last_id) for s in report.segments]


def test_a_segment_closes_at_n_events_or_when_its_oldest_is_old_enough(
    client: Client, db: Database, raw: psycopg.Connection[Any], tmp_path: Path
) -> None:
    history(client, agents=1)
    count = len(journal_ids(raw))
    store = FileStore(tmp_path)
    kwargs: dict[str, Any] = {"destination": "file:///x", "segment_events": count + 1}
    young = ship(db, store, KEYS, segment_age=timedelta(minutes=10), **kwargs)
    assert young.segments == () and young.waiting == count  # not full, not old: it waits
    old = ship(db, store, KEYS, segment_age=timedelta(microseconds=1), **kwargs)
    assert [s.events for s in old.segments] == [count]


def test_faults_on_the_way_ship_every_event_exactly_once(
    client: Client, db: Database, raw: psycopg.Connection[Any], s3: MotoS3
) -> None:
    history(client, agents=6)
    bucket = s3.bucket()
    with FaultyProxy(s3.url) as proxy:
        store = store_for(s3, bucket, endpoint=proxy.url)
        ids = journal_ids(raw)
        first = segment_name(ids[0], ids[4])
        second = segment_name(ids[5], ids[9])
        # A 500 and a 503 (retried by the client), a write applied whose answer is lost, and one that times out
        # after the server applied it: the retries find the object there, identical.
        proxy.fail("PUT", f"/{bucket}/keel/{first}", "500", "503")
        proxy.fail("PUT", f"/{bucket}/keel/{first.removesuffix('.jsonl')}.manifest.json", "lose")
        proxy.fail("PUT", f"/{bucket}/keel/{second}", "stall")
        report = ship_all(db, store, f"s3://{bucket}/keel")
        assert proxy.pending_faults() == 0
        assert report.segments[0].segment == first
        assert "200 lost" in proxy.outcomes("PUT", f"/{bucket}/keel/{first.removesuffix('.jsonl')}.manifest.json")
        # More 5xx than the client retries: this run fails, naming the store; the next one resumes.
        history(client, agents=3)
        proxy.fail("PUT", f"/{bucket}/keel/journal/", "503", "503", "503")
        with pytest.raises(StoreError, match=f"s3://{bucket}/keel/"):
            ship_all(db, store, f"s3://{bucket}/keel")
        ship_all(db, store, f"s3://{bucket}/keel")
    direct = store_for(s3, bucket)
    assert_shipped_once(direct, raw)
    assert verify_against(db, direct, KEYS, destination=f"s3://{bucket}/keel").ok


def test_a_shipper_stopped_between_body_and_manifest_resumes_without_duplicates(
    client: Client, db: Database, raw: psycopg.Connection[Any], tmp_path: Path
) -> None:
    history(client)
    store = FileStore(tmp_path)

    def crash(name: str) -> None:
        if name.endswith(f"{journal_ids(raw)[9]:020d}.jsonl"):
            raise KeyboardInterrupt  # as a process dies: nothing after this runs

    with pytest.raises(KeyboardInterrupt):
        ship_all(db, store, "file:///x", after_body=crash)
    ids = journal_ids(raw)
    assert (
        not (tmp_path / manifest_name(ids[5], ids[9])).exists() and (tmp_path / segment_name(ids[5], ids[9])).exists()
    )
    history(client, agents=2)  # more events meanwhile: the half-shipped segment keeps its ids
    report = ship_all(db, store, "file:///x")
    assert report.segments[0].segment == segment_name(ids[5], ids[9]) and report.segments[0].resumed
    assert_shipped_once(store, raw)
    assert verify_against(db, store, KEYS, destination="file:///x").ok


def test_a_shipped_segment_is_never_rewritten(
    client: Client, db: Database, raw: psycopg.Connection[Any], tmp_path: Path
) -> None:
    history(client, agents=2)
    ids = journal_ids(raw)
    store = FileStore(tmp_path)
    # Another body already sits where the next segment goes (not the journal's events): shipping refuses, names it.
    (tmp_path / "journal").mkdir()
    impostor = tmp_path / segment_name(ids[0], ids[4])
    impostor.write_bytes(b'{"id": 1}\n')
    with pytest.raises(SegmentConflict, match=segment_name(ids[0], ids[4])):
        ship_all(db, store, "file:///x")
    assert impostor.read_bytes() == b'{"id": 1}\n'
    assert raw.execute("SELECT count(*) FROM audit_shipments").fetchone() == (0,)


def test_one_shipper_at_a_time(client: Client, db: Database, tmp_path: Path) -> None:
    history(client, agents=1)
    store = FileStore(tmp_path)
    inner: list[BaseException] = []

    def second_shipper(name: str) -> None:
        try:
            ship_all(db, store, "file:///x")
        except ShipperBusy as exc:
            inner.append(exc)

    ship_all(db, store, "file:///x", after_body=second_shipper, max_segments=1)
    assert inner and "another shipper" in str(inner[0])


def test_object_lock_retention_headers(client: Client, db: Database, s3: MotoS3) -> None:
    history(client, agents=1)
    bucket = s3.bucket(object_lock=True)
    until = datetime.now(UTC).replace(microsecond=0) + timedelta(days=30)
    store = store_for(s3, bucket, lock_days=30, lock_mode="COMPLIANCE", retain_until=lambda days: until)
    report = ship_all(db, store, f"s3://{bucket}/keel")
    head = s3.client().head_object(Bucket=bucket, Key=f"keel/{report.segments[0].segment}")
    assert head["ObjectLockMode"] == "COMPLIANCE"
    assert head["ObjectLockRetainUntilDate"] == until
    # A locked object cannot be deleted before its date.
    versions = s3.client().list_object_versions(Bucket=bucket, Prefix=f"keel/{report.segments[0].segment}")
    with pytest.raises(Exception, match=r"AccessDenied|locked|Lock"):
        s3.client().delete_object(
            Bucket=bucket, Key=f"keel/{report.segments[0].segment}", VersionId=versions["Versions"][0]["VersionId"]
        )


def test_the_leading_beat_ships_on_its_interval(
    client: Client, db: Database, raw: psycopg.Connection[Any], tmp_path: Path
) -> None:
    history(client, agents=2)
    settings = Settings(
        audit_ship_url=f"file://{tmp_path}",
        audit_ship_interval_seconds=3600,
        audit_segment_events=4,
        audit_segment_minutes=0.0001,
        audit_verify_interval_seconds=0,
        audit_keys=RING,  # type: ignore[arg-type]
        audit_key_id="test-1",
    )
    duties = LeaderDuties(db, settings, name="test-beat")
    duties.tick(1)
    assert duties._shipping is not None
    duties._shipping.join(timeout=60)
    assert_shipped_once(FileStore(tmp_path), raw)
    assert raw.execute("SELECT count(*) FROM beat_chores WHERE name = 'audit_ship'").fetchone() == (1,)


# --- tampering after shipping --------------------------------------------------------------------------------------


def _legacy_hash(prev: str, row: dict[str, Any]) -> str:
    """A fresh unkeyed sha256 link, as someone without the audit key would compute one."""
    fields = [prev, str(row["agent_id"]), row["seq"], row["kind"], row["event"], row["actor"], row["request_id"]]
    return hashlib.sha256(json.dumps([*fields, row["details"], str(row["at"])]).encode()).hexdigest()


def _tamper(raw: psycopg.Connection[Any], how: str) -> str:
    """Tamper with the journal as a superuser; what verify --against must say (a pattern)."""
    raw.execute("SET session_replication_role = replica")  # every trigger off, append-only ones included
    victim = raw.execute("SELECT id, agent_id FROM audit.journal WHERE seq = 2 ORDER BY id LIMIT 1").fetchone()
    assert victim is not None
    jid, agent = victim
    if how == "edit":
        raw.execute("UPDATE audit.journal SET actor = 'mallory' WHERE id = %s", (jid,))
        return rf"\(changed\): journal id {jid} \(agent {agent} event 2\) was changed after it was shipped .*: actor"
    if how == "delete":
        raw.execute("DELETE FROM audit.journal WHERE id = %s", (jid,))
        return rf"\(removed\): journal id {jid} \(agent {agent} event 2\) was removed from the database"
    if how == "insert":
        # An id that was taken and never committed, inside the shipped range: a backdated event fits there.
        raw.execute(
            "INSERT INTO audit.journal (id, agent_id, seq, kind, event, actor, request_id, from_phase, to_phase,"
            " revision, decision, details, at, prev_hash, hash) OVERRIDING SYSTEM VALUE"
            " SELECT 3, agent_id, 99, kind, event, 'mallory', request_id, from_phase, to_phase, revision, decision,"
            " details, at, prev_hash, hash FROM audit.journal WHERE id = %s",
            (jid,),
        )
        return r"\(inserted\): journal id 3 \(agent .* event 99\) was inserted into the database after"
    if how == "relink":
        # Only the event's link fields: its key id claimed by another key, its hash left as it was.
        raw.execute("UPDATE audit.journal SET key_id = 'mallory-1' WHERE id = %s", (jid,))
        return rf"\(changed\): journal id {jid} \(agent {agent} event 2\) was re-linked after it was shipped .*: key_id"
    assert how == "reforge"
    raw.execute("UPDATE audit.journal SET actor = 'mallory' WHERE id = %s", (jid,))
    prev = "0" * 64
    with raw.cursor(row_factory=psycopg.rows.dict_row) as cur:
        rows = cur.execute(
            "SELECT id, agent_id, seq, kind, event, actor, request_id, details::text AS details, at"
            " FROM audit.journal WHERE agent_id = %s ORDER BY seq",
            (agent,),
        ).fetchall()
    for row in rows:
        digest = _legacy_hash(prev, row)
        raw.execute("UPDATE audit.journal SET prev_hash = %s, hash = %s WHERE id = %s", (prev, digest, row["id"]))
        prev = digest
    raw.execute("UPDATE agents SET journal_head = %s WHERE id = %s", (prev, agent))
    return rf"\(reforged\): agent {agent}'s chain was re-forged: {len(rows)} event\(s\) from event 1"


def keel(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    child = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "OTEL_"))}
    return subprocess.run(
        [KEEL, *args], env=child | AWS_ENV | KEYS_ENV | env, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize("how", ["edit", "delete", "insert", "relink", "reforge"])
def test_verify_against_names_each_divergence(
    client: Client, db: Database, db_url: str, raw: psycopg.Connection[Any], s3: MotoS3, how: str
) -> None:
    raw.execute("SELECT nextval(pg_get_serial_sequence('audit.journal', 'id'))")  # id 1: taken, never committed
    raw.execute("SELECT nextval(pg_get_serial_sequence('audit.journal', 'id'))")
    raw.execute("SELECT nextval(pg_get_serial_sequence('audit.journal', 'id'))")  # ids 1-3 never used
    history(client)
    bucket = s3.bucket()
    env = {"KEEL_DATABASE_URL": db_url, "KEEL_AUDIT_S3_ENDPOINT_URL": s3.url, "KEEL_AUDIT_SEGMENT_EVENTS": "6"}
    shipped = keel("audit", "ship", "--flush", "--url", f"s3://{bucket}/j", env=env)
    assert shipped.returncode == 0, shipped.stderr
    assert "shipped journal/" in shipped.stdout
    fine = keel("audit", "verify", "--against", f"s3://{bucket}/j", env=env)
    assert fine.returncode == 0, fine.stderr
    assert fine.stdout.startswith("ok: ") and "match the journal" in fine.stdout
    expected = _tamper(raw, how)
    caught = keel("audit", "verify", "--against", f"s3://{bucket}/j", env=env)
    assert caught.returncode == 1
    assert re.search(expected, caught.stderr), caught.stderr


def test_verify_against_finds_a_missing_segment_and_a_forged_manifest(
    client: Client, db: Database, raw: psycopg.Connection[Any], s3: MotoS3
) -> None:
    history(client)
    bucket = s3.bucket()
    store = store_for(s3, bucket)
    report = ship_all(db, store, f"s3://{bucket}/keel")
    middle, last = report.segments[1], report.segments[-1]
    admin = s3.client()
    admin.delete_object(Bucket=bucket, Key=f"keel/{middle.segment}")
    admin.delete_object(Bucket=bucket, Key=f"keel/{middle.manifest}")
    forged = json.loads(store.get(last.manifest) or b"")
    forged["events"] = 1
    admin.put_object(Bucket=bucket, Key=f"keel/{last.manifest}", Body=json.dumps(forged).encode())
    result = verify_against(db, store, KEYS, destination=f"s3://{bucket}/keel")
    texts = [d.text for d in result.divergences]
    assert any(
        d.kind == "missing_segment" and f"ids {middle.first_id}..{middle.last_id} are not in the store" in d.text
        for d in result.divergences
    ), texts
    assert any(
        d.kind == "bad_manifest" and f"{last.manifest}: its HMAC (key test-1) does not match" in d.text
        for d in result.divergences
    ), texts
    # Taking the last segments away shows too: the database remembers how far shipping got.
    admin.delete_object(Bucket=bucket, Key=f"keel/{last.segment}")
    admin.delete_object(Bucket=bucket, Key=f"keel/{last.manifest}")
    result = verify_against(db, store, KEYS, destination=f"s3://{bucket}/keel")
    assert any(f"the database records {last.segment}" in d.text for d in result.divergences), result.divergences


@pytest.mark.parametrize("fault", ["hold", "stall"])
def test_a_shipper_killed_mid_segment_resumes_exactly_once(
    client: Client, db: Database, db_url: str, raw: psycopg.Connection[Any], s3: MotoS3, fault: str
) -> None:
    """SIGKILLed with its second segment's body in the store and that segment's manifest in flight: never sent on
    (``hold``: the body is there without its manifest), or sent and applied but not answered (``stall``)."""
    history(client)
    ids = journal_ids(raw)
    bucket = s3.bucket()
    held = f"/{bucket}/keel/{manifest_name(ids[5], ids[9])}"
    with FaultyProxy(s3.url) as proxy:
        proxy.fail("PUT", held, fault)
        env = {
            "KEEL_DATABASE_URL": db_url,
            "KEEL_AUDIT_S3_ENDPOINT_URL": proxy.url,
            "KEEL_AUDIT_SEGMENT_EVENTS": "5",
            "KEEL_AUDIT_SHIP_URL": f"s3://{bucket}/keel",
        }
        child = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "OTEL_"))}
        shipper = subprocess.Popen(
            [KEEL, "audit", "ship", "--flush"],
            env=child | AWS_ENV | KEYS_ENV | env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 60
            while not proxy.outcomes("PUT", held) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert proxy.outcomes("PUT", held), "the shipper never reached the second manifest"
        finally:
            shipper.send_signal(signal.SIGKILL)
            shipper.wait(timeout=30)
    body, manifest = segment_name(ids[5], ids[9]), manifest_name(ids[5], ids[9])
    assert f"keel/{body}" in s3.keys(bucket)
    assert (f"keel/{manifest}" in s3.keys(bucket)) == (fault == "stall")
    direct = {**env, "KEEL_AUDIT_S3_ENDPOINT_URL": s3.url}
    resumed = keel("audit", "ship", "--flush", env=direct)
    assert resumed.returncode == 0, resumed.stderr
    if fault == "hold":
        assert f"shipped {body}: 5 events, ids {ids[5]}..{ids[9]} (its body was already there" in resumed.stdout
    else:
        assert body not in resumed.stdout  # shipped already: the store says so
    store = store_for(s3, bucket)
    assert_shipped_once(store, raw)
    verified = keel("audit", "verify", "--against", f"s3://{bucket}/keel", env=direct)
    assert verified.returncode == 0, verified.stderr


def test_the_auditor_role_verifies_against_the_store_without_writing(roles_db: RoledDatabase, tmp_path: Path) -> None:
    app = Database(roles_db.app_url, audit_keys=KEYS)
    try:
        history(Client(app), agents=2)
    finally:
        app.dispose()
    url = f"file://{tmp_path}/store"
    shipped = keel("audit", "ship", "--flush", "--url", url, env={"KEEL_DATABASE_URL": roles_db.app_url})
    assert shipped.returncode == 0, shipped.stderr
    verified = keel("audit", "verify", "--against", url, env={"KEEL_DATABASE_URL": roles_db.auditor_url})
    assert verified.returncode == 0, verified.stderr
    assert verified.stdout.startswith("ok: ")
    # The auditor cannot ship (it may not write the shipper's progress).
    refused = keel("audit", "ship", "--flush", "--url", url, env={"KEEL_DATABASE_URL": roles_db.auditor_url})
    assert refused.returncode == 1 and "may not record shipments" in refused.stderr, refused.stderr


def test_bad_destinations_are_refused_by_name(db_url: str) -> None:
    for url, rule in [
        ("http://example.com/x", "ships to s3://bucket/prefix or file:///absolute/path"),
        ("s3://Bad_Bucket/x", "is not an S3 bucket name"),
        ("file://relative/path", "file:///absolute/path"),
    ]:
        result = keel("audit", "ship", "--url", url, env={"KEEL_DATABASE_URL": db_url})
        assert result.returncode == 1 and rule in result.stderr, result.stderr
    result = keel("audit", "ship", env={"KEEL_DATABASE_URL": db_url, "KEEL_AUDIT_SHIP_URL": "ftp://x"})
    assert result.returncode != 0 and "KEEL_AUDIT_SHIP_URL" in result.stderr, result.stderr
    result = keel("audit", "ship", env={"KEEL_DATABASE_URL": db_url})
    assert result.returncode == 1 and "set KEEL_AUDIT_SHIP_URL" in result.stderr


def test_store_url_parsing() -> None:
    assert parse_store_url("s3://bucket-1/a/b/") == StoreUrl("s3", "bucket-1", "a/b/", "s3://bucket-1/a/b/")
    assert parse_store_url("s3://bucket-1").prefix == ""
    assert parse_store_url("file:///var/keel").prefix == "/var/keel"
    with pytest.raises(ValueError, match="no credentials"):
        parse_store_url("s3://key:secret@bucket-1/x")


def test_ship_error_is_a_keel_error() -> None:
    assert issubclass(ShipError, Exception)


def test_an_id_taken_by_a_transaction_still_open_is_never_skipped(
    client: Client, db: Database, db_url: str, raw: psycopg.Connection[Any], tmp_path: Path
) -> None:
    history(client, agents=1)
    store = FileStore(tmp_path)
    with psycopg.connect(libpq_url(db_url)) as slow:  # a transaction that took a lower id and has not committed
        slow.execute(
            "INSERT INTO audit.journal (agent_id, seq, kind, event, actor, revision, decision, details, at, prev_hash,"
            " hash) SELECT agent_id, seq + 1, 'operator', 'note', 'slow', revision, 'allowed', '{}', now(), hash, %s"
            " FROM audit.journal ORDER BY id DESC LIMIT 1",
            ("1" * 64,),
        )
        # Its chain's head moves with it, in the same transaction (the journal's guards want that at commit).
        slow.execute(
            "UPDATE agents a SET journal_seq = j.seq, journal_head = j.hash FROM audit.journal j"
            " WHERE j.hash = %s AND a.id = j.agent_id",
            ("1" * 64,),
        )
        history(client, agents=1)  # later ids, committed first
        waiting = ship(
            db,
            store,
            KEYS,
            destination="file:///x",
            segment_events=1000,
            segment_age=timedelta(0),
            flush=True,
            settle_timeout=timedelta(milliseconds=200),
        )
        assert waiting.unsettled and waiting.segments == ()
        slow.commit()
    ship_all(db, store, "file:///x")
    assert_shipped_once(store, raw)


def test_keel_audit_ship_exits_75_when_an_open_transaction_holds_shipping_up(
    client: Client, db_url: str, tmp_path: Path
) -> None:
    """Nothing could be shipped (a transaction that took a journal id stays open past KEEL_AUDIT_SETTLE_SECONDS): a
    cron job or a script sees a non-zero status (EX_TEMPFAIL, try again later) and the reason on stderr, in text and
    --json alike; once the transaction ends, the same command ships and exits 0."""
    history(client, agents=1)
    url = f"file://{tmp_path}/store"
    env = {"KEEL_DATABASE_URL": db_url, "KEEL_AUDIT_SETTLE_SECONDS": "0.5"}
    with psycopg.connect(libpq_url(db_url)) as slow:
        slow.execute(
            "INSERT INTO audit.journal (agent_id, seq, kind, event, actor, revision, decision, details, at, prev_hash,"
            " hash) SELECT agent_id, seq + 1, 'operator', 'note', 'slow', revision, 'allowed', '{}', now(), hash, %s"
            " FROM audit.journal ORDER BY id DESC LIMIT 1",
            ("2" * 64,),
        )
        slow.execute(
            "UPDATE agents a SET journal_seq = j.seq, journal_head = j.hash FROM audit.journal j"
            " WHERE j.hash = %s AND a.id = j.agent_id",
            ("2" * 64,),
        )
        history(client, agents=1)  # later ids, committed first
        held = keel("audit", "ship", "--flush", "--url", url, env=env)
        assert held.returncode == 75, (held.returncode, held.stdout, held.stderr)
        assert "a transaction writing the journal is still open after 0.5s (KEEL_AUDIT_SETTLE_SECONDS)" in held.stderr
        assert not (tmp_path / "store" / "journal").exists() or not any((tmp_path / "store" / "journal").iterdir())
        as_json = keel("audit", "ship", "--flush", "--url", url, "--json", env=env)
        assert as_json.returncode == 75, as_json.stderr
        report = json.loads(as_json.stdout)
        assert report["unsettled"] is True and report["segments"] == []
        assert "a transaction writing the journal is still open" in as_json.stderr
        slow.commit()
    shipped = keel("audit", "ship", "--flush", "--url", url, env=env)
    assert shipped.returncode == 0, shipped.stderr
    assert "shipped journal/" in shipped.stdout


def test_signed_manifests_verify_with_the_public_key_alone(client: Client, db_url: str, tmp_path: Path) -> None:
    history(client, agents=2)
    signing = Ed25519PrivateKey.generate()
    pem = signing.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()).decode()
    public = tmp_path / "public.pem"
    public.write_bytes(signing.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo))
    stranger = tmp_path / "stranger.pem"
    stranger.write_bytes(
        Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    )
    url = f"file://{tmp_path}/store"
    env = {"KEEL_DATABASE_URL": db_url, "KEEL_AUDIT_SIGNING_KEY": pem, "KEEL_AUDIT_SEGMENT_EVENTS": "3"}
    shipped = keel("audit", "ship", "--flush", "--url", url, env=env)
    assert shipped.returncode == 0, shipped.stderr
    # Someone without the audit key ring (here: a ring that lacks the manifests' key) and with the public key.
    outsider = {"KEEL_DATABASE_URL": db_url, "KEEL_HOME": str(tmp_path / "home")}
    child = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "OTEL_"))}

    def verify(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [KEEL, "audit", "verify", "--against", url, *args],
            env=child | outsider,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    fine = verify("--public-key", str(public))
    assert fine.returncode == 0, fine.stderr
    wrong = verify("--public-key", str(stranger))
    assert wrong.returncode == 1 and "its Ed25519 signature does not verify with the public key" in wrong.stderr
    unvouched = verify()
    assert unvouched.returncode == 1
    assert "keyed with audit key 'test-1', which is not in the key ring" in unvouched.stderr, unvouched.stderr


# --- what the database records cannot be forged with its credentials alone ----------------------------------------


def test_shipment_rows_forged_with_the_applications_credentials_are_passed_over(
    roles_db: RoledDatabase, tmp_path: Path
) -> None:
    """keel_app may INSERT into audit_shipments (the shipper runs as it). Rows it inserts without the audit key —
    one claiming the rest of the journal shipped, one claiming a segment the store lacks — are passed over and
    named: the shipper still ships every event exactly once, and verify --against tells the forgery, not a missing
    segment."""
    app = Database(roles_db.app_url, audit_keys=KEYS)
    try:
        history(Client(app), agents=3)
        url = f"file://{tmp_path}/store"
        store = FileStore(tmp_path / "store")
        first = ship(
            app, store, KEYS, destination=url, segment_events=3, segment_age=timedelta(hours=1), max_segments=1
        )
        assert len(first.segments) == 1
    finally:
        app.dispose()
    with psycopg.connect(libpq_url(roles_db.url), autocommit=True) as raw:
        ids = journal_ids(raw)
        with psycopg.connect(libpq_url(roles_db.app_url), autocommit=True) as forger:
            for first_id, last_id in [(ids[3], ids[-1]), (ids[-1] + 100, ids[-1] + 200)]:
                forger.execute(
                    "INSERT INTO audit_shipments (destination, first_id, last_id, events, segment, manifest_sha256,"
                    " key_id, seal) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                    (
                        url,
                        first_id,
                        last_id,
                        last_id - first_id + 1,
                        segment_name(first_id, last_id),
                        "f" * 64,
                        "test-1",
                        "0" * 64,
                    ),
                )
        env = {"KEEL_DATABASE_URL": roles_db.app_url, "KEEL_AUDIT_SEGMENT_EVENTS": "3"}
        shipped = keel("audit", "ship", "--flush", "--url", url, env=env)
        assert shipped.returncode == 0, shipped.stderr
        for first_id, last_id in [(ids[3], ids[-1]), (ids[-1] + 100, ids[-1] + 200)]:
            assert (
                f"note: audit_shipments records {segment_name(first_id, last_id)} (ids {first_id}..{last_id}) as"
                f" shipped to {url}, but its seal does not match its content" in shipped.stderr
            ), shipped.stderr
        assert_shipped_once(store, raw)
        verified = keel("audit", "verify", "--against", url, env={**env, "KEEL_DATABASE_URL": roles_db.auditor_url})
        assert verified.returncode == 1
        assert "missing_segment" not in verified.stderr and "DIVERGED (changed" not in verified.stderr
        assert verified.stderr.count("DIVERGED (forged_record): audit_shipments records") == 2, verified.stderr


# --- the store's own end --------------------------------------------------------------------------------------------


def test_verify_against_names_events_removed_after_shipping_with_their_shipment_rows(
    client: Client, db: Database, db_url: str, raw: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """A superuser who removes the journal's last events and the audit_shipments rows that recorded them: the
    store's own manifests still reach to its end, and every event there that the database lacks is named."""
    history(client)
    url = f"file://{tmp_path}/store"
    report = ship_all(db, FileStore(tmp_path / "store"), url)
    last = report.segments[-1]
    raw.execute("SET session_replication_role = replica")
    raw.execute("DELETE FROM audit.journal WHERE id >= %s", (last.first_id,))
    raw.execute("DELETE FROM audit_shipments WHERE last_id >= %s", (last.first_id,))
    raw.execute("RESET session_replication_role")
    caught = keel("audit", "verify", "--against", url, env={"KEEL_DATABASE_URL": db_url})
    assert caught.returncode == 1
    removed = re.findall(r"DIVERGED \(removed\): journal id (\d+) .* was removed from the database", caught.stderr)
    assert [int(i) for i in removed] == list(range(last.first_id, last.last_id + 1)), caught.stderr


def test_verify_against_an_empty_store_is_not_ok(
    client: Client, db_url: str, raw: psycopg.Connection[Any], tmp_path: Path
) -> None:
    history(client)
    ids = journal_ids(raw)
    url = f"file://{tmp_path}/nothing-here"
    env = {"KEEL_DATABASE_URL": db_url, "KEEL_AUDIT_SEGMENT_EVENTS": "3"}
    empty = keel("audit", "verify", "--against", url, env=env)
    assert empty.returncode == 1, empty.stdout
    assert "ok:" not in empty.stdout
    assert (
        f"DIVERGED (missing_segment): the store at {url} holds no segments, but the journal holds {len(ids)} events"
        f" (ids {ids[0]}..{ids[-1]}) that should have been shipped: {segment_name(ids[0], ids[2])} onwards are"
        " missing" in empty.stderr
    ), empty.stderr
    # Fewer events than a segment, none old enough: nothing should have been shipped yet.
    young = keel("audit", "verify", "--against", url, env={**env, "KEEL_AUDIT_SEGMENT_EVENTS": "1000"})
    assert young.returncode == 0, young.stderr
    assert f"note: the store at {url} holds no segments yet: the journal's {len(ids)} events" in young.stderr
