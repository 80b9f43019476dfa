"""Comparing the journal with its shipped copy (`keel audit verify --against`), against a real S3-compatible
server and a local directory: each change made after shipping named (edited, removed, inserted, re-linked,
re-forged events; a missing segment; a forged manifest), signed manifests checked with the public key alone, and
an empty store that should not be."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from agents.audit.compare import verify_against
from agents.audit.segments import segment_name
from agents.audit.store import FileStore
from agents.client import Client
from models.db import Database
from tests.support.cli import run_keel
from tests.support.roles import RoledDatabase
from tests.support.s3 import AWS_ENV, KEYS, MotoS3, moto_s3
from tests.support.shipping import history, journal_ids, keel, ship_all, store_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoS3]:
    yield from moto_s3()


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in AWS_ENV.items():
        monkeypatch.setenv(name, value)


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
        return run_keel(["audit", "verify", "--against", url, *args], child | outsider)

    fine = verify("--public-key", str(public))
    assert fine.returncode == 0, fine.stderr
    wrong = verify("--public-key", str(stranger))
    assert wrong.returncode == 1 and "its Ed25519 signature does not verify with the public key" in wrong.stderr
    unvouched = verify()
    assert unvouched.returncode == 1
    assert "keyed with audit key 'test-1', which is not in the key ring" in unvouched.stderr, unvouched.stderr


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
