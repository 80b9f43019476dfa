"""`keel agent …` against a real database, run as a user would run it: create, show, list, archive."""

from __future__ import annotations

import json
from uuid import UUID

import psycopg
import pytest

from tests.support.cli import PROMPT, RFC3339, keel
from tests.support.keys import scoped

pytestmark = pytest.mark.integration


def test_agent_lifecycle_from_the_command_line(db_url: str) -> None:
    created = json.loads(keel(db_url, "agent", "create", "ops-bot", "--budget-tokens", "500", "--json").stdout)
    assert (created["name"], created["phase"], created["revision"], created["budget_tokens"]) == (
        "ops-bot",
        "idle",
        0,
        500,
    )
    keel(db_url, "submit", "ops-bot", "req-7", "--input", '{"prompt": "hi"}', "--actor", "alice")
    shown = json.loads(keel(db_url, "agent", "show", created["id"], "--json").stdout)
    assert (shown["phase"], shown["revision"], shown["request_id"]) == ("planning", 1, "req-7")
    plan = scoped(UUID(created["id"]), "req-7:plan:1")
    shown_text = keel(db_url, "agent", "show", "ops-bot").stdout
    assert "phase      planning" in shown_text and plan in shown_text
    job = json.loads(keel(db_url, "job", plan, "--json").stdout)
    assert (job["status"], job["operation"], job["queue"]) == ("pending", "plan", "keel.jobs")
    missing = keel(db_url, "job", "nope:plan:1", check=False)
    assert missing.returncode == 1 and "no job has the key 'nope:plan:1'" in missing.stderr
    keel(db_url, "cancel", "ops-bot", "--revision", "1", "--reason", "wrong prompt", "--actor", "bob")
    events = json.loads(keel(db_url, "journal", "--agent", "ops-bot", "--json").stdout)["events"]
    assert [(e["kind"], e["event"], e["actor"]) for e in events] == [  # newest first
        ("transition", "cancel", "bob"),
        ("transition", "submit", "alice"),
        ("created", "create", "cli"),
    ]
    assert events[0]["details"] == {"reason": "wrong prompt", "jobs_cancelled": [plan]}
    by_request = keel(db_url, "journal", "--agent", "ops-bot", "--request-id", "req-7", "--json").stdout
    assert [e["event"] for e in json.loads(by_request)["events"]] == ["cancel", "submit"]
    unscoped = keel(db_url, "journal", "--request-id", "req-7", check=False)  # request ids are each agent's own
    assert unscoped.returncode == 1 and "names a request of one agent: give its agent too" in unscoped.stderr
    assert "planning -> failed" in keel(db_url, "journal", "--agent", "ops-bot").stdout
    verified = json.loads(keel(db_url, "audit", "verify", "--json").stdout)
    assert verified == {
        "ok": True,
        "mode": "full",
        "agents": 1,
        "checked": 3,
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


def test_agent_list_has_a_header_a_phase_filter_newest_first_and_pages(db_url: str) -> None:
    for name in ("a1", "a2", "a3", "a4", "a5"):
        keel(db_url, "agent", "create", name)
    keel(db_url, "submit", "a2", "r-a2", "--input", PROMPT)
    keel(db_url, "submit", "a4", "r-a4", "--input", PROMPT)
    listed = keel(db_url, "agent", "list").stdout.splitlines()
    assert listed[0].split() == ["NAME", "PHASE", "REV", "REQUEST", "CREATED", "UPDATED"]
    assert [line.split()[0] for line in listed[1:]] == ["a5", "a4", "a3", "a2", "a1"]
    planning = json.loads(keel(db_url, "agent", "list", "--phase", "planning", "--json").stdout)
    assert [a["name"] for a in planning["agents"]] == ["a4", "a2"] and planning["next"] is None
    both = json.loads(keel(db_url, "agent", "list", "--phase", "planning", "--phase", "idle", "--json").stdout)
    assert len(both["agents"]) == 5

    seen: list[str] = []
    cursor: str | None = None
    while True:
        args = ["agent", "list", "--limit", "2", "--json"] + (["--after", cursor] if cursor else [])
        page = json.loads(keel(db_url, *args).stdout)
        seen += [a["name"] for a in page["agents"]]
        cursor = page["next"]
        if cursor is None:
            break
    assert seen == ["a5", "a4", "a3", "a2", "a1"]
    first_text = keel(db_url, "agent", "list", "--limit", "2").stdout
    assert first_text.strip().splitlines()[-1].startswith("next: keel agent list --limit 2 --after ")
    # The next page's command keeps the filters (it dropped them): run as printed, it pages on.
    idle = keel(db_url, "agent", "list", "--phase", "idle", "--limit", "2").stdout.strip().splitlines()
    cursor = json.loads(keel(db_url, "agent", "list", "--phase", "idle", "--limit", "2", "--json").stdout)["next"]
    assert idle[-1] == f"next: keel agent list --phase idle --limit 2 --after {cursor}"
    following = keel(db_url, *idle[-1].removeprefix("next: keel ").split()).stdout.splitlines()
    assert [line.split()[0] for line in following[1:]] == ["a1"]
    keel(db_url, "agent", "archive", "a1")
    keel(db_url, "agent", "archive", "a3")
    archived = keel(db_url, "agent", "list", "--archived", "--limit", "1").stdout.strip().splitlines()
    assert archived[-1].startswith("next: keel agent list --archived --limit 1 --after ")

    bad = keel(db_url, "agent", "list", "--after", "nonsense", check=False)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1  # a usage error, naming --after
    assert "Invalid value for --after" in bad.stderr
    assert "cursor 'nonsense' is not the 'next' of a page of agents" in bad.stderr
    wrong_phase = keel(db_url, "agent", "list", "--phase", "sleeping", check=False)
    assert wrong_phase.returncode == 2 and "'sleeping' is not one of" in wrong_phase.stderr


def test_archive_hides_an_agent_refuses_requests_and_keeps_its_journal(db_url: str) -> None:
    keel(db_url, "agent", "create", "old-bot")
    keel(db_url, "agent", "create", "busy-bot")
    keel(db_url, "submit", "busy-bot", "r-busy", "--input", PROMPT)
    refused = keel(db_url, "agent", "archive", "busy-bot", "--actor", "carol", check=False)
    assert refused.returncode == 1
    assert "agent 'busy-bot' is planning: archive it when it rests" in refused.stderr
    assert json.loads(keel(db_url, "agent", "show", "busy-bot", "--json").stdout)["archived_at"] is None

    archived = json.loads(keel(db_url, "agent", "archive", "old-bot", "--actor", "carol", "--json").stdout)
    assert RFC3339.match(archived["archived_at"]) and archived["phase"] == "idle" and archived["revision"] == 0
    names = [a["name"] for a in json.loads(keel(db_url, "agent", "list", "--json").stdout)["agents"]]
    assert names == ["busy-bot"]
    assert [a["name"] for a in json.loads(keel(db_url, "agent", "list", "--archived", "--json").stdout)["agents"]] == [
        "old-bot"
    ]
    submit = keel(db_url, "submit", "old-bot", "r-old", "--input", PROMPT, check=False)
    assert submit.returncode == 1 and "agent 'old-bot' is archived" in submit.stderr
    assert "ARCHIVED" in keel(db_url, "agent", "show", "old-bot").stdout

    events = json.loads(keel(db_url, "journal", "--agent", "old-bot", "--json").stdout)["events"]
    assert [(e["kind"], e["event"], e["decision"], e["actor"]) for e in events] == [  # newest first
        ("rejected", "submit", "agent_archived", "cli"),
        ("operator", "archive", "archived", "carol"),
        ("created", "create", "accepted", "cli"),
    ]
    busy = json.loads(keel(db_url, "journal", "--agent", "busy-bot", "--json").stdout)["events"]
    assert (busy[0]["kind"], busy[0]["event"], busy[0]["decision"]) == ("rejected", "archive", "agent_busy")
    assert json.loads(keel(db_url, "audit", "verify", "--json").stdout)["ok"] is True

    keel(db_url, "agent", "unarchive", "old-bot")
    assert (
        json.loads(keel(db_url, "submit", "old-bot", "r-old", "--input", PROMPT, "--json").stdout)["phase"]
        == "planning"
    )
    assert json.loads(keel(db_url, "audit", "verify", "--json").stdout) == {
        "ok": True,
        "mode": "full",
        "agents": 2,
        "checked": 8,
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
    quick = json.loads(keel(db_url, "audit", "verify", "--incremental", "--json").stdout)
    # Nothing new since the full pass: every event trusted from the checkpoints it just stamped, none checked.
    assert (quick["ok"], quick["mode"], quick["checked"], quick["trusted"], quick["trusted_chains"]) == (
        True, "incremental", 0, 8, 2
    )  # fmt: skip


def test_the_database_refuses_an_archive_that_is_not_journaled(db_url: str) -> None:
    keel(db_url, "agent", "create", "sneaky")
    with psycopg.connect(db_url.replace("+psycopg", ""), autocommit=True) as conn:
        with pytest.raises(psycopg.errors.RaiseException, match=r"archiving agent .* must be journaled"):
            conn.execute("UPDATE agents SET archived_at = now() WHERE name = 'sneaky'")
    assert json.loads(keel(db_url, "agent", "show", "sneaky", "--json").stdout)["archived_at"] is None
