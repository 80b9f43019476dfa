"""Shipping the journal to a separate store (`keel audit ship`), against a real S3-compatible server (moto's server
mode, in this process) with faults injected by a proxy in front of it, and against a local directory: every event
shipped exactly once, through faults, crashes and transactions still open. Comparing the two is
test_audit_ship_against.py."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from agents.audit.compare import verify_against
from agents.audit.segments import ShipError, manifest_name, segment_name
from agents.audit.ship import ShipperBusy, ship
from agents.audit.store import FileStore, SegmentConflict, StoreError
from agents.client import Client
from models.audit_destination import StoreUrl, parse_store_url
from models.db import Database
from models.settings import Settings
from models.urls import libpq_url
from tasks.leader import LeaderDuties
from tests.support.http_proxy import FaultyProxy
from tests.support.roles import RoledDatabase
from tests.support.s3 import AWS_ENV, KEYS, KEYS_ENV, RING, MotoS3, moto_s3
from tests.support.shipping import KEEL, assert_shipped_once, history, journal_ids, keel, ship_all, store_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoS3]:
    yield from moto_s3()


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in AWS_ENV.items():
        monkeypatch.setenv(name, value)


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
