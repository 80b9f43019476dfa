"""Deleting an agent: only an archived agent at rest, only through Keel, journaled; the journal stays verifiable."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import tempfile
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from agents.client import Client
from agents.core import journal
from agents.core.commands import Command, MessageSpec
from agents.core.errors import AgentInUse, AgentNotFound, InvalidInput, StaleRevision
from agents.core.phases import Event
from agents.core.policies import DEFAULT_RULES
from agents.core.transition import transition
from agents.jobs import schedules
from agents.jobs.handlers import JobResult, Registry, registry
from agents.jobs.runner import Runner
from agents.outbox.relay import Backoff, Relay, retry_dead
from agents.outbox.senders import SlackSender
from models import migrations
from models.db import Database
from models.kpi_sql import totals
from models.migrations import DowngradeRefused
from models.outbox_sql import message_row
from models.sql import lock_agent_txn
from tests.support.audit import TEST_KEYS, clean_env
from tests.support.cli import run_keel
from tests.support.fakes import FakeSlack
from tests.support.keys import scoped

pytestmark = pytest.mark.integration

PROMPT = {"prompt": "Summarise open incidents"}
KEEL = str(Path(sys.executable).parent / "keel")
registry.declare("finish_now")


def _retired(client: Client, name: str = "ops-bot") -> Any:
    """An agent with some history (a request that failed, a schedule), archived: ready to be deleted."""
    agent = client.create_agent(name)
    client.submit(agent.id, f"{name}-r1", PROMPT, actor="alice")
    client.cancel(agent.id, actor="alice", reason="wrong prompt")
    schedules.ensure_schedule(client.db, f"{name}-hourly", agent.id, every=timedelta(hours=1), input=PROMPT)
    client.archive(agent.id, actor="carol")
    return client.get_state(agent.id)


def _schedules(raw: psycopg.Connection[Any]) -> list[str]:
    return [r[0] for r in raw.execute("SELECT name FROM schedules ORDER BY name").fetchall()]


def test_a_deleted_agent_is_gone_its_name_free_and_its_journal_kept(
    client: Client, db: Database, raw: psycopg.Connection[Any]
) -> None:
    old = _retired(client)
    bystander = client.create_agent("bystander")
    figures = totals(db)
    seen = {old.id: client.journal(agent_id=old.id)[-1].seq}

    tombstone = client.delete_agent("ops-bot", actor="dave", reason="retired", expected_revision=old.revision)
    assert (tombstone.id, tombstone.name, tombstone.deleted_by, tombstone.phase) == (
        old.id,
        "ops-bot",
        "dave",
        "failed",
    )

    for ref in ("ops-bot", old.id, str(old.id)):
        with pytest.raises(AgentNotFound, match=r"agent 'ops-bot' was deleted at \d{4}-.*Z by dave \(id "):
            client.get_state(ref)
    with pytest.raises(AgentNotFound, match="was deleted"):
        client.submit(old.id, "r-after", PROMPT)
    assert [a.name for a in client.list_agents().agents] == ["bystander"]
    assert client.list_agents(archived=True).agents == ()
    assert _schedules(raw) == []

    events = client.journal(agent_id="ops-bot")
    last = events[-1]
    assert (last.kind, last.event, last.decision, last.actor) == ("operator", "delete", "deleted", "dave")
    assert last.details == {"reason": "retired", "name": "ops-bot", "schedules_removed": ["ops-bot-hourly"]}
    assert (last.seq, last.hash) == (tombstone.journal_seq, tombstone.journal_head)
    assert [e.seq for e in client.journal(agent_id=old.id)] == list(range(1, last.seq + 1))
    # A follower that had read up to the deletion gets the delete event, once.
    assert [(e.agent_id, e.event) for e in client.journal_after(seen, agent_id=old.id)] == [(old.id, "delete")]
    assert client.agent_names([old.id, bystander.id]) == {old.id: "ops-bot (deleted)", bystander.id: "bystander"}
    # Its request's story is kept: the request, its job, and the figures computed from them.
    assert [j.key for j in client.request_jobs(old.id, "ops-bot-r1")] == [scoped(old.id, "ops-bot-r1:plan:1")]
    assert totals(db) == figures

    new = client.create_agent("ops-bot")
    assert new.id != old.id
    assert [e.event for e in client.journal(agent_id="ops-bot")] == ["create"]  # the live one wins
    assert client.journal(agent_id=old.id)[-1].event == "delete"  # the deleted one, by its id
    # Request ids are each agent's own: the new ops-bot's "ops-bot-r1" is a fresh request of its own, and the
    # deleted agent's request of that id, and its story, stay as they were.
    fresh = client.submit(new.id, "ops-bot-r1", PROMPT)
    assert (fresh.phase, fresh.request_id) == ("planning", "ops-bot-r1")
    assert client.get_request(new.id, "ops-bot-r1").agent_id == new.id
    assert [j.key for j in client.request_jobs(new.id, "ops-bot-r1")] == [scoped(new.id, "ops-bot-r1:plan:1")]
    assert [j.key for j in client.request_jobs(old.id, "ops-bot-r1")] == [scoped(old.id, "ops-bot-r1:plan:1")]
    assert [j.status for j in client.request_jobs(old.id, "ops-bot-r1")] == ["cancelled"]
    assert client.journal(agent_id=old.id)[-1].event == "delete"
    client.cancel(new.id, actor="carol")  # at rest again, to be archived and deleted below

    report = journal.verify(db)
    assert report.ok, report.breaks
    assert report.agents == 3 and report.events == len(client.journal())

    client.archive(new.id, actor="carol")
    client.delete_agent(new.id, actor="dave")
    with pytest.raises(InvalidInput, match=rf"2 deleted agents were named 'ops-bot': give the id .*{new.id}.*{old.id}"):
        client.journal(agent_id="ops-bot")
    with pytest.raises(AgentNotFound, match="was deleted"):  # the most recent one
        client.get_state("ops-bot")
    assert journal.verify(db).ok


@pytest.mark.parametrize("case", ["not_archived", "busy", "stale_revision"])
def test_a_refused_delete_changes_nothing_but_is_journaled(
    client: Client, raw: psycopg.Connection[Any], case: str
) -> None:
    agent = client.create_agent("ops-bot")
    schedules.ensure_schedule(client.db, "hourly", agent.id, every=timedelta(hours=1), input=PROMPT)
    expected: int | None = None
    if case == "busy":
        client.submit(agent.id, "r1", PROMPT)
        error, match, decision = (
            AgentInUse,
            "agent 'ops-bot' is planning: only an archived agent at rest",
            "agent_in_use",
        )
    elif case == "not_archived":
        error, match, decision = AgentInUse, "agent 'ops-bot' is not archived: archive it first", "agent_in_use"
    else:
        client.archive(agent.id, actor="carol")
        expected = 7
        error, match, decision = (
            StaleRevision,
            "the command expected revision 7, the agent is at revision 0",
            ("stale_revision"),
        )
    before = client.get_state(agent.id)
    with pytest.raises(error, match=match):
        client.delete_agent("ops-bot", actor="dave", expected_revision=expected)
    assert client.get_state(agent.id) == before
    assert _schedules(raw) == ["hourly"]
    assert raw.execute("SELECT count(*) FROM audit.deleted_agents").fetchone() == (0,)
    last = client.journal(agent_id=agent.id)[-1]
    assert (last.kind, last.event, last.decision, last.actor) == ("rejected", "delete", decision, "dave")
    assert match in last.details["error"]
    assert journal.verify(client.db).ok


def _tamper(raw: psycopg.Connection[Any], *statements: tuple[str, tuple[Any, ...]]) -> None:
    # A superuser can switch the triggers off; the chain and the tombstone still tell.
    for table in ("audit.journal", "audit.deleted_agents"):
        raw.execute(f"ALTER TABLE {table} DISABLE TRIGGER USER")
    # With them off, the journal's guard draws no id (0017): the superuser takes one from the sequence.
    raw.execute("ALTER TABLE audit.journal ALTER COLUMN id SET DEFAULT nextval('audit.journal_id_seq')")
    for sql, params in statements:
        raw.execute(sql, params)
    raw.execute("ALTER TABLE audit.journal ALTER COLUMN id DROP DEFAULT")
    for table in ("audit.journal", "audit.deleted_agents"):
        raw.execute(f"ALTER TABLE {table} ENABLE TRIGGER USER")


def _forged_event_after(client: Client, agent_id: Any, at: datetime | None = None) -> tuple[str, tuple[Any, ...]]:
    """An event appended after the delete event, hashed onto it as Keel would have (at ``at``, else a second after
    the delete event)."""
    last = client.journal(agent_id=agent_id)[-1]
    fields: dict[str, Any] = {
        "agent_id": agent_id,
        "seq": last.seq + 1,
        "kind": "operator",
        "event": "unarchive",
        "actor": "mallory",
        "request_id": last.request_id,
        "from_phase": last.from_phase,
        "to_phase": last.to_phase,
        "revision": last.revision,
        "decision": "unarchived",
        "details_json": "{}",
        "at": at or last.at + timedelta(seconds=1),
    }
    digest = journal.event_hash(prev_hash=last.hash, **fields)
    return (
        "INSERT INTO audit.journal (agent_id, seq, kind, event, actor, request_id, from_phase, to_phase, revision,"
        " decision, details, at, prev_hash, hash) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
        (*fields.values(), last.hash, digest),
    )


@pytest.mark.parametrize(
    ("tampering", "at_delete", "reason"),
    [
        ("cut_delete_event", True, "the chain ends at event 4 but the agent's head is event 5"),
        ("cut_delete_event_and_rewind_tombstone", False, "but that is not its delete event"),
        ("remove_tombstone", False, "neither a row nor a tombstone"),
        ("rewrite_delete_event", True, "the event's content does not match its HMAC"),
        ("append_after_delete", False, "event 6 follows the agent's delete event 5"),
    ],
)
def test_verify_checks_a_deleted_agents_chain_up_to_its_tombstone(
    client: Client, db: Database, raw: psycopg.Connection[Any], tampering: str, at_delete: bool, reason: str
) -> None:
    old = _retired(client)
    client.create_agent("bystander")
    client.delete_agent(old.id, actor="dave")
    events = client.journal(agent_id=old.id)
    delete, before = events[-1], events[-2]
    assert delete.seq == 5
    sql = {
        "cut_delete_event": [("DELETE FROM audit.journal WHERE id = %s", (delete.id,))],
        "cut_delete_event_and_rewind_tombstone": [
            ("DELETE FROM audit.journal WHERE id = %s", (delete.id,)),
            (
                "UPDATE audit.deleted_agents SET journal_seq = %s, journal_head = %s WHERE agent_id = %s",
                (before.seq, before.hash, old.id),
            ),
        ],
        "remove_tombstone": [("DELETE FROM audit.deleted_agents WHERE agent_id = %s", (old.id,))],
        "rewrite_delete_event": [("UPDATE audit.journal SET actor = 'mallory' WHERE id = %s", (delete.id,))],
        "append_after_delete": [_forged_event_after(client, old.id)],
    }[tampering]
    assert journal.verify(db).ok
    _tamper(raw, *sql)
    report = journal.verify(db)
    assert len(report.breaks) == 1, report.breaks
    broken = report.breaks[0]
    assert broken.agent_id == old.id and reason in broken.reason, broken
    if at_delete:
        assert broken.seq == delete.seq


def test_the_database_deletes_an_agent_only_through_keel(client: Client, raw: psycopg.Connection[Any]) -> None:
    agent = _retired(client)
    refused = psycopg.errors.InsufficientPrivilege
    with pytest.raises(refused, match=r"agent .* can be deleted only with keel agent delete"):
        raw.execute("DELETE FROM agents WHERE id = %s", (agent.id,))
    with pytest.raises(refused, match="TRUNCATE refused"):
        raw.execute("TRUNCATE agents CASCADE")
    # A tombstone needs the agent's delete event as its last one, and the agent as it is.
    head = raw.execute("SELECT journal_seq, journal_head, created_at FROM agents WHERE id = %s", (agent.id,)).fetchone()
    assert head is not None
    tombstone = (
        "INSERT INTO audit.deleted_agents (agent_id, name, created_at, deleted_at, deleted_by, phase, revision,"
        " request_id, journal_seq, journal_head) VALUES (%s, 'ops-bot', %s, now(), 'mallory', 'failed', 2,"
        " 'ops-bot-r1', %s, %s)"
    )
    with pytest.raises(psycopg.errors.RaiseException, match="must be its delete event"):
        raw.execute(tombstone, (agent.id, head[2], head[0], head[1]))
    with pytest.raises(psycopg.errors.RaiseException, match="must record the agent as it is"):
        raw.execute(tombstone.replace("'failed', 2", "'failed', 1"), (agent.id, head[2], head[0], head[1]))
    assert client.get_state(agent.id).archived_at is not None
    assert raw.execute("SELECT count(*) FROM audit.deleted_agents").fetchone() == (0,)

    client.delete_agent(agent.id, actor="dave")
    for statement in ("UPDATE audit.deleted_agents SET deleted_by = 'mallory'", "DELETE FROM audit.deleted_agents"):
        with pytest.raises(refused, match="deleted_agents is append-only"):
            raw.execute(statement)
    # Nothing new can refer to a deleted agent: no event after its delete event, no job, no request.
    with pytest.raises(psycopg.errors.ForeignKeyViolation, match=r"journal: agent .* does not exist"):
        with raw.transaction():  # at the database's clock in its own transaction: refused for the agent alone
            now: Any = raw.execute("SELECT clock_timestamp()").fetchone()
            raw.execute(*_forged_event_after(client, agent.id, now[0]))
    with pytest.raises(psycopg.errors.ForeignKeyViolation, match=r"requests: agent .* does not exist"):
        raw.execute(
            "INSERT INTO requests (request_id, agent_id, input, actor, submitted_at)"
            " VALUES ('x', %s, '{}', 'm', now())",
            (agent.id,),
        )
    assert journal.verify(client.db).ok


def test_the_database_refuses_a_tombstone_without_the_deletion(client: Client, db: Database) -> None:
    agent = _retired(client)
    with psycopg.connect(db.libpq_url) as conn, conn.cursor() as cur:
        locked = lock_agent_txn(cur, agent.id)
        assert locked is not None
        link = journal.append_side_event_txn(
            cur,
            locked.row,
            keys=TEST_KEYS,
            kind="operator",
            event="delete",
            actor="m",
            decision="deleted",
            details={},
            at=locked.at,
        )
        row = locked.row
        cur.execute(
            "INSERT INTO audit.deleted_agents (agent_id, name, created_at, deleted_at, deleted_by, phase, revision,"
            " request_id, journal_seq, journal_head) VALUES (%s, %s, %s, %s, 'm', %s, %s, %s, %s, %s)",
            (row.id, row.name, row.created_at, locked.at, row.phase, row.revision, row.request_id, link.seq, link.hash),
        )
        with pytest.raises(psycopg.errors.RaiseException, match="has a tombstone but was not deleted"):
            conn.commit()
    assert client.get_state(agent.id).archived_at is not None
    assert [e.event for e in client.journal(agent_id=agent.id)][-1] == "archive"
    assert journal.verify(db).ok


def test_no_downgrade_once_agents_were_deleted(empty_db_url: str) -> None:
    """0006 refuses to go below itself once an agent was deleted; with a keyed journal (0015) the downgrade stops
    even earlier, at 0015, and changes nothing either way."""
    migrations.upgrade(empty_db_url)
    db = Database(empty_db_url, audit_keys=TEST_KEYS)
    try:
        client = Client(db)
        client.create_agent("gone")
        client.archive("gone", actor="carol")
        client.delete_agent("gone", actor="dave")
        with pytest.raises(DowngradeRefused, match="cannot downgrade below 0015: the journal holds 3 events linked"):
            migrations.downgrade(empty_db_url, "0005")
        assert client.journal(agent_id="gone")[-1].event == "delete"
        with db.engine.connect() as conn:
            # the refused downgrade changed nothing, not even the migrations above 0006 it had undone first
            assert migrations.database_revision(conn) == migrations.head()
    finally:
        db.dispose()


def test_a_deleted_agents_messages_are_still_delivered_and_a_dead_one_is_not_retried(
    client: Client, db: Database, raw: psycopg.Connection[Any]
) -> None:
    token = "xoxb-test-5ecret-slack-token"
    slack = FakeSlack(token=token)
    slack.start()
    relay = Relay(
        db,
        {"slack": SlackSender(token, f"{slack.url}/api/", timeout=1.0)},
        lease=timedelta(seconds=10),
        concurrency=2,
        backoff=Backoff(0.05, 0.2, 6, 200),
        pass_seconds=10,
        secrets=(token,),
    )
    try:
        agent = client.create_agent("poster")
        client.submit(agent.id, "r1", PROMPT)
        messages = (
            MessageSpec("slack", "C1", "m1", {"text": "one"}),
            MessageSpec("slack", "C2", "m2", {"text": "two"}),
        )
        transition(db, Command(agent.id, Event.PROGRESS, "worker", messages=messages))
        client.cancel(agent.id, actor="alice")
        client.archive(agent.id, actor="carol")
        raw.execute("UPDATE outbox SET status = 'dead' WHERE key = %s", (scoped(agent.id, "r1:slack:m2"),))
        client.delete_agent(agent.id, actor="dave")
        relay.run_pass()
        assert slack.order("C1") == [scoped(agent.id, "r1:slack:m1")]
        sent = message_row(db, scoped(agent.id, "r1:slack:m1"))
        assert sent is not None and sent["status"] == "sent"
        with pytest.raises(AgentNotFound, match="agent 'poster' was deleted"):
            retry_dead(db, scoped(agent.id, "r1:slack:m2"), actor="erin")
        dead = message_row(db, scoped(agent.id, "r1:slack:m2"))
        assert dead is not None and dead["status"] == "dead"
    finally:
        relay.close()
        slack.stop()
    assert journal.verify(db).ok


def test_a_late_copy_of_a_deleted_agents_job_is_dropped(client: Client, db: Database) -> None:
    own = Registry()
    own.register("finish_now", lambda ctx: JobResult(output={}, event=Event.FINISH))
    runner = Runner(db, own, worker="w", lease=timedelta(seconds=30), rules=DEFAULT_RULES)
    agent = client.create_agent("quick")
    client.submit(agent.id, "r1", None, operation="finish_now")
    assert runner.run(scoped(agent.id, "r1:finish_now:1")).status == "succeeded"
    client.archive(agent.id, actor="carol")
    client.delete_agent(agent.id, actor="dave")
    again = runner.run(scoped(agent.id, "r1:finish_now:1"))  # the broker delivered it once more
    assert again.status == "suppressed" and "its agent was deleted" in again.detail
    assert journal.verify(db).ok


# --- the command line ----------------------------------------------------------------------------------------------

SCRATCH = tempfile.mkdtemp(prefix="keel-delete-")


def _env(db_url: str) -> dict[str, str]:
    env = clean_env()
    env["KEEL_DATABASE_URL"] = db_url
    return env


def keel(db_url: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = run_keel(args, _env(db_url))
    if check:
        assert result.returncode == 0, result.stderr
    return result


def keel_on_a_terminal(db_url: str, answer: str, *args: str) -> tuple[int, str]:
    """Run keel with its stdin on a pseudo-terminal, answering ``answer`` to its question; exit status and output."""
    controller, terminal = pty.openpty()
    try:
        process = subprocess.Popen(
            [KEEL, *args], env=_env(db_url), stdin=terminal, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, cwd=SCRATCH,
        )  # fmt: skip
        os.write(controller, answer.encode() + b"\n")
        output, _ = process.communicate(timeout=180)
    finally:
        os.close(controller)
        os.close(terminal)
    return process.returncode, output


def test_keel_agent_delete_asks_first_and_the_journal_stays_readable(db_url: str) -> None:
    keel(db_url, "agent", "create", "old-bot", "--budget-cost", "1.5")
    keel(db_url, "submit", "old-bot", "r1", "--input", json.dumps(PROMPT))
    keel(db_url, "cancel", "old-bot")

    busy = keel(db_url, "agent", "delete", "old-bot", "--yes", check=False)
    assert busy.returncode == 1 and "agent 'old-bot' is not archived: archive it first" in busy.stderr
    keel(db_url, "agent", "archive", "old-bot")

    piped = keel(db_url, "agent", "delete", "old-bot", check=False)
    assert piped.returncode == 2 and "stdin is not a terminal, so nobody can confirm: add --yes" in piped.stderr
    status, output = keel_on_a_terminal(db_url, "n", "agent", "delete", "old-bot")
    assert status == 1 and "Delete agent 'old-bot'" in output and "not deleted: agent 'old-bot' is as it was" in output
    assert json.loads(keel(db_url, "agent", "show", "old-bot", "--json").stdout)["name"] == "old-bot"

    status, output = keel_on_a_terminal(db_url, "y", "agent", "delete", "old-bot", "--actor", "dave")
    assert status == 0 and "deleted agent 'old-bot'" in output and "by dave; its journal is kept" in output, output
    gone = keel(db_url, "agent", "show", "old-bot", check=False)
    assert gone.returncode == 1 and "agent 'old-bot' was deleted at " in gone.stderr and "by dave" in gone.stderr
    assert "no agents" in keel(db_url, "agent", "list", "--archived").stdout

    events = json.loads(keel(db_url, "journal", "--agent", "old-bot", "--json").stdout)["events"]
    assert [(e["kind"], e["event"]) for e in events][:2] == [("operator", "delete"), ("operator", "archive")]
    keel(db_url, "agent", "create", "old-bot")  # the name is free again
    keel(db_url, "agent", "archive", "old-bot")
    deleted = json.loads(keel(db_url, "agent", "delete", "old-bot", "--yes", "--reason", "twice", "--json").stdout)
    assert (deleted["name"], deleted["deleted_by"], deleted["phase"]) == ("old-bot", "cli", "idle")
    assert "old-bot (deleted)" in keel(db_url, "journal").stdout
    by_id = json.loads(keel(db_url, "journal", "--agent", deleted["id"], "--json").stdout)["events"]
    assert [e["event"] for e in by_id] == ["delete", "archive", "create"]  # newest first
    assert by_id[0]["details"] == {"name": "old-bot", "reason": "twice"}
    assert json.loads(keel(db_url, "audit", "verify", "--json").stdout) == {
        "ok": True,
        "mode": "full",
        "agents": 2,
        "checked": len(events) + 3,
        "trusted": 0,
        "trusted_chains": 0,
        "trusted_from": None,
        "trusted_to": None,
        "breaks": [],
        "unchecked": [],
        "legacy": [],
        "key_ids": ["test-1"],
        "archive_problems": [],
        "checkpoint_problems": [],
    }
