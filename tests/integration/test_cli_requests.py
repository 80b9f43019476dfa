"""`keel submit`, `run`, `wait` and `state` against a real database, run as a user would run them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from tests.support.cli import PROMPT, keel
from tests.support.keys import scoped

pytestmark = pytest.mark.integration


def test_run_state_and_kpi_from_the_command_line(db_url: str, tmp_path: Path) -> None:
    script = tmp_path / "replies.json"
    script.write_text(json.dumps([{"content": "hello"}]))
    helper = UUID(json.loads(keel(db_url, "agent", "create", "helper", "--json").stdout)["id"])
    ran = json.loads(
        keel(db_url, "run", "helper", "Say hello", "--script", str(script), "--request-id", "r-1", "--json").stdout
    )
    assert (ran["phase"], ran["request_id"], [j["key"] for j in ran["pending_jobs"]]) == (
        "planning",
        "r-1",
        [scoped(helper, "r-1:plan:1")],
    )
    state = json.loads(keel(db_url, "state", "helper", "--json").stdout)
    assert state["revision"] == 1 and state["pending_approval"] is None
    assert "jobs       1 pending" in keel(db_url, "state", "helper").stdout
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    refused = keel(db_url, "run", "helper", "x", "--script", str(bad), check=False)
    assert refused.returncode == 2 and "not valid JSON" in refused.stderr
    kpis = json.loads(keel(db_url, "kpi", "--json").stdout)
    assert sum(kpis["suppressed_duplicates"].values()) == 0 and kpis["side_effect_duplicates"] == 0


def test_wait_times_out_with_its_own_status_and_the_request_goes_on(db_url: str) -> None:
    keel(db_url, "agent", "create", "slow")
    # No worker is running: the request cannot move on.
    waited = keel(db_url, "submit", "slow", "r-slow", "--input", PROMPT, "--wait", "--timeout", "0.5", check=False)
    assert waited.returncode == 5, waited.stderr
    assert "timed out after 0.5s: agent 'slow' is planning at revision 1" in waited.stderr
    # The command to wait again, with the values filled in (it said `keel submit AGENT REQUEST_ID --wait`).
    assert "wait again with `keel wait slow r-slow`" in waited.stderr, waited.stderr
    again = keel(db_url, "wait", "slow", "r-slow", "--timeout", "0.3", check=False)
    assert again.returncode == 5 and "wait again with `keel wait slow r-slow`" in again.stderr, again.stderr
    assert "phase      planning" in again.stdout
    current = keel(db_url, "wait", "slow", "--timeout", "0.3", "--json", check=False)  # its current request
    assert current.returncode == 5 and json.loads(current.stdout)["request_id"] == "r-slow"
    unknown = keel(db_url, "wait", "slow", "r-nope", check=False)
    assert unknown.returncode == 1 and unknown.stderr == "keel: error: agent 'slow' has no request 'r-nope'\n"
    assert json.loads(keel(db_url, "state", "slow", "--json").stdout)["phase"] == "planning"
    lonely = keel(db_url, "submit", "slow", "r-2", "--input", PROMPT, "--timeout", "1", check=False)
    assert lonely.returncode == 2 and "--timeout needs --wait or --follow" in lonely.stderr


def test_a_run_script_that_does_not_fit_is_refused_in_one_line(db_url: str, tmp_path: Path) -> None:
    keel(db_url, "agent", "create", "helper")
    for script, message in [
        (
            [1, 2],
            "input of operation 'plan': input.script[0]: must be a JSON object, got a number; input.script[1]: must",
        ),
        (
            [{"tool_calls": [{"name": "slack.post", "arguments": {"channel": "C1", "text": "hi"}}]}],
            "input.script[0].tool_calls[0].name: there is no tool named 'slack.post'"
            " (tools: github_comment, slack_post)",
        ),
        (
            [
                {"tool_calls": [{"name": "slack_post", "arguments": {"channel": "#general", "text": "hi"}}]},
                {"content": "ok"},
            ],
            "input of operation 'plan': input.script[0].tool_calls[0].arguments.channel: string should match pattern",
        ),
        (
            [{"tool_calls": [{"name": "slack_post", "arguments": {"chan": 1}}]}, {"content": "ok"}],
            "input.script[0].tool_calls[0].arguments.channel: is required; input.script[0].tool_calls[0].arguments",
        ),
    ]:
        path = tmp_path / "replies.json"
        path.write_text(json.dumps(script))
        result = keel(db_url, "run", "helper", "Say hello", "--script", str(path), "--wait", check=False)
        assert result.returncode == 1 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    state = json.loads(keel(db_url, "state", "helper", "--json").stdout)
    assert (state["phase"], state["revision"]) == ("idle", 0)


def test_resubmitting_a_request_id_with_other_input_is_refused(db_url: str) -> None:
    keel(db_url, "agent", "create", "ops")
    keel(db_url, "submit", "ops", "r1", "--input", '{"prompt": "a"}')
    assert keel(db_url, "submit", "ops", "r1", "--input", '{"prompt": "a"}', "--json").returncode == 0
    result = keel(db_url, "submit", "ops", "r1", "--input", '{"prompt": "b"}', check=False)
    assert result.returncode == 1
    assert result.stderr == (
        "keel: error: request id 'r1' was submitted to agent 'ops' before with a different input: a retry must"
        " repeat the request as it was; use a new request id for a new request\n"
    )


def run_jobs(db: Any, most: int = 10) -> None:
    """Run the due jobs in this process, one at a time, as a worker would (retries without backoff)."""
    from datetime import timedelta

    import agents.runtime.loop  # noqa: F401 - registers plan and tool
    from agents.core.policies import DEFAULT_RULES, ErrorClass, RetryRule
    from agents.jobs.handlers import registry
    from agents.jobs.runner import Runner

    rules = {**DEFAULT_RULES, ErrorClass.TRANSIENT: RetryRule(3, 0.0, 0.0, 0.0)}
    runner = Runner(db, registry, worker="t", lease=timedelta(seconds=30), rules=rules)
    for _ in range(most):
        with psycopg.connect(db.libpq_url) as conn:
            due = conn.execute(
                "SELECT key FROM jobs WHERE status IN ('pending', 'enqueued') ORDER BY created_at, key LIMIT 1"
            ).fetchone()
        if due is None:
            return
        runner.run(due[0])


def test_the_docs_scripted_replies_run_as_written(db_url: str, db: Any, tmp_path: Path) -> None:
    """docs/how-to/scripted-replies.md's example script, taken from the page itself, submitted with `keel run` and
    run to the end."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "how-to" / "scripted-replies.md").read_text()
    block = page.split("<!-- scripted-replies-example", 1)[1].split("```json\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "replies.json"
    script.write_text(block)
    keel(db_url, "agent", "create", "ops-bot")
    keel(db_url, "run", "ops-bot", "Summarise open incidents", "--script", str(script), "--request-id", "r-readme")
    run_jobs(db)
    state = json.loads(keel(db_url, "state", "ops-bot", "--json").stdout)
    assert (state["phase"], state["spent_tokens"]) == ("done", 120 + 80 + 80)
    agent = UUID(state["id"])
    job = json.loads(keel(db_url, "job", scoped(agent, "r-readme:tool:slack_post:1.call_0_0"), "--json").stdout)
    assert job["status"] == "succeeded"
    answer = json.loads(keel(db_url, "job", scoped(agent, "r-readme:plan:2"), "--json").stdout)
    assert answer["result"]["answer"] == "Two incidents are open; both are about the database."
    assert "transient" in answer["error_attempts"]
    outcome = json.loads(keel(db_url, "request", "show", "ops-bot", "r-readme", "--json").stdout)
    assert outcome["failed_attempts"] == {"transient": 1}  # the outage the script plays, retried and not hidden


def test_waiting_on_an_older_request_reports_that_requests_own_outcome(db_url: str, db: Any, tmp_path: Path) -> None:
    """Before: the repeat of F1 (a suppressed duplicate) waited for the agent's current request, D1, and exited 0
    printing `request D1, phase done`."""
    failing, fine = tmp_path / "fail.json", tmp_path / "ok.json"
    failing.write_text(json.dumps([{"error": "invalid", "content": "never given"}]))
    fine.write_text(json.dumps([{"content": "hello"}]))
    keel(db_url, "agent", "create", "ops-bot")

    def run(request_id: str, script: Path, *more: str) -> subprocess.CompletedProcess[str]:
        args = ("run", "ops-bot", "hello", "--script", str(script), "--request-id", request_id, *more)
        return keel(db_url, *args, check=False)

    run("F1", failing)
    run_jobs(db)
    assert run("F1", failing, "--wait").returncode == 3
    run("D1", fine)
    run_jobs(db)
    assert run("D1", fine, "--wait").returncode == 0

    again = run("F1", failing, "--wait")
    assert again.returncode == 3, again.stdout + again.stderr
    assert "request    F1: failed at revision 2 (fail, invalid_not_retried" in again.stdout, again.stdout
    assert "has moved on: request D1 is done at revision 4" in again.stdout
    as_json = json.loads(run("F1", failing, "--wait", "--json").stdout)
    assert (as_json["request_id"], as_json["phase"], as_json["revision"]) == ("F1", "failed", 2)
    assert (as_json["agent"]["request_id"], as_json["agent"]["phase"]) == ("D1", "done")
    followed = run("F1", failing, "--follow", "--json")
    assert followed.returncode == 3
    assert {json.loads(line)["request_id"] for line in followed.stdout.splitlines()} == {"F1"}

    # `keel wait` asks without submitting anything: the same outcomes.
    assert keel(db_url, "wait", "ops-bot", "F1", check=False).returncode == 3
    latest = keel(db_url, "wait", "ops-bot", "--json", check=False)
    assert latest.returncode == 0 and json.loads(latest.stdout)["request_id"] == "D1"
    events = json.loads(keel(db_url, "journal", "--agent", "ops-bot", "--json").stdout)["events"]
    assert [e["event"] for e in events if e["kind"] == "transition"].count("submit") == 2  # nothing resubmitted
