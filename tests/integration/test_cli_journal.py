"""`keel journal`, `keel audit verify` and `keel kpi` against a real database, run as a user would run them."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from uuid import UUID

import psycopg
import pytest

from agents.client import Client
from tests.support.cli import PROMPT, keel
from tests.support.keys import scoped

pytestmark = pytest.mark.integration


def test_journal_shows_the_whole_actor_and_why_a_command_was_rejected(db_url: str) -> None:
    actor = "deploy-pipeline@build-host-0042.example.internal"
    keel(db_url, "agent", "create", "ops", "--actor", actor)
    stale = keel(db_url, "cancel", "ops", "--revision", "3", "--actor", actor, check=False)
    assert stale.returncode == 1
    text = keel(db_url, "journal", "--agent", "ops").stdout
    assert actor in text
    assert "error: stale revision for agent" in text and "the agent is at revision 0" in text
    assert '"expected_revision": 3' in text and '"judged_phase": "idle"' in text
    # Newest first: the page after the refusal holds the create event alone, which shows no details.
    older = json.loads(keel(db_url, "journal", "--agent", "ops", "--limit", "1", "--json").stdout)["next"]
    assert "details:" not in keel(db_url, "journal", "--agent", "ops", "--limit", "1", "--after", older).stdout
    assert "details: {" in keel(db_url, "journal", "--agent", "ops", "--details").stdout


def test_journal_follow_of_an_unknown_agent_is_one_error_line_and_no_header(db_url: str) -> None:
    result = keel(db_url, "journal", "--agent", "nosuch", "--follow", check=False)
    assert result.returncode == 1
    assert (result.stdout, result.stderr) == ("", "keel: error: no agent has the id or name 'nosuch'\n")


def test_follow_reads_every_event_once_while_agents_move(client: Client) -> None:
    """Events committed by many writers at once reach a follower exactly once, each agent's chain without gaps."""
    agents = [client.create_agent(f"f{i}") for i in range(4)]
    seen: dict[Any, int] = {}
    got: list[tuple[Any, int]] = []

    def drain() -> None:
        for event in client.journal_after(seen):
            assert event.seq == seen.get(event.agent_id, 0) + 1, "a gap or a repeat"
            seen[event.agent_id] = event.seq
            got.append((event.agent_id, event.seq))

    def churn(agent_id: Any) -> None:
        for n in range(15):
            client.submit(agent_id, f"{agent_id}-{n}", {"prompt": f"step {n}"})
            client.cancel(agent_id, actor="churn")

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(churn, a.id) for a in agents]
        while not all(f.done() for f in futures):
            drain()
        for f in futures:
            f.result()
    drain()
    assert sorted(got) == sorted((e.agent_id, e.seq) for e in client.journal())
    assert len(got) == 4 * (1 + 30)


def test_audit_verify_exits_1_on_tampering(db_url: str) -> None:
    keel(db_url, "agent", "create", "ops")
    with psycopg.connect(db_url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute("ALTER TABLE audit.journal DISABLE TRIGGER USER")
        conn.execute("UPDATE audit.journal SET actor = 'mallory'")
    result = keel(db_url, "audit", "verify", check=False)
    assert result.returncode == 1
    agent_id = json.loads(keel(db_url, "agent", "show", "ops", "--json").stdout)["id"]
    # The agent by name and id (it was the id only).
    assert f"BROKEN agent 'ops' ({agent_id}) at event 1" in result.stderr, result.stderr
    broken = json.loads(keel(db_url, "audit", "verify", "--json", check=False).stdout)["breaks"]
    assert (broken[0]["agent"], broken[0]["agent_id"], broken[0]["seq"]) == ("ops", agent_id, 1)


def test_kpi_prints_the_counters_for_people_over_all_time_or_a_window(db_url: str) -> None:
    mine = UUID(json.loads(keel(db_url, "agent", "create", "mine", "--json").stdout)["id"])
    keel(db_url, "submit", "mine", "r-mine", "--input", PROMPT)
    keel(db_url, "agent", "create", "other")
    keel(db_url, "submit", "other", "r-other", "--input", PROMPT)
    keel(db_url, "cancel", "other")
    with psycopg.connect(db_url.replace("+psycopg", ""), autocommit=True) as conn:
        # A step that failed once, then succeeded, with an awkward cost: counted by the database, however written.
        conn.execute(
            "UPDATE jobs SET status = 'succeeded', error_attempts = '{\"transient\": 1}', failed_cost = 0.0025,"
            " failed_tokens = 12345, finished_at = now() WHERE key = %s",
            (scoped(mine, "r-mine:plan:1"),),
        )
    figures = json.loads(keel(db_url, "kpi", "--json").stdout)
    assert (figures["since"], figures["requests_done"], figures["requests_failed"]) == (None, 0, 1)
    assert (figures["failure_rate"], figures["recovery_rate"], figures["jobs_finished_after_failure"]) == (1.0, 1.0, 1)
    assert (figures["retry_tokens"], figures["retry_cost"], figures["retry_cost_share"]) == (12345, 0.0025, 1.0)
    assert figures["suppressed_duplicates"] == {"submit": 0, "job_delivery": 0, "job_insert": 0, "message_insert": 0}
    text = keel(db_url, "kpi").stdout.splitlines()
    assert text[0] == "KPIs since the counters began"
    rows = dict(re.split(r" {2,}", line.strip(), maxsplit=1) for line in text[1:])
    assert (
        rows["recovery rate after first failure"] == "100.0% of 1 jobs finished after a failure (1 failed a first time)"
    )
    assert rows["retry-caused cost"] == "12,345 tokens, $0.0025 (100.0% of spend)"
    assert (rows["failure rate"], rows["requests finished"]) == ("100.0%", "0 done, 1 failed")
    assert re.fullmatch(r"\d+ ms|[\d,]+\.\d\d s", rows["mean processing time"]), rows
    hour = json.loads(keel(db_url, "kpi", "--since", "1h", "--json").stdout)
    assert hour == {**figures, "since": "1h"}
    assert keel(db_url, "kpi", "--since", "90m").stdout.startswith("KPIs over the last 90m\n")
    for bad, rule in (
        ("5x", "e.g. 24h, 90m, 7d"),
        ("0h", "positive"),
        ("400d", "KEEL_KPI_RETENTION_DAYS"),
        ("30s", "30s is under a minute"),  # a window is whole minutes: this one would hold almost nothing
    ):
        refused = keel(db_url, "kpi", "--since", bad, check=False)
        assert refused.returncode == 2 and "--since" in refused.stderr and rule in refused.stderr, refused.stderr
    gone = keel(db_url, "kpi", "--include-demo", check=False)
    assert gone.returncode == 2 and "the KPI counters are global" in gone.stderr
