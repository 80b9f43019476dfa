"""A request's outcome — answer, failure, spend, side effects and their delivery — shown by every door, and the
default model answering a request that carries no script (issue 37, items 1, 4 and 5)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import psycopg
import pytest

from agents.client import Client, HttpClient
from agents.core.commands import Usage
from agents.core.phases import Event
from agents.jobs.handlers import JobContext, JobResult, registry
from agents.outbox.relay import Backoff
from tests.integration.test_cli_requests import run_jobs
from tests.support.api import Api, script
from tests.support.cli import keel
from tests.support.outbox import one_pass

pytestmark = pytest.mark.integration

STAND_IN = "[stand-in model] You asked: 'What is open today?'"


def test_a_request_without_a_script_is_answered_by_the_stand_in_and_keel_prints_the_answer(
    db_url: str, db: Any
) -> None:
    """Before: `keel run` refused without --script, and a submit without one went to failed (the scripted provider
    needed a script); a finished request showed only `phase done`."""
    keel(db_url, "agent", "create", "helper")
    ran = keel(db_url, "run", "helper", "What is open today?", "--request-id", "r-1")
    assert "phase      planning" in ran.stdout
    keel(db_url, "submit", "helper", "r-1", "--input", json.dumps({"prompt": "What is open today?"}))  # the same
    run_jobs(db)
    waited = keel(db_url, "wait", "helper", "r-1", check=False)
    assert waited.returncode == 0, waited.stderr
    assert f"answer     {STAND_IN}" in waited.stdout, waited.stdout
    assert "outcome    r-1: done at revision 2" in waited.stdout
    assert "spent      0 tokens" in waited.stdout
    shown = json.loads(keel(db_url, "request", "show", "helper", "--json").stdout)
    assert shown["answer"].startswith(STAND_IN) and shown["failure"] is None and shown["side_effects"] == []
    stated = json.loads(keel(db_url, "state", "helper", "--json").stdout)
    assert stated["outcome"]["answer"] == shown["answer"] and stated["dead_messages"] == 0
    said = json.loads(keel(db_url, "request", "conversation", "helper", "r-1", "--json").stdout)["messages"]
    assert [(m["role"], m["content"][:16]) for m in said] == [
        ("user", "What is open tod"),
        ("assistant", STAND_IN[:16]),
    ]
    text = keel(db_url, "request", "conversation", "helper").stdout
    assert text.splitlines()[0] == "user       What is open today?"


def test_a_failed_request_says_why_and_which_step(db_url: str, db: Any, tmp_path: Path) -> None:
    failing = tmp_path / "fail.json"
    failing.write_text(json.dumps([{"error": "invalid", "content": "never given", "tokens": 7}]))
    keel(db_url, "agent", "create", "ops-bot")
    keel(db_url, "run", "ops-bot", "hello", "--script", str(failing), "--request-id", "F1")
    run_jobs(db)
    waited = keel(db_url, "wait", "ops-bot", "F1", check=False)
    assert waited.returncode == 3
    assert "failure    invalid_not_retried" in waited.stdout, waited.stdout
    assert ":plan:1 (invalid): scripted 400" in waited.stdout
    assert "spent      7 tokens" in waited.stdout  # the failed attempt's spend is the request's
    assert "failed     invalid 1 (attempts that failed, by error class" in waited.stdout
    keel(db_url, "run", "ops-bot", "again", "--script", str(failing), "--request-id", "C1")
    keel(db_url, "cancel", "ops-bot", "--reason", "wrong prompt", "--actor", "alice")
    cancelled = json.loads(keel(db_url, "request", "show", "ops-bot", "C1", "--json").stdout)
    assert cancelled["failure"] == {
        "event": "cancel",
        "actor": "alice",
        "reason": "cancelled by alice: wrong prompt",
        "job": None,
        "error_class": None,
        "error": None,
    }
    unknown = keel(db_url, "request", "show", "ops-bot", "nope", check=False)
    assert unknown.returncode == 1 and "nope" in unknown.stderr


def test_a_dead_side_effect_shows_on_the_request_and_the_agent(db_url: str, db: Any, tmp_path: Path) -> None:
    """Before: the request was `done` and nothing said its Slack message never arrived (`slack is not configured`)."""
    script = tmp_path / "post.json"
    post = {"name": "slack_post", "arguments": {"channel": "C0OPS", "text": "deploy done"}}
    script.write_text(json.dumps([{"tool_calls": [post]}, {"content": "Posted."}]))
    keel(db_url, "agent", "create", "poster")
    keel(db_url, "run", "poster", "post it", "--script", str(script), "--request-id", "P1")
    run_jobs(db)
    one_pass(db)  # no senders: the Slack message goes dead, `slack is not configured`
    waited = keel(db_url, "wait", "poster", "P1", check=False)
    assert waited.returncode == 0 and "answer     Posted." in waited.stdout
    assert "effect     slack C0OPS: DEAD (slack is not configured" in waited.stdout, waited.stdout
    assert "1 side effect(s) never arrived: `keel outbox retry KEY`" in waited.stdout
    state = keel(db_url, "state", "poster")
    assert "dead       1 side effect(s) never arrived" in state.stdout
    as_json = json.loads(keel(db_url, "state", "poster", "--json").stdout)
    assert as_json["dead_messages"] == 1
    [effect] = as_json["outcome"]["side_effects"]
    assert (effect["channel"], effect["status"]) == ("slack", "dead")
    kpi = keel(db_url, "kpi").stdout
    line = r"^dead side effects now +1 \(slack 1, github 0\): keel outbox list --status dead$"
    assert re.search(line, kpi, re.M), kpi
    assert json.loads(keel(db_url, "kpi", "--json").stdout)["dead_side_effects"] == {"slack": 1, "github": 0}


def test_a_step_that_ends_after_a_cancel_leaves_the_cancel_the_outcome_and_its_spend_counted(
    db: Any, client: Client
) -> None:
    """Found in review: the late step's charge (a transition too) was taken for the request's last move — the outcome
    said `fail, fenced_off` — and the spend it charged was on no job, so the outcome said 0 tokens."""

    def late(ctx: JobContext) -> JobResult:
        Client(ctx.db).cancel(ctx.agent_id, actor="alice", reason="wrong prompt")  # while the step is at the model
        return JobResult(output={"answer": "too late"}, usage=Usage(tokens=40), event=Event.FINISH)

    registry.register("outcome_late", late)
    agent = client.create_agent("late")
    client.submit(agent.id, "R1", {"x": 1}, operation="outcome_late")
    run_jobs(db)
    outcome = client.outcome(agent.id, "R1")
    assert outcome.failure is not None
    assert (outcome.phase, outcome.failure.event, outcome.failure.reason) == (
        "failed",
        "cancel",
        "cancelled by alice: wrong prompt",
    )
    assert outcome.tokens == 40 == client.get_state(agent.id).spent_tokens


def test_a_request_whose_steps_were_pruned_says_so_and_one_whose_journal_is_gone_leaves_state_readable(
    db_url: str, db: Any
) -> None:
    """Found in review: after retention the outcome said `spent 0 tokens` as a fact, and `keel state` failed once the
    request's journal month was archived."""
    keel(db_url, "agent", "create", "dormant")
    keel(db_url, "run", "dormant", "hello", "--request-id", "old-1")
    run_jobs(db)
    with psycopg.connect(db.libpq_url, autocommit=True) as conn:
        conn.execute("DELETE FROM jobs")  # as retention's prune does after KEEL_JOBS_RETENTION_DAYS
    shown = keel(db_url, "request", "show", "dormant").stdout
    assert "spent      not known: its steps were pruned by retention" in shown and "answer" not in shown, shown
    assert json.loads(keel(db_url, "request", "show", "dormant", "--json").stdout)["pruned"] is True
    with psycopg.connect(db.libpq_url, autocommit=True) as conn:
        conn.execute("SET session_replication_role = replica")  # as an archived month's events are gone
        conn.execute("DELETE FROM audit.journal WHERE request_id = 'old-1'")
    state = keel(db_url, "state", "dormant", check=False)
    assert state.returncode == 0 and "phase      done" in state.stdout and "outcome" not in state.stdout, state


def test_a_token_that_may_not_read_the_story_gets_the_outcome_without_errors_or_links(
    api: Api, client: Client, db: Any
) -> None:
    """Found in review: a producer token read a side effect's error and a failed step's error text through
    `GET …/requests/{id}`, which its scope keeps from it on the story and the outbox."""
    agent = client.create_agent("poster")
    post = {"name": "slack_post", "arguments": {"channel": "C0OPS", "text": "deploy done"}}
    client.submit(agent.id, "P1", script({"tool_calls": [post]}, {"content": "Posted."}))
    run_jobs(db)
    one_pass(db)  # no senders: the Slack message goes dead, `slack is not configured`
    with HttpClient(api.url, api.token("producer")) as producer:
        seen = producer.outcome(agent.id, "P1")
    [effect] = seen.side_effects
    assert seen.partial and seen.answer == "Posted." and (effect.status, effect.last_error) == ("dead", None)
    with HttpClient(api.url, api.token("operator")) as operator:
        whole = operator.outcome(agent.id, "P1")
        assert operator.dead_messages("poster") == 1 == client.dead_messages(agent.id)
    assert not whole.partial and "slack is not configured" in (whole.side_effects[0].last_error or "")
    with api.http(api.token("producer")) as http:
        assert http.get("/v1/outbox", params={"agent": "poster", "status": "dead"}).status_code == 403
    with api.http(api.token("operator")) as http:
        other = client.create_agent("quiet")
        listed = http.get("/v1/outbox", params={"agent": str(other.id), "status": "dead"}).json()
        assert listed["messages"] == []
        assert http.get("/v1/outbox", params={"agent": "nobody"}).status_code == 404
    # Another tenant's agent is not there for a token limited to its own prefix, by name or by id.
    with api.http(api.token("operator", prefix="acme-")) as http:
        for ref in ("poster", str(agent.id)):
            assert http.get("/v1/outbox", params={"agent": ref, "status": "dead"}).status_code == 404


def test_a_side_effect_not_through_yet_says_what_its_last_attempt_met(db_url: str, db: Any, tmp_path: Path) -> None:
    """Found by a newcomer's walkthrough: with Slack unreachable the outcome said `pending` and nothing else, so the
    tutorial's "ask again" went on for ever; the reason was only in `keel outbox list`."""
    from agents.outbox.senders import SlackSender

    script = tmp_path / "post.json"
    post = {"name": "slack_post", "arguments": {"channel": "C0OPS", "text": "deploy done"}}
    script.write_text(json.dumps([{"tool_calls": [post]}, {"content": "Posted."}]))
    keel(db_url, "agent", "create", "poster")
    keel(db_url, "run", "poster", "post it", "--script", str(script), "--request-id", "P1")
    run_jobs(db)
    unreachable = SlackSender("xoxb-test", "http://127.0.0.1:1/api/", timeout=1.0)
    one_pass(db, {"slack": unreachable}, backoff=Backoff(5, 10, 5, 10))
    shown = keel(db_url, "request", "show", "poster", "P1").stdout
    assert re.search(r"^effect     slack C0OPS: pending \(attempt 1: .*connect", shown, re.M | re.I), shown
    assert "connection to Slack at http://127.0.0.1:1/api/ (KEEL_SLACK_API_URL) failed" in shown, shown


def test_a_deleted_agents_request_is_still_shown(db_url: str, db: Any) -> None:
    """Found in review: `keel request show` read the agent's state first, so a deleted agent's request (its journal
    and requests are kept) could be read by the Client and HTTP but not the CLI."""
    keel(db_url, "agent", "create", "gone")
    keel(db_url, "run", "gone", "What is open today?", "--request-id", "r-1")
    run_jobs(db)
    keel(db_url, "agent", "archive", "gone")
    keel(db_url, "agent", "delete", "gone", "--yes")
    shown = keel(db_url, "request", "show", "gone", "r-1").stdout
    assert f"answer     {STAND_IN}" in shown, shown
    said = keel(db_url, "request", "conversation", "gone", "r-1").stdout
    assert said.splitlines()[0] == "user       What is open today?"
