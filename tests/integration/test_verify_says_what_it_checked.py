"""`keel audit verify` never calls an event verified that it did not check in that run: a person's verify is a full
walk, `--incremental` says what it trusted from checkpoints (and re-checks each checkpoint's own event), and the
leading beat runs a full pass on a schedule kept in the database."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from agents.audit.verify import verify_and_record
from agents.client import Client
from agents.core.errors import StaleRevision
from models.db import Database
from models.settings import Settings
from tasks.leader import LeaderDuties
from tests.support.api import Api
from tests.support.audit import TEST_ENV, as_superuser
from tests.support.cli import run_keel
from tests.support.console import Browsers

pytestmark = pytest.mark.integration
ASK = {"prompt": "What changed?", "script": [{"content": "Nothing.", "cost": "0.5"}]}
KEEL = str(Path(sys.executable).parent / "keel")


def _three_events(client: Client, name: str = "ledger") -> UUID:
    agent = client.create_agent(name)
    client.submit(agent.id, f"{name}-r", ASK)
    with pytest.raises(StaleRevision):  # a refused command is journaled: event 3
        client.cancel(agent.id, expected_revision=0, actor="late")
    return agent.id


def _verify(db_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "OTEL_"))}
    return run_keel(["audit", "verify", *args], env | TEST_ENV | {"KEEL_DATABASE_URL": db_url})


def _edit(raw: psycopg.Connection[Any], agent_id: UUID, seq: int) -> None:
    # A superuser past the journal's triggers, recomputing nothing.
    as_superuser(raw, ("UPDATE audit.journal SET actor = 'mallory' WHERE agent_id = %s AND seq = %s", (agent_id, seq)))


def test_a_plain_verify_after_an_edit_an_earlier_verify_passed_fails_naming_the_event(
    client: Client, raw: psycopg.Connection[Any], db_url: str
) -> None:
    a = _three_events(client)
    first = _verify(db_url)
    assert first.returncode == 0, first.stderr
    _edit(raw, a, 2)
    said = _verify(db_url)
    assert said.returncode == 1, said.stdout
    assert f"BROKEN agent 'ledger' ({a}) at event 2" in said.stderr
    assert "verified" not in said.stdout


def test_the_incremental_pass_rechecks_each_checkpoints_own_event(
    client: Client, db: Database, raw: psycopg.Connection[Any], db_url: str
) -> None:
    a = _three_events(client)
    assert _verify(db_url).returncode == 0
    _edit(raw, a, 3)  # the event the checkpoint stands on
    beats = verify_and_record(db, "beat", full=False)  # the beat's hourly pass, which reads nothing new here
    assert [(b.agent_id, b.seq) for b in beats.breaks] == [(a, 3)]
    assert beats.read_events == 0 and "content does not match its HMAC" in beats.breaks[0].reason
    said = _verify(db_url, "--incremental")
    assert said.returncode == 1, said.stdout
    assert f"BROKEN agent 'ledger' ({a}) at event 3" in said.stderr


def test_the_incremental_pass_says_what_it_checked_and_what_it_trusted(
    client: Client, raw: psycopg.Connection[Any], db_url: str
) -> None:
    a = _three_events(client)
    full = _verify(db_url)
    assert full.stdout.startswith("ok: 3 events in 1 agent chains verified in this run"), full.stdout
    stamp = raw.execute(
        "SELECT to_char(verified_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS') FROM audit_verified_chains"
    ).fetchone()
    assert stamp is not None
    with pytest.raises(StaleRevision):
        client.cancel(a, expected_revision=0, actor="later")
    said = _verify(db_url, "--incremental")
    assert said.returncode == 0, said.stderr
    assert said.stdout.startswith(
        f"ok: 1 events in 1 agent chains verified in this run; 3 events trusted from checkpoints of {stamp[0]} UTC"
    ), said.stdout
    data = json.loads(_verify(db_url, "--incremental", "--json").stdout)
    assert (data["mode"], data["checked"], data["trusted"], data["agents"]) == ("incremental", 0, 4, 1)
    assert "events" not in data, "no total that mixes the checked with the trusted"


def test_the_console_tells_an_incremental_verify_from_a_full_one(client: Client, db: Database, api: Api) -> None:
    a = _three_events(client)
    assert verify_and_record(db, "cli").ok
    assert verify_and_record(db, "beat", full=False).ok
    browsers = Browsers(api)
    try:
        page = browsers.signed_in(api.token("auditor")).get(f"/agents/{a}").text
    finally:
        browsers.close()
    assert "The latest full check" not in page
    assert "0 events in 1 agent chains verified in this run; 3 events trusted from checkpoints of" in page


def test_the_beats_full_pass_is_due_by_the_last_full_pass_recorded_not_by_a_restart(
    client: Client, db: Database, raw: psycopg.Connection[Any]
) -> None:
    _three_events(client)
    assert verify_and_record(db, "cli", full=True).ok  # a person's full pass
    daily = Settings(audit_verify_interval_seconds=3600, audit_verify_full_interval_seconds=86400)
    modes = []
    for every in (daily, daily, Settings(audit_verify_full_interval_seconds=0.001)):  # a beat, restarted, then due
        LeaderDuties(db, every)._verify()
        modes.append(
            raw.execute("SELECT details->>'mode' FROM audit_verifications ORDER BY id DESC LIMIT 1").fetchone()
        )
    assert modes == [("incremental",), ("incremental",), ("full",)]
    assert Settings().audit_verify_full_interval_seconds == 86400, "daily by default"
