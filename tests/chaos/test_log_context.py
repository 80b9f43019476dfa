"""One request through real processes — ``keel serve``, a job worker, the relay's worker and beat — with their JSON log
lines in files: each process's lines about the request carry its id, agent, job or outbox key; no secret is in any
line of the run."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit
from uuid import UUID

import httpx
import pytest

from agents.core.keys import request_key
from agents.demo.fake_servers import FakeLLM
from models.db import Database
from tests.chaos.conftest import Stack, wait_until
from tests.support.api import Api, running_api
from tests.support.audit import TEST_SECRET
from tests.support.broker import Broker
from tests.support.fakes import FakeGitHub, FakeSlack
from tests.support.keys import scoped
from tests.support.logs import log_lines

pytestmark = pytest.mark.chaos

# Secrets of no known shape: only Keel's registration of its settings can mask them.
SLACK_TOKEN = "opaque-slack-secret-4711"
GITHUB_TOKEN = "opaque-github-secret-0815"
LLM_KEY = "opaque-llm-secret-1234"
DB_PASSWORD = "opaque-db-password-9182"

REQUEST = "ctx-r1"
POST = {"channel": "C0LOGS", "text": "starting"}
COMMENT = {"repository": "acme/api", "issue": 7, "body": "ok"}
REPLIES = [
    {"tool_calls": [{"id": "call_s", "name": "slack_post", "arguments": json.dumps(POST)}]},
    {"tool_calls": [{"id": "call_g", "name": "github_comment", "arguments": json.dumps(COMMENT)}]},
    {"content": "Posted and commented."},
]
#: A job key or an outbox message key of the request, in a line's text (its agent's 32 hex digits lead it; a key
#: without them is caught too, and then names no key in the line's fields).
KEY = re.compile(rf"(?:[0-9a-f]{{32}}~)?{REQUEST}:[a-z_]+:[\w.:-]*[\w.-]")


@dataclass
class Run:
    """What a finished run left: each process's JSON lines and raw text, the agent's id, the secrets it used."""

    agent_id: str
    lines: dict[str, list[dict[str, Any]]]
    texts: dict[str, str]
    secrets: dict[str, str]


@pytest.fixture
def fakes() -> Iterator[tuple[FakeSlack, FakeGitHub, FakeLLM]]:
    slack, github = FakeSlack(token=SLACK_TOKEN).start(), FakeGitHub(token=GITHUB_TOKEN).start()
    llm = FakeLLM(token=LLM_KEY, replies=REPLIES).start()
    assert isinstance(slack, FakeSlack) and isinstance(github, FakeGitHub) and isinstance(llm, FakeLLM)
    yield slack, github, llm
    for fake in (slack, github, llm):
        fake.stop()


def with_password(url: str) -> tuple[str, str | None]:
    """``url`` with a password for its user (PostgreSQL's trust authentication ignores it), and that password;
    a URL that already has one keeps it."""
    parts = urlsplit(url)
    if parts.password or not parts.username or not parts.hostname:
        return url, parts.password
    netloc = parts.netloc.replace(f"{parts.username}@", f"{parts.username}:{DB_PASSWORD}@", 1)
    return urlunsplit(parts._replace(netloc=netloc)), DB_PASSWORD


def run_one_request(
    stack: Stack,
    db: Database,
    broker: Broker,
    fakes: tuple[FakeSlack, FakeGitHub, FakeLLM],
    loglevel: str,
    careless: bool = False,
) -> Run:
    slack, github, llm = fakes
    db_url, db_password = with_password(stack.db_url)
    stack.env.update(
        {
            "KEEL_DATABASE_URL": db_url,
            "KEEL_SLACK_TOKEN": SLACK_TOKEN,
            "KEEL_SLACK_API_URL": f"{slack.url}/api/",
            "KEEL_GITHUB_TOKEN": GITHUB_TOKEN,
            "KEEL_GITHUB_API_URL": github.url,
            "KEEL_LLM_PROVIDER": "openai",
            "KEEL_LLM_BASE_URL": f"{llm.url}/v1",
            "KEEL_LLM_MODEL": "fake-1",
            "KEEL_LLM_API_KEY": LLM_KEY,
        }
    )
    # KEEL_LOG_FORMAT is not set: a process writing to a file writes JSON lines.
    assert "KEEL_LOG_FORMAT" not in stack.env
    level = ["-l", loglevel]
    stack.start("worker", "worker", "-c", "1", "-n", "jobs@%h", "-Q", "keel.jobs,keel.jobs.low", *level)
    stack.start("relay", "worker", "-c", "1", "-n", "relay@%h", "-Q", "keel.outbox", *level)
    for name in ("worker", "relay"):
        wait_until(f"{name} ready", lambda name=name: "ready." in stack.log(name), 60)
    stack.start("beat", "beat", *level)
    api_env = {k: v for k, v in stack.env.items() if k.startswith("KEEL_") and k != "KEEL_IMPORTS"}
    with running_api(db, db_url, broker, stack.logs, env=api_env, args=level) as api:
        agent_id, token = run_through_the_api(api, slack, github)
        if careless:
            spill_through_the_api(api, stack, token, agent_id)
    stack.stop_all()
    texts = {name: stack.log(name) for name in ("worker", "relay", "beat")}
    texts["api"] = api.log()
    secrets = {
        "Slack token": SLACK_TOKEN,
        "GitHub token": GITHUB_TOKEN,
        "LLM key": LLM_KEY,
        "API token": token,
        "audit key": TEST_SECRET,
    }
    if db_password:
        secrets["database password"] = db_password
    return Run(agent_id, {name: log_lines(text) for name, text in texts.items()}, texts, secrets)


def run_through_the_api(api: Api, slack: FakeSlack, github: FakeGitHub) -> tuple[str, str]:
    """Create an agent, submit the request (a Slack post, then a GitHub comment a person approves), approve it, wait
    until it is done and both messages arrived. Returns the agent's id and the API token's secret."""
    secret = api.token("producer", "approver", name="ctx-caller")
    with api.http(secret) as http:
        agent = http.post("/v1/agents", json={"name": "ctx-agent"}).json()
        url = f"/v1/agents/{agent['id']}"
        submitted = http.post(
            f"{url}/requests", json={"input": {"prompt": "Deploy"}}, headers={"Idempotency-Key": REQUEST}
        )
        assert submitted.status_code == 201, submitted.text
        wait_until("the request to wait for approval", lambda: http.get(url).json()["phase"] == "waiting_approval", 90)
        state = http.get(url)
        approved = http.post(f"{url}/approve", headers={"If-Match": state.headers["ETag"]})
        assert approved.status_code == 200, approved.text
        wait_until("the request to be done", lambda: http.get(url).json()["phase"] == "done", 90)
        # A caller with a wrong secret: refused, and its header is not logged either.
        refused = httpx.get(f"{api.url}/v1/agents", headers={"Authorization": f"Bearer {secret[:-4]}zzzz"})
        assert refused.status_code == 401
    wait_until("the Slack post", lambda: sum(slack.delivered_keys().values()) == 1, 60)
    wait_until("the GitHub comment", lambda: sum(github.delivered_keys().values()) == 1, 60)
    return str(agent["id"]), secret


def spill_through_the_api(api: Api, stack: Stack, secret: str, agent_id: str) -> None:
    """What careless callers and code do: the API token in a URL's path and query, and a job that logs and raises
    every configured secret (tests/support/handlers.py ``spill``)."""
    with api.http(secret) as http:
        assert http.get(f"/v1/agents/{secret}").status_code == 404
        assert http.get("/v1/agents", params={"access_token": secret}).status_code == 200
        spilled = http.post(
            f"/v1/agents/{agent_id}/requests",
            json={"input": None, "operation": "spill"},
            headers={"Idempotency-Key": "ctx-spill"},
        )
        assert spilled.status_code == 201, spilled.text
    key = scoped(UUID(agent_id), "ctx-spill:spill:1")
    job = "SELECT status FROM jobs WHERE key = %s"
    wait_until("the spilling job to give up", lambda: stack.query(job, key) in ([("failed",)], [("dead",)]), 90)
    ended = re.compile(rf"job {re.escape(key)}: (failed|dead)")
    wait_until("the worker to say so", lambda: ended.search(stack.log("worker")), 30)


def test_every_line_about_the_request_names_it_in_every_process(
    stack: Stack, db: Database, broker: Broker, fakes: tuple[FakeSlack, FakeGitHub, FakeLLM]
) -> None:
    run = run_one_request(stack, db, broker, fakes, "info")
    ours = {name: [line for line in lines if line.get("request_id") == REQUEST] for name, lines in run.lines.items()}
    for name in ("api", "worker", "relay"):
        assert ours[name], f"no line of {name} names the request:\n{run.texts[name][-3000:]}"

    everything = [(name, line) for name, lines in run.lines.items() for line in lines]
    for name, line in everything:
        if line["logger"].startswith("celery.") and "job_key" in line:
            # Celery's "Task keel.run_job[KEY] received/succeeded" lines name the job and its request (from the task
            # id, the job's key), not its agent: Celery's process has not read the job.
            assert line["job_key"] in line["event"] and line["request_id"] == REQUEST, (name, line)
            continue
        if line.get("request_id") == REQUEST:
            assert line.get("agent_id") == run.agent_id, (name, line)
        if "job_key" in line or "outbox_key" in line:
            assert line["request_id"] == REQUEST and line["agent_id"] == run.agent_id, (name, line)
        # Keel's own lines that speak of the request's jobs or messages name them in their fields too.
        if line["logger"].startswith("keel") and (keys := KEY.findall(line["event"])):
            assert line.get("request_id") == REQUEST and line.get("agent_id") == run.agent_id, (name, line)
            assert keys[0] in (line.get("job_key"), line.get("outbox_key")), (name, line)

    api_lines = ours["api"]
    submit = [line for line in api_lines if "/requests" in line["event"] and line["logger"] == "uvicorn.access"]
    assert submit and submit[0]["actor"] == "ctx-caller", api_lines

    worker = ours["worker"]
    mine = request_key(UUID(run.agent_id), REQUEST)  # the request's key: every key of the request starts with it
    # The model's HTTP call ran on the job's own thread, inside the model call: the job's context followed it.
    model_calls = [line for line in worker if "chat/completions" in line["event"]]
    assert model_calls and all(line["job_key"].startswith(f"{mine}:plan:") for line in model_calls), worker
    received = [line for line in worker if line["event"].startswith(f"Task keel.run_job[{mine}:")]
    assert len(received) >= 10, worker  # received and succeeded, for each of the request's jobs
    finished = [line for line in worker if re.match(rf"job {re.escape(mine)}:\w+:\S+: succeeded", line["event"])]
    assert len(finished) >= 4 and all("job_key" in line for line in finished), worker  # 3 plans, 2 tools

    # The relay's HTTP call to GitHub ran inside the send: it names the message.
    sends = [line for line in ours["relay"] if "/comments" in line["event"]]
    assert sends and all(line["outbox_key"].startswith(f"{mine}:") for line in sends), ours["relay"]


def test_no_secret_reaches_any_line_of_a_full_run_even_at_debug(
    stack: Stack, db: Database, broker: Broker, fakes: tuple[FakeSlack, FakeGitHub, FakeLLM]
) -> None:
    run = run_one_request(stack, db, broker, fakes, "debug", careless=True)
    assert sum(len(lines) for lines in run.lines.values()) > 100, "a run at DEBUG says a lot"
    for what, secret in run.secrets.items():
        for name, text in run.texts.items():
            assert secret not in text, f"the {what} is in {name}'s log"
            assert json.dumps(secret)[1:-1] not in text
    # The careless job did log: its message, its key-values and its traceback, each masked.
    spilled = [line for line in run.lines["worker"] if line["logger"] == "keel.test.spill"]
    assert len(spilled) >= 3, spilled
    assert "***" in spilled[0]["event"] and "***" in spilled[1]["keel_slack_token"] and "***" in spilled[2]["exception"]
    # The API token in a path and a query: the access lines are there, masked.
    access = [line["event"] for line in run.lines["api"] if line["logger"] == "uvicorn.access"]
    assert any("/v1/agents/*** " in event for event in access) and any("access_token=***" in event for event in access)
