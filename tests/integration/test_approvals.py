"""Approvals people handle: they are told (Slack, through the outbox, once), calls time out (reject or escalate,
once, on the database's clock), an approver may edit the arguments, and one inbox lists every waiting call."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from uuid import UUID

import psycopg
import pytest
from pydantic import BaseModel, Field

import agents.runtime.loop as loop
from agents.client import Client, HttpClient
from agents.core.commands import Command
from agents.core.errors import InvalidInput
from agents.jobs import deadlines
from agents.jobs.handlers import registry
from agents.jobs.runner import Runner
from agents.outbox.relay import Backoff, Relay
from agents.outbox.senders import GitHubSender, SlackSender
from agents.runtime.approvals import enforce_timeouts
from agents.runtime.tools import ToolContext, ToolOutput, tool
from models.approvals_sql import calls_past_approval_timeout
from models.db import Database
from models.jobs_sql import job_row
from models.outbox_sql import message_row
from models.settings import Settings
from tests.support.api import COMMENT, Api, problem, waiting_agent
from tests.support.audit import clean_env
from tests.support.cli import run_keel
from tests.support.fakes import FakeSlack
from tests.support.keys import scoped
from tests.support.runs import FAST_RULES, run_all

pytestmark = pytest.mark.integration

CHANNEL, ESCALATION = "C0APPROVE", "C0ESCALATE"
GATE = "github_comment:1.call_0_0"


class Deploy(BaseModel):
    service: str = Field(min_length=1)
    replicas: int = Field(ge=1, le=10)


@tool("deploy_service", needs_approval=True, approval_timeout=timedelta(seconds=1))
def deploy_service(args: Deploy, ctx: ToolContext) -> ToolOutput:
    return ToolOutput(f"deployed {args.service} x{args.replicas}")


@tool("page_oncall", needs_approval=True, approval_timeout=timedelta(seconds=1), on_timeout="escalate")
def page_oncall(args: Deploy, ctx: ToolContext) -> ToolOutput:
    return ToolOutput(f"paged for {args.service}")


@pytest.fixture
def told(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The workers' settings name an approval channel and a public URL."""
    monkeypatch.setenv("KEEL_APPROVAL_SLACK_CHANNEL", CHANNEL)
    monkeypatch.setenv("KEEL_API_PUBLIC_URL", "https://keel.example.com")
    loop._settings.cache_clear()
    yield
    monkeypatch.undo()
    loop._settings.cache_clear()


def comment_script(body: str = "Fixed") -> dict[str, Any]:
    call = {"name": "github_comment", "arguments": {"repository": "acme/api", "issue": 7, "body": body}}
    return {"prompt": "p", "script": [{"tool_calls": [call]}, {"content": "Done."}, {"content": "Revised."}]}


def deploy_script(tool_name: str = "deploy_service") -> dict[str, Any]:
    call = {"name": tool_name, "arguments": {"service": "api", "replicas": 2}}
    return {"prompt": "p", "script": [{"tool_calls": [call]}, {"content": "Done."}, {"content": "Revised."}]}


def to_approval(client: Client, db: Database, name: str, request_id: str, request: dict[str, Any]) -> Any:
    agent = client.create_agent(name)
    client.submit(agent.id, request_id, request)
    run_all(db)
    state = client.get_state(agent.id)
    assert state.phase == "waiting_approval", state
    return state


def slack_messages(db: Database) -> dict[str, dict[str, Any]]:
    with db.connection() as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        rows = cur.execute("SELECT key, destination, payload FROM outbox WHERE channel = 'slack'").fetchall()
        conn.rollback()
    return {r["key"]: r for r in rows}


def transitions(db: Database, agent_id: Any) -> list[tuple[str, str, str, dict[str, Any]]]:
    with db.connection() as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        rows = cur.execute(
            "SELECT kind, event, decision, details FROM audit.journal WHERE agent_id = %s ORDER BY seq", (agent_id,)
        ).fetchall()
        conn.rollback()
    return [(r["kind"], r["event"], r["decision"], r["details"]) for r in rows]


# --- someone is told ----------------------------------------------------------------------------------------------


def test_the_waiting_notice_is_sent_once_even_when_the_gate_is_delivered_twice(
    told: None, client: Client, db: Database
) -> None:
    body = "Fixed; token xoxb-1234-secret-abcdef"
    waiting = to_approval(client, db, "release-bot", "req-1", comment_script(body))
    # The broker delivers the gate's message again (Redis redelivers): the second delivery sends nothing.
    Runner(db, registry, worker="t2", lease=timedelta(seconds=30), rules=dict(FAST_RULES)).run(
        scoped(waiting.id, f"req-1:gate:{GATE}")
    )
    notices = {k: m for k, m in slack_messages(db).items() if k.endswith("@approval")}
    assert list(notices) == [scoped(waiting.id, f"req-1:slack:gate.{GATE}@approval")]
    notice = notices[scoped(waiting.id, f"req-1:slack:gate.{GATE}@approval")]
    assert notice["destination"] == CHANNEL
    text = notice["payload"]["text"]
    assert "release-bot" in text and "github_comment" in text and '"acme/api"' in text
    assert "https://keel.example.com/agents/release-bot" in text
    assert "xoxb-1234-secret" not in text, "arguments are redacted"
    assert client.get_state(waiting.id).revision == waiting.revision

    client.approve(waiting.id, expected_revision=waiting.revision, actor="carol")
    decided = message_row(db, scoped(waiting.id, f"req-1:slack:gate.{GATE}@approval-decided"))
    assert decided is not None and decided["destination"] == CHANNEL
    assert "approved (by carol)" in decided["payload"]["text"]


def test_each_notice_reaches_slack_once(told: None, client: Client, db: Database) -> None:
    slack = FakeSlack(token="xoxb-test-approvals-token")
    slack.start()
    relay = Relay(
        db,
        {
            "slack": SlackSender("xoxb-test-approvals-token", f"{slack.url}/api/", timeout=2.0),
            "github": GitHubSender("ghp_unused", "http://127.0.0.1:9", timeout=1.0),
        },
        lease=timedelta(seconds=10),
        concurrency=2,
        backoff=Backoff(0.05, 0.2, 6, 50),
        pass_seconds=10,
    )
    try:
        waiting = to_approval(client, db, "courier", "req-1", comment_script())
        Runner(db, registry, worker="t2", lease=timedelta(seconds=30), rules=dict(FAST_RULES)).run(
            scoped(waiting.id, f"req-1:gate:{GATE}")
        )
        client.approve(waiting.id, expected_revision=waiting.revision, actor="carol")
        for _ in range(3):
            relay.run_pass()
        delivered = slack.delivered_keys()
        assert delivered[scoped(waiting.id, f"req-1:slack:gate.{GATE}@approval")] == 1
        assert delivered[scoped(waiting.id, f"req-1:slack:gate.{GATE}@approval-decided")] == 1
    finally:
        relay.close()
        slack.stop()


def test_a_rejection_is_followed_up_and_no_channel_means_no_message(told: None, client: Client, db: Database) -> None:
    waiting = to_approval(client, db, "reviewer", "req-1", comment_script())
    client.reject(waiting.id, expected_revision=waiting.revision, actor="dana", reason="not on a Friday")
    decided = message_row(db, scoped(waiting.id, f"req-1:slack:gate.{GATE}@approval-decided"))
    assert decided is not None and "rejected: not on a Friday (by dana)" in decided["payload"]["text"]


def test_without_a_channel_nobody_is_messaged(client: Client, db: Database) -> None:
    loop._settings.cache_clear()
    waiting = to_approval(client, db, "quiet", "req-1", comment_script())
    client.approve(waiting.id, expected_revision=waiting.revision, actor="carol")
    assert slack_messages(db) == {}


# --- edit and approve ---------------------------------------------------------------------------------------------


def test_edited_arguments_are_checked_journaled_and_told_to_the_model(client: Client, db: Database) -> None:
    waiting = to_approval(client, db, "editor", "req-1", comment_script("Fixed"))
    before = transitions(db, waiting.id)
    with pytest.raises(InvalidInput, match="issue"):
        client.approve(
            waiting.id,
            expected_revision=waiting.revision,
            actor="erin",
            arguments={"repository": "acme/api", "issue": 0, "body": "x"},
        )
    with pytest.raises(InvalidInput, match="JSON object"):
        client.approve(waiting.id, expected_revision=waiting.revision, actor="erin", arguments=["x"])  # type: ignore[arg-type]
    assert transitions(db, waiting.id) == before, "a refused edit changes nothing"
    assert client.get_state(waiting.id).revision == waiting.revision

    edited = {"repository": "acme/api", "issue": 7, "body": "Fixed in v2.1"}
    client.approve(waiting.id, expected_revision=waiting.revision, actor="erin", arguments=edited)
    approve = [t for t in transitions(db, waiting.id) if t[1] == "approve"]
    assert len(approve) == 1
    details = approve[0][3]
    assert details["call"]["arguments"]["body"] == "Fixed" and details["edited_arguments"] == edited
    run_all(db)
    assert client.get_state(waiting.id).phase == "done"
    sent = message_row(db, scoped(waiting.id, "req-1:github:tool.github_comment:1.call_0_0@comment"))
    assert sent is not None and sent["payload"]["body"] == "Fixed in v2.1"
    _, messages = loop.conversation(db, waiting.id, "req-1", scoped(waiting.id, "req-1:plan:2"))
    told = messages[-1]["content"]
    assert 'body: "Fixed" → "Fixed in v2.1"' in told and "A person edited" in told


def test_an_edit_over_http_is_a_422_naming_the_field_and_changes_nothing(api: Api) -> None:
    with api.http(api.token("approver", "operator", name="alice")) as http:
        state = waiting_agent(api, http)
        url = f"/v1/agents/{state['id']}/approve"
        etag = {"If-Match": f'"r{state["revision"]}"'}
        bad = problem(
            http.post(url, headers=etag, json={"arguments": {"repository": "acme/api", "issue": "x"}}),
            422,
            "invalid-input",
        )
        assert "issue" in bad["detail"]
        assert http.get(f"/v1/agents/{state['id']}").json()["revision"] == state["revision"]
        edited = {"repository": "acme/api", "issue": 8, "body": "Edited"}
        done = http.post(url, headers=etag, json={"arguments": edited})
        assert done.status_code == 200, done.text
        assert done.json()["phase"] == "executing"
        call = scoped(UUID(state["id"]), "commenter-r1:tool:github_comment:1.call_0_0")
        assert job_row(api.db, call)["payload"]["arguments"] == edited  # type: ignore[index]


def test_the_http_client_edits_and_lists_like_the_client(api: Api, client: Client) -> None:
    secret = api.token("approver", "operator", name="frank")
    with HttpClient(api.url, secret) as keel:
        bot = keel.create_agent("http-editor")
        keel.submit(bot.id, "http-r1", COMMENT)
        run_all(api.db)
        inbox = keel.approvals(tool="github_comment")
        assert [(a.agent, a.revision) for a in inbox.approvals] == [("http-editor", keel.get_state(bot.id).revision)]
        with pytest.raises(InvalidInput, match="issue"):
            keel.approve(
                bot.id,
                expected_revision=inbox.approvals[0].revision,
                arguments={"repository": "acme/api", "issue": -1, "body": "x"},
            )
        edited = {"repository": "acme/api", "issue": 9, "body": "Edited over HTTP"}
        state = keel.approve(bot.id, expected_revision=inbox.approvals[0].revision, arguments=edited)
        assert state.phase == "executing"
        assert keel.approvals().approvals == ()
    approve = [t for t in transitions(api.db, bot.id) if t[1] == "approve" and t[0] == "transition"]
    assert approve[0][3]["edited_arguments"] == edited


def test_the_command_line_lists_and_edits(db_url: str, client: Client, db: Database) -> None:
    waiting = to_approval(client, db, "cli-editor", "req-1", comment_script())
    env = clean_env()
    env["KEEL_DATABASE_URL"] = db_url

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return run_keel(args, env)

    listed = run("approvals", "--agent-prefix", "cli-")
    assert listed.returncode == 0, listed.stderr
    assert (
        "cli-editor" in listed.stdout and f"r{waiting.revision}" in listed.stdout and "github_comment" in listed.stdout
    )
    header = listed.stdout.splitlines()[0].split()
    assert header == ["agent", "revision", "tool", "waiting", "since", "arguments"], listed.stdout  # a header row
    as_json = json.loads(run("approvals", "--json").stdout)
    assert as_json["approvals"][0]["agent"] == "cli-editor"
    revision = str(waiting.revision)
    bad = run("approve", "cli-editor", "--revision", revision, "--arguments", '{"repository": "acme/api"}')
    assert bad.returncode != 0 and "issue" in bad.stderr
    assert run("approve", "cli-editor", "--revision", revision, "--arguments", "[1]").returncode != 0
    assert client.get_state(waiting.id).revision == waiting.revision
    edited = '{"repository": "acme/api", "issue": 7, "body": "From the shell"}'
    done = run("approve", "cli-editor", "--revision", revision, "--arguments", edited)
    assert done.returncode == 0, done.stderr
    call = scoped(waiting.id, "req-1:tool:github_comment:1.call_0_0")
    assert job_row(db, call)["payload"]["arguments"]["body"] == "From the shell"  # type: ignore[index]
    assert "no calls are waiting" in run("approvals").stdout


# --- approval timeouts --------------------------------------------------------------------------------------------


def _wait_until_past_timeout(db: Database) -> None:
    deadline = time.monotonic() + 30
    while not calls_past_approval_timeout(db):
        assert time.monotonic() < deadline, "the approval timeout never passed"
        time.sleep(0.2)


def test_a_timeout_rejects_exactly_once_under_two_concurrent_enforcers(
    told: None, client: Client, db: Database
) -> None:
    waiting = to_approval(client, db, "deployer", "req-1", deploy_script())
    _wait_until_past_timeout(db)
    settings = Settings()
    barrier = threading.Barrier(2)
    reports = []

    def beat() -> None:
        barrier.wait()
        reports.append(enforce_timeouts(db, settings))

    beats = [threading.Thread(target=beat) for _ in range(2)]
    for b in beats:
        b.start()
    for b in beats:
        b.join(60)
    assert sum(len(r.rejected) for r in reports) == 1
    assert enforce_timeouts(db, settings).rejected == [], "a restarted beat finds nothing left to do"
    rejects = [t for t in transitions(db, waiting.id) if t[0] == "transition" and t[1] == "reject"]
    assert len(rejects) == 1 and rejects[0][2] == "approval_timed_out"
    decided = message_row(db, scoped(waiting.id, "req-1:slack:gate.deploy_service:1.call_0_0@approval-decided"))
    assert decided is not None and "timed out" in decided["payload"]["text"]
    run_all(db)
    assert client.get_state(waiting.id).phase == "done"
    _, messages = loop.conversation(db, waiting.id, "req-1", scoped(waiting.id, "req-1:plan:2"))
    assert messages[-1]["content"].startswith("This call was rejected: no one approved it within 0:00:01")
    call = scoped(waiting.id, "req-1:tool:deploy_service:1.call_0_0")
    assert job_row(db, call) is None, "the timed-out call never ran"


def test_a_timeout_pass_takes_its_calls_in_batches_and_a_failing_one_does_not_stall_it(
    told: None, client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass reads the timed-out calls ``batch`` at a time, oldest first, each batch after the last one's keyset:
    all five are rejected in one pass of batches of two, and the one whose move fails is tried once in that pass,
    not read again (nor does it hold back the calls behind it)."""
    from agents.runtime import approvals

    waiting = [to_approval(client, db, f"deployer-{i}", f"req-{i}", deploy_script()) for i in range(5)]
    _wait_until_past_timeout(db)
    while len(calls_past_approval_timeout(db)) < 5:
        time.sleep(0.2)
    sick = waiting[1].id
    queries: list[int | None] = []
    real_read, real_transition = approvals.calls_past_approval_timeout, approvals.core.transition
    tried: list[Any] = []

    def reading(db_: Database, **kw: Any) -> Any:
        queries.append(kw.get("limit"))
        return real_read(db_, **kw)

    def moving(db_: Database, command: Command, **kw: Any) -> Any:
        tried.append(command.agent_id)
        if command.agent_id == sick:
            raise RuntimeError("a bug in one agent's move")
        return real_transition(db_, command, **kw)

    monkeypatch.setattr(approvals, "calls_past_approval_timeout", reading)
    monkeypatch.setattr(approvals.core, "transition", moving)
    report = enforce_timeouts(db, Settings(), batch=2)
    assert sorted(map(str, report.rejected)) == sorted(str(w.id) for w in waiting if w.id != sick)
    assert report.failed == [sick]
    assert tried.count(sick) == 1, "the failing call is tried once per pass"
    assert queries == [2, 2, 2], "three batches of at most two"
    with pytest.raises(InvalidInput, match="batch must be at least 1"):
        enforce_timeouts(db, Settings(), batch=0)


def test_a_timeout_escalates_once_and_the_call_keeps_waiting(client: Client, db: Database) -> None:
    waiting = to_approval(client, db, "pager", "req-1", deploy_script("page_oncall"))
    _wait_until_past_timeout(db)
    settings = Settings(approval_escalation_slack_channel=ESCALATION)
    barrier = threading.Barrier(2)
    reports = []

    def beat() -> None:
        barrier.wait()
        reports.append(enforce_timeouts(db, settings))

    beats = [threading.Thread(target=beat) for _ in range(2)]
    for b in beats:
        b.start()
    for b in beats:
        b.join(60)
    assert sum(len(r.escalated) for r in reports) == 1
    assert enforce_timeouts(db, settings).escalated == []
    assert calls_past_approval_timeout(db) == []
    state = client.get_state(waiting.id)
    assert state.phase == "waiting_approval" and state.pending_approval is not None
    escalations = [t for t in transitions(db, waiting.id) if t[2] == "approval_escalated" and t[0] == "transition"]
    assert len(escalations) == 1
    notice = message_row(db, scoped(waiting.id, "req-1:slack:gate.page_oncall:1.call_0_0@approval-escalated"))
    assert notice is not None and notice["destination"] == ESCALATION and "pager" in notice["payload"]["text"]
    client.approve(waiting.id, expected_revision=state.revision, actor="oncall-lead")
    run_all(db)
    assert client.get_state(waiting.id).phase == "done"


def test_a_tool_refuses_an_approval_timeout_it_cannot_use() -> None:
    with pytest.raises(ValueError, match="needs_approval"):
        tool("no_gate", approval_timeout=timedelta(seconds=5))
    with pytest.raises(ValueError, match="on_timeout"):
        tool("odd_gate", needs_approval=True, approval_timeout=timedelta(seconds=5), on_timeout="ignore")


# --- the inbox ----------------------------------------------------------------------------------------------------


def test_the_inbox_lists_waiting_calls_oldest_first_filtered_and_paged(client: Client, db: Database) -> None:
    first = to_approval(client, db, "team-a-one", "req-1", comment_script())
    second = to_approval(client, db, "team-b-two", "req-2", deploy_script())
    third = to_approval(client, db, "team-a-three", "req-3", comment_script())
    client.create_agent("team-a-idle")
    page = client.approvals()
    assert [a.agent for a in page.approvals] == ["team-a-one", "team-b-two", "team-a-three"]
    assert page.approvals[0].revision == first.revision and page.approvals[0].tool == "github_comment"
    assert page.approvals[1].arguments == {"service": "api", "replicas": 2}
    assert [a.agent for a in client.approvals(tool="deploy_service").approvals] == ["team-b-two"]
    assert [a.agent for a in client.approvals(agent_prefix="team-a-").approvals] == ["team-a-one", "team-a-three"]
    assert client.approvals(min_age=timedelta(hours=1)).approvals == ()
    one = client.approvals(limit=1)
    assert [a.agent for a in one.approvals] == ["team-a-one"] and one.next
    rest = client.approvals(limit=2, after=one.next)
    assert [a.agent for a in rest.approvals] == ["team-b-two", "team-a-three"] and rest.next is None
    with pytest.raises(InvalidInput, match="cursor"):
        client.approvals(after="nonsense")
    client.approve(second.id, expected_revision=second.revision, actor="x")
    assert [a.agent for a in client.approvals().approvals] == ["team-a-one", "team-a-three"]
    assert third.id in {a.agent_id for a in client.approvals().approvals}


def test_the_inbox_query_uses_the_indexes(client: Client, db: Database) -> None:
    from models.approvals_sql import _WAITING

    with db.connection() as conn:
        conn.execute("SET enable_seqscan = off")
        plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + _WAITING + " ORDER BY g.finished_at, a.id"))
        conn.rollback()
    assert "ix_agents_waiting" in plan and "ix_jobs_gates" in plan, plan


def test_the_inbox_over_http_keeps_to_the_tokens_scopes_and_prefix(api: Api) -> None:
    with api.http(api.token("operator", name="ops")) as http:
        waiting_agent(api, http, "team-a-bot")
        waiting_agent(api, http, "team-b-bot")
    for scope in ("approver", "operator", "auditor"):
        with api.http(api.token(scope, name=f"all-{scope}")) as http:
            listed = http.get("/v1/approvals")
            assert listed.status_code == 200, listed.text
            assert [a["agent"] for a in listed.json()["approvals"]] == ["team-a-bot", "team-b-bot"]
    with api.http(api.token("approver", prefix="team-a-", name="team-a-approver")) as http:
        assert [a["agent"] for a in http.get("/v1/approvals").json()["approvals"]] == ["team-a-bot"]
        assert http.get("/v1/approvals", params={"agent_prefix": "team-b-"}).json()["approvals"] == []
        assert (
            http.get("/v1/approvals", params={"agent_prefix": "team"}).json()["approvals"][0]["agent"] == "team-a-bot"
        )
    with api.http(api.token("producer", name="ingest")) as http:
        problem(http.get("/v1/approvals"), 403, "forbidden")
    with api.http(api.token("auditor", name="filters")) as http:
        found = http.get("/v1/approvals", params={"tool": "github_comment", "min_age_seconds": 3600})
        assert found.status_code == 200 and found.json()["approvals"] == []


def test_the_leading_beat_applies_approval_timeouts(
    client: Client, db: Database, db_url: str, broker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery import Celery

    from tasks.app import celery_config
    from tasks.dispatcher import KeelScheduler

    waiting = to_approval(client, db, "beat-timed", "req-1", deploy_script())
    _wait_until_past_timeout(db)
    for name, value in {"KEEL_DATABASE_URL": db_url, **broker.env}.items():
        monkeypatch.setenv(name, value)
    app = Celery("approvals-test", set_as_current=False)
    app.conf.update(celery_config(Settings()))
    beat = KeelScheduler(app=app)
    try:
        beat.tick()
    finally:
        beat.close()
    state = client.get_state(waiting.id)
    assert state.phase == "planning" and state.pending_approval is None
    assert [t[2] for t in transitions(db, waiting.id) if t[1] == "reject"] == ["approval_timed_out"]


# --- a wait's notices are followed up, however it ends --------------------------------------------------------------

PAGE_GATE = "page_oncall:1.call_0_0"


def _escalated(client: Client, db: Database, name: str) -> Any:
    """An agent whose call to page_oncall waited past its approval timeout and was escalated to ESCALATION."""
    waiting = to_approval(client, db, name, "req-1", deploy_script("page_oncall"))
    _wait_until_past_timeout(db)
    assert enforce_timeouts(db, Settings(approval_escalation_slack_channel=ESCALATION)).escalated == [waiting.id]
    return client.get_state(waiting.id)


def test_a_decision_after_an_escalation_is_followed_up_on_both_channels(
    told: None, client: Client, db: Database
) -> None:
    state = _escalated(client, db, "pager")
    client.approve(state.id, expected_revision=state.revision, actor="oncall-lead")
    first = message_row(db, scoped(state.id, f"req-1:slack:gate.{PAGE_GATE}@approval-decided"))
    second = message_row(db, scoped(state.id, f"req-1:slack:gate.{PAGE_GATE}@approval-escalation-decided"))
    assert first is not None and first["destination"] == CHANNEL
    assert second is not None and second["destination"] == ESCALATION
    assert "pager's call to page_oncall: approved (by oncall-lead)" in second["payload"]["text"]
    approve = [t for t in transitions(db, state.id) if t[0] == "transition" and t[1] == "approve"]
    assert sorted(approve[0][3]["messages"]) == sorted([first["key"], second["key"]])


def test_a_decision_without_an_escalation_is_followed_up_on_the_first_channel_only(
    told: None, client: Client, db: Database
) -> None:
    waiting = to_approval(client, db, "reviewer", "req-1", comment_script())
    client.reject(waiting.id, expected_revision=waiting.revision, actor="dana", reason="no")
    assert [k for k in slack_messages(db) if "decided" in k] == [
        scoped(waiting.id, f"req-1:slack:gate.{GATE}@approval-decided")
    ]


def test_a_cancel_while_waiting_tells_both_channels_the_wait_ended(told: None, client: Client, db: Database) -> None:
    state = _escalated(client, db, "pager")
    client.cancel(state.id, expected_revision=state.revision, actor="dana", reason="wrong service")
    first = message_row(db, scoped(state.id, f"req-1:slack:gate.{PAGE_GATE}@approval-ended"))
    second = message_row(db, scoped(state.id, f"req-1:slack:gate.{PAGE_GATE}@approval-escalation-ended"))
    assert first is not None and first["destination"] == CHANNEL
    assert second is not None and second["destination"] == ESCALATION
    text = first["payload"]["text"]
    assert text == second["payload"]["text"]
    assert "pager's call to page_oncall" in text and "no longer waits for approval" in text
    assert "the request was cancelled: wrong service (by dana)" in text and "Approve" not in text
    assert not [k for k in slack_messages(db) if "decided" in k]
    cancel = [t for t in transitions(db, state.id) if t[0] == "transition" and t[1] == "cancel"]
    assert sorted(cancel[0][3]["messages"]) == sorted([first["key"], second["key"]])


def test_a_stop_at_the_hard_deadline_while_waiting_is_followed_up_once(
    told: None, client: Client, db: Database
) -> None:
    agent = client.create_agent("late")
    client.submit(agent.id, "req-1", comment_script(), hard_deadline=timedelta(hours=1))
    run_all(db)
    assert client.get_state(agent.id).phase == "waiting_approval"
    with db.connection() as conn:
        later = conn.execute("SELECT now() + interval '2 hours'").fetchone()[0]  # type: ignore[index]
        conn.rollback()
    assert deadlines.enforce(db, later).stopped == [agent.id]
    assert deadlines.enforce(db, later).stopped == []
    ended = message_row(db, scoped(agent.id, f"req-1:slack:gate.{GATE}@approval-ended"))
    assert ended is not None and ended["destination"] == CHANNEL
    assert "the request passed its hard deadline and was stopped (by deadline-enforcer)" in ended["payload"]["text"]
    assert [k for k in slack_messages(db) if "approval" in k] == [
        scoped(agent.id, f"req-1:slack:gate.{GATE}@approval"),
        scoped(agent.id, f"req-1:slack:gate.{GATE}@approval-ended"),
    ]
    never = scoped(agent.id, f"req-1:slack:gate.{GATE}@approval-escalation-ended")
    assert message_row(db, never) is None  # it was never escalated


def test_a_cancel_without_a_notice_sends_nothing(client: Client, db: Database) -> None:
    loop._settings.cache_clear()
    waiting = to_approval(client, db, "quiet", "req-1", comment_script())
    client.cancel(waiting.id, expected_revision=waiting.revision, actor="dana")
    assert slack_messages(db) == {}


def test_the_conversation_that_led_to_a_held_call_of_keels_own_loop(client: Client, db: Database) -> None:
    """Keel's own loop reads the same as an integration's (tests/integration/test_pydantic_ai.py): the prompt, each
    reply with its calls, each tool's result."""
    agent = client.create_agent("talker")
    post = {"name": "slack_post", "arguments": {"channel": "C0PS", "text": "looking"}}
    comment = {"name": "github_comment", "arguments": {"repository": "acme/api", "issue": 7, "body": "Fixed"}}
    script = [{"tool_calls": [post]}, {"content": "Posted; now the issue.", "tool_calls": [comment]}]
    client.submit(agent.id, "req-1", {"prompt": "fix A-1", "script": [*script, {"content": "Done."}]})
    run_all(db)
    assert client.get_state(agent.id).phase == "waiting_approval"
    said = client.conversation(agent.id, "req-1")
    assert [m["role"] for m in said] == ["user", "assistant", "tool", "assistant"]
    assert said[0]["content"] == "fix A-1"
    assert said[1]["calls"] == [{"tool": "slack_post", "arguments": {"channel": "C0PS", "text": "looking"}}]
    assert said[3]["content"] == "Posted; now the issue." and said[3]["calls"][0]["tool"] == "github_comment"
