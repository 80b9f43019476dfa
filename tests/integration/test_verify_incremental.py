"""`keel audit verify` incremental and chunked: each chain from its sealed checkpoint (audit_verified_chains), a chunk
of chains per short transaction; `--full` walks every chain from its start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from agents.audit.verify import verify_and_record
from agents.client import Client
from agents.core import journal
from agents.core.errors import StaleRevision
from models.audit_keys import AuditKeys
from models.audit_records import checkpoint_seal_parts
from models.db import Database
from models.settings import Settings
from models.urls import libpq_url
from tasks.leader import LeaderDuties
from tests.support.audit import TEST_ENV, TEST_KEY_ID, TEST_KEYS, as_superuser
from tests.support.cli import run_keel
from tests.support.roles import RoledDatabase

pytestmark = pytest.mark.integration
ASK = {"prompt": "What changed?", "script": [{"content": "Nothing.", "cost": "0.5"}]}
KEEL = str(Path(sys.executable).parent / "keel")


def _agents(client: Client, n: int) -> list[UUID]:
    """``n`` agents with a submit each (events 1-2), in agent id order: the order a verify's chunks take them."""
    ids = []
    for i in range(n):
        agent = client.create_agent(f"chain-{i}")
        client.submit(agent.id, f"r-{i}", ASK)
        ids.append(agent.id)
    return sorted(ids)


def _another_event(client: Client, agent_id: UUID) -> None:
    # A refused command is journaled and leaves the agent's state as it is: one more event on the chain.
    with pytest.raises(StaleRevision):
        client.cancel(agent_id, expected_revision=0, actor="late")


def _tamper(raw: psycopg.Connection[Any], sql: str, *params: Any) -> None:
    raw.execute("ALTER TABLE audit.journal DISABLE TRIGGER USER")
    raw.execute(sql, params)
    raw.execute("ALTER TABLE audit.journal ENABLE TRIGGER USER")


def _checkpoint(raw: psycopg.Connection[Any], agent_id: UUID) -> int | None:
    row = raw.execute("SELECT seq FROM audit_verified_chains WHERE agent_id = %s", (agent_id,)).fetchone()
    return None if row is None else int(row[0])


def test_an_incremental_pass_reads_only_new_events_and_catches_a_tampered_one(
    client: Client, db: Database, raw: psycopg.Connection[Any]
) -> None:
    a, b, c = _agents(client, 3)
    first = verify_and_record(db, "cli", full=False)
    assert first.ok and (first.full, first.read_events, first.events) == (False, 6, 6)
    assert [_checkpoint(raw, x) for x in (a, b, c)] == [2, 2, 2]
    again = verify_and_record(db, "cli", full=False)
    assert again.ok and (again.read_events, again.events, again.agents) == (0, 6, 3)

    _another_event(client, b)
    _another_event(client, b)
    _tamper(raw, "UPDATE audit.journal SET actor = 'mallory' WHERE agent_id = %s AND seq = 4", b)
    report = verify_and_record(db, "cli", full=False)
    assert not report.ok
    assert report.read_events == 2, "only the events past b's checkpoint were read"
    assert [(x.agent_id, x.seq) for x in report.breaks] == [(b, 4)]
    assert "content does not match its HMAC" in report.breaks[0].reason
    assert _checkpoint(raw, b) == 2, "a broken chain's checkpoint stays where it was intact"
    # Still caught the next time: the events past the checkpoint are read again.
    assert [(x.agent_id, x.seq) for x in verify_and_record(db, "cli", full=False).breaks] == [(b, 4)]


def test_an_edit_below_the_checkpoint_is_caught_by_the_full_pass_only(
    client: Client, db: Database, raw: psycopg.Connection[Any]
) -> None:
    a, _b = _agents(client, 2)
    _another_event(client, a)
    assert verify_and_record(db, "beat", full=False).ok
    _tamper(raw, "UPDATE audit.journal SET actor = 'mallory' WHERE agent_id = %s AND seq = 2", a)
    blind = verify_and_record(db, "beat", full=False)
    assert blind.ok and blind.read_events == 0, "docs/how-to/audit.md: incremental passes cannot see below checkpoints"
    assert (blind.trusted, blind.trusted_chains) == (5, 2), "and it says it trusted them, not that it checked them"
    full = verify_and_record(db, "beat", full=True)
    assert not full.ok and full.full and full.read_events == 4  # a read up to its break at event 2, b whole
    assert [(x.agent_id, x.seq) for x in full.breaks] == [(a, 2)]
    recorded = raw.execute("SELECT ok, details->>'mode' FROM audit_verifications ORDER BY id DESC LIMIT 1").fetchone()
    assert recorded == (False, "full")


def test_a_break_a_full_pass_found_is_reported_by_every_later_pass(
    client: Client, db: Database, raw: psycopg.Connection[Any]
) -> None:
    """Below a checkpoint only the full pass sees an edit; once it has, the incremental passes after it must not go
    back to reporting the chain clean from the checkpoint it had: the checkpoint is marked broken, for good."""
    a, b = _agents(client, 2)
    _another_event(client, a)
    assert verify_and_record(db, "beat", full=False).ok
    found = raw.execute("SELECT actor FROM audit.journal WHERE agent_id = %s AND seq = 2", (a,)).fetchone()
    assert found is not None
    _tamper(raw, "UPDATE audit.journal SET actor = 'mallory' WHERE agent_id = %s AND seq = 2", a)
    assert not verify_and_record(db, "beat", full=True).ok
    for _ in range(2):
        later = verify_and_record(db, "beat", full=False)
        assert not later.ok and not later.full
        assert [(x.agent_id, x.seq) for x in later.breaks] == [(a, 2)]
        assert "content does not match its HMAC" in later.breaks[0].reason
    # Put back as it was (say, from a backup): the chain walks intact, yet the mark stays until an operator clears it.
    _tamper(raw, "UPDATE audit.journal SET actor = %s WHERE agent_id = %s AND seq = 2", found[0], a)
    assert journal.verify_chain(db, a).ok
    held = verify_and_record(db, "beat", full=False)
    assert [(x.agent_id, x.seq) for x in held.breaks] == [(a, 2)]
    assert "an earlier keel audit verify found this chain broken at event 2" in held.breaks[0].reason
    assert _checkpoint(raw, b) == 2, "the other chain's checkpoint is as it was"
    raw.execute("DELETE FROM audit_verified_chains WHERE agent_id = %s", (a,))  # the runbook's resolution
    assert verify_and_record(db, "beat", full=False).ok
    assert _checkpoint(raw, a) == 3


def test_the_beats_incremental_pass_after_its_failed_full_one_still_fails(
    client: Client, db: Database, raw: psycopg.Connection[Any]
) -> None:
    """The leading beat's verify chore: its weekly full pass finds the edit, its hourly incremental ones keep
    failing (the audit_verify alert stays firing), not just the one full pass."""
    (a,) = _agents(client, 1)
    settings = Settings(audit_verify_interval_seconds=3600, audit_verify_full_interval_seconds=7 * 86400)
    duties = LeaderDuties(db, settings)
    assert verify_and_record(db, "beat", full=False).ok
    _tamper(raw, "UPDATE audit.journal SET actor = 'mallory' WHERE agent_id = %s AND seq = 1", a)
    recorded = []
    for _ in range(2):  # the first run claims the full chore, the second finds it not due: incremental
        duties._verify()
        recorded.append(
            raw.execute("SELECT ok, details->>'mode' FROM audit_verifications ORDER BY id DESC LIMIT 1").fetchone()
        )
    assert recorded == [(False, "full"), (False, "incremental")]


def test_a_chain_cut_back_behind_its_checkpoint_is_caught(
    client: Client, db: Database, raw: psycopg.Connection[Any]
) -> None:
    """A superuser removes the newest event and rewinds the agent's head onto the one before: no walk of the chain
    can tell (the shipped copy is for that), but the sealed checkpoint says the chain was longer."""
    (a,) = _agents(client, 1)
    _another_event(client, a)
    assert verify_and_record(db, "cli", full=False).ok
    as_superuser(
        raw,
        ("DELETE FROM audit.journal WHERE agent_id = %s AND seq = 3", (a,)),
        (
            "UPDATE agents SET journal_seq = 2, journal_head ="
            " (SELECT hash FROM audit.journal WHERE agent_id = %s AND seq = 2) WHERE id = %s",
            (a, a),
        ),
    )
    assert journal.verify_chain(db, a).ok, "the walk alone cannot see a cut with the head rewound"
    for full in (False, True):
        report = journal.verify(db, full=full)
        assert [(x.agent_id, x.seq) for x in report.breaks] == [(a, 2)]
        assert "verified up to event 3" in report.breaks[0].reason


def _forge_checkpoint(conn: psycopg.Connection[Any], agent_id: UUID, keys: AuditKeys | None) -> None:
    """Move the checkpoint of ``agent_id`` to its head, so an incremental pass would skip its events: sealed with
    ``keys`` (another secret under the same key id), or with no valid seal at all."""
    head = conn.execute(
        "SELECT journal_seq, journal_head, revision, phase, request_id FROM agents WHERE id = %s", (agent_id,)
    ).fetchone()
    assert head is not None
    fields: dict[str, Any] = {
        "agent_id": agent_id, "seq": head[0], "hash": head[1], "revision": head[2], "phase": head[3],
        "request_id": head[4], "keyed_at": 1, "deleted_at": 0, "legacy": 0,
    }  # fmt: skip
    seal = "0" * 64 if keys is None else keys.mac(TEST_KEY_ID, checkpoint_seal_parts(**fields))
    conn.execute(
        "UPDATE audit_verified_chains SET seq = %(seq)s, hash = %(hash)s, revision = %(revision)s, phase = %(phase)s,"
        " request_id = %(request_id)s, seal = %(seal)s WHERE agent_id = %(agent_id)s",
        fields | {"seal": seal},
    )


def test_a_checkpoint_forged_with_the_applications_credentials_is_reported_and_not_believed(
    roles_db: RoledDatabase,
) -> None:
    """keel_app may write audit_verified_chains (the beat does, as it): a row it makes without the audit key must
    not let a verify skip the events it claims were verified."""
    db = Database(roles_db.app_url, pool_size=2, audit_keys=TEST_KEYS)
    try:
        client = Client(db)
        (a,) = _agents(client, 1)
        assert verify_and_record(db, "beat", full=False).ok
        _another_event(client, a)
        with psycopg.connect(libpq_url(roles_db.app_url), autocommit=True) as app:
            _forge_checkpoint(app, a, None)
        with psycopg.connect(libpq_url(roles_db.url), autocommit=True) as su:
            _tamper(su, "UPDATE audit.journal SET actor = 'mallory' WHERE agent_id = %s AND seq = 3", a)
        report = verify_and_record(db, "beat", full=False)
        assert not report.ok
        assert len(report.checkpoint_problems) == 1
        assert "its seal does not match its content" in report.checkpoint_problems[0]
        assert report.read_events == 3, "the chain was walked from its start"
        assert [(x.agent_id, x.seq) for x in report.breaks] == [(a, 3)]
    finally:
        db.dispose()


def test_a_checkpoint_forged_by_a_superuser_without_the_key_is_reported_then_replaced(
    client: Client, db: Database, raw: psycopg.Connection[Any], db_url: str
) -> None:
    a, _b = _agents(client, 2)
    assert verify_and_record(db, "cli", full=False).ok
    _another_event(client, a)
    _forge_checkpoint(raw, a, AuditKeys.of({TEST_KEY_ID: "not-the-secret-but-long-enough-0123456789"}, TEST_KEY_ID))
    said = run_keel(["audit", "verify"], _env(db_url))
    assert said.returncode == 1
    assert f"FORGED checkpoint: the checkpoint of agent {a}'s chain" in said.stderr, said.stderr
    # The genuine walk replaced it: believed again, and the next pass is clean.
    assert _checkpoint(raw, a) == 3
    again = verify_and_record(db, "cli", full=False)
    assert again.ok and again.read_events == 0


def test_chunks_are_short_transactions(client: Client, db: Database, raw: psycopg.Connection[Any]) -> None:
    """Each chunk has a transaction and a snapshot of its own: a commit made while one chunk is read is visible to
    the next (one long snapshot, as before, would never see it) and each chunk's transaction starts anew."""
    _agents(client, 5)
    seen: list[tuple[Any, Any, bool]] = []
    committed: list[int] = []

    def on_chunk(conn: psycopg.Connection[Any]) -> None:
        pid = conn.info.backend_pid
        row = raw.execute("SELECT backend_xmin, xact_start FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
        assert row is not None
        visible = False
        if committed:
            found = conn.execute(
                "SELECT pg_visible_in_snapshot(%s::text::xid8, pg_current_snapshot())", (committed[-1],)
            ).fetchone()
            visible = found is not None and bool(found[0])
        seen.append((row[0], row[1], visible))
        # A transaction committed while this chunk's snapshot is held: the next chunk must see it.
        xid = raw.execute("SELECT pg_current_xact_id()::text").fetchone()
        assert xid is not None
        committed.append(int(xid[0]))

    report = journal.verify(db, full=True, chunk_chains=2, on_chunk=on_chunk)
    assert report.ok and report.agents == 5
    assert len(seen) == 3, "5 chains, 2 per chunk"
    assert all(xmin is not None for xmin, _, _ in seen), "each chunk reads in a snapshot of its own"
    assert [visible for _, _, visible in seen] == [False, True, True]
    starts = [start for _, start, _ in seen]
    assert starts == sorted(starts) and len(set(starts)) == 3, "a transaction per chunk"


def test_long_chains_make_short_chunks_and_no_chain_is_skipped_at_their_ends(
    client: Client, db: Database, raw: psycopg.Connection[Any]
) -> None:
    """A chunk ends at the chain that would take its reads past ``chunk_events`` (a longer chain alone): a snapshot
    is bounded by the events it reads, not only by its chains. Every chain is still walked once, and an edit in the
    chain that starts a chunk is found."""
    ids = _agents(client, 6)  # 2 events each
    for _ in range(4):
        _another_event(client, ids[1])  # 6 events
    for _ in range(8):
        _another_event(client, ids[4])  # 10 events
    chunks: list[int] = []
    report = journal.verify(db, full=True, chunk_chains=100, chunk_events=5, on_chunk=lambda conn: chunks.append(1))
    assert report.ok and (report.agents, report.events, report.read_events) == (6, 24, 24)
    # [2] | [6] | [2, 2] | [10] | [2]: each ends before the chain that would pass 5 events, or at a longer one.
    assert len(chunks) == 5
    _tamper(raw, "UPDATE audit.journal SET actor = 'mallory' WHERE agent_id = %s AND seq = 5", ids[4])
    broken = journal.verify(db, full=True, chunk_chains=100, chunk_events=5)
    assert [(b.agent_id, b.seq) for b in broken.breaks] == [(ids[4], 5)] and broken.agents == 6
    # Incremental, from checkpoints: only what is new counts towards a chunk.
    assert verify_and_record(db, "cli", full=False, chunk_events=5).breaks  # the tampered chain keeps failing
    _tamper(raw, "UPDATE audit.journal SET actor = 'late' WHERE agent_id = %s AND seq = 5", ids[4])
    raw.execute("DELETE FROM audit_verified_chains WHERE agent_id = %s", (ids[4],))  # looked at: the mark cleared
    assert verify_and_record(db, "cli", full=False, chunk_events=5).ok
    chunks.clear()
    again = journal.verify(db, full=False, chunk_chains=100, chunk_events=5, on_chunk=lambda conn: chunks.append(1))
    assert again.ok and again.read_events == 0 and len(chunks) == 1, "nothing new: one chunk for every chain"


def _env(db_url: str, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "OTEL_"))}
    return env | TEST_ENV | {"KEEL_DATABASE_URL": db_url} | more


def test_a_verify_killed_midway_records_nothing_false_and_the_next_one_resumes(
    client: Client, db: Database, raw: psycopg.Connection[Any], db_url: str
) -> None:
    ids = _agents(client, 6)
    assert verify_and_record(db, "cli", full=False).ok
    for agent_id in ids:
        _another_event(client, agent_id)
    recorded = raw.execute("SELECT count(*) FROM audit_verifications").fetchone()
    # Hold chunk 2's checkpoint write (agents 3 and 4): the verify commits chunk 1, then waits there to be killed.
    with psycopg.connect(libpq_url(db_url)) as holder:
        holder.execute("SELECT 1 FROM audit_verified_chains WHERE agent_id = %s FOR UPDATE", (ids[2],))
        child = subprocess.Popen(
            [KEEL, "audit", "verify", "--incremental"],
            env=_env(db_url, KEEL_AUDIT_VERIFY_CHUNK_CHAINS="2"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                waiting = raw.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO audit_verified_chains%%'"
                ).fetchone()
                if waiting is not None and waiting[0]:
                    break
                assert child.poll() is None, "the verify ended before it reached chunk 2"
                time.sleep(0.05)
            else:
                pytest.fail("the verify never reached chunk 2's checkpoint write")
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
        holder.rollback()
    assert raw.execute("SELECT count(*) FROM audit_verifications").fetchone() == recorded, "no outcome recorded"
    assert [_checkpoint(raw, x) for x in ids] == [3, 3, 2, 2, 2, 2], "chunk 1 committed, nothing after it"

    _tamper(raw, "UPDATE audit.journal SET actor = 'mallory' WHERE agent_id = %s AND seq = 3", ids[4])
    resumed = verify_and_record(db, "cli", full=False, chunk_chains=2)
    assert resumed.read_events == 4, "only the chains the killed pass did not finish were read"
    assert [(x.agent_id, x.seq) for x in resumed.breaks] == [(ids[4], 3)]
    assert [_checkpoint(raw, x) for x in ids] == [3, 3, 3, 3, 2, 3]
