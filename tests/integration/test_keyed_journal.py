"""The keyed journal: every link is an HMAC under an audit key kept outside the database, so someone who can rewrite
the database — a superuser, past the append-only triggers — still cannot edit, delete, insert, reorder or recompute
events without `keel audit verify` naming the agent and the event; keys rotate, and without the key nothing is
journaled. Chains from before the upgrade: test_legacy_chains.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from agents.client import Client
from agents.core import journal
from agents.core.commands import Command
from agents.core.errors import StaleRevision
from agents.core.journal import Unchecked
from agents.core.phases import Event
from agents.core.transition import transition
from models.audit_keys import AuditKeyMissing, AuditKeys
from models.db import Database
from models.settings import Settings
from tests.support.audit import TEST_KEY_ID, TEST_KEYS, TEST_SECRET, as_superuser
from tests.support.tamper import FORGER, chain, edited_at, keel_verify, linked_fields, rewrite, under, with_sha256

pytestmark = pytest.mark.integration

ASK = {"prompt": "What changed?", "script": [{"content": "Nothing.", "cost": "0.5"}]}
KEY_A = "rotation-key-a-0123456789abcdefghijklmnopq"
KEY_B = "rotation-key-b-0123456789abcdefghijklmnopq"


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
# --- what an attacker with the database but without the key can do ------------------------------------------------


def _tamper(raw: psycopg.Connection[Any], agent_id: UUID, how: str) -> None:
    events = chain(raw, agent_id)
    third = events[2]
    forged = {**third, "actor": "mallory", "event": "approve"}
    if how == "edited":
        as_superuser(raw, ("UPDATE audit.journal SET actor = 'mallory' WHERE id = %s", (third["id"],)))
    elif how == "edited, the chain relinked from it with sha256":
        rewrite(raw, agent_id, edited_at(events, 3), with_sha256(), from_seq=3)
    elif how == "edited, the chain relinked from it as unkeyed":
        rewrite(raw, agent_id, edited_at(events, 3), with_sha256(keep_key_id=False), from_seq=3)
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
        rewrite(raw, agent_id, edited_at(events, 3), with_sha256())
    elif how == "wholly recomputed with sha256, unkeyed":
        rewrite(raw, agent_id, edited_at(events, 3), with_sha256(keep_key_id=False))
    elif how == "wholly recomputed with a wrong key":
        rewrite(
            raw, agent_id, edited_at(events, 3), under(AuditKeys.of({TEST_KEY_ID: FORGER}, TEST_KEY_ID), TEST_KEY_ID)
        )
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
        edited_at(chain(raw, agent.id), 3),
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
        assert e["hash"] == journal.event_mac(TEST_KEYS, TEST_KEY_ID, **linked_fields(e))
        assert e["hash"] != journal.event_hash(**linked_fields(e))
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
