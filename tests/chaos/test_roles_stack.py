"""The whole stack in production mode as the application role: `keel serve`, a job worker, the relay's worker and
beat log in as the role that may only read the journal and append to it (tests/integration/test_roles.py shows each
way to rewrite it is closed to that role), and an agent's request still goes through to done, with its Slack post
delivered through the outbox, the beat's chores done, and not one privilege error in any process's log."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from models.db import Database
from tests.chaos.conftest import Stack, wait_until
from tests.support.api import running_api
from tests.support.audit import TEST_ENV, TEST_KEYS
from tests.support.broker import Broker
from tests.support.fakes import FakeSlack
from tests.support.roles import RoledDatabase, keel

pytestmark = pytest.mark.chaos

SLACK_TOKEN = "xoxb-roles-stack-token-000"
REPLIES = [
    {"tool_calls": [{"name": "slack_post", "arguments": {"channel": "C0ROLES", "text": "deployed"}}]},
    {"content": "Posted."},
]
PRIVILEGE_ERROR = re.compile(r"permission denied|InsufficientPrivilege|must be owner|refusing to run", re.IGNORECASE)


def test_the_whole_stack_runs_as_the_application_role(roles_db: RoledDatabase, broker: Broker, tmp_path: Path) -> None:
    names = roles_db.names
    slack = FakeSlack(token=SLACK_TOKEN).start()
    assert isinstance(slack, FakeSlack)
    stack = Stack(roles_db.app_url, broker, tmp_path, admin_url=roles_db.url)
    production = {
        "KEEL_ENVIRONMENT": "production",
        "KEEL_DB_OWNER_ROLE": names.owner,
        "KEEL_DB_APP_ROLE": names.app,
        "KEEL_DB_AUDITOR_ROLE": names.auditor,
        "KEEL_SLACK_TOKEN": SLACK_TOKEN,
        "KEEL_SLACK_API_URL": f"{slack.url}/api/",
        "KEEL_OUTBOX_INTERVAL_SECONDS": "0.2",
        "KEEL_KPI_FOLD_SECONDS": "0.5",
        "KEEL_ALERT_INTERVAL_SECONDS": "1",
        "KEEL_AUDIT_VERIFY_INTERVAL_SECONDS": "1",
        **TEST_ENV,
    }
    stack.env.update(production)
    db = Database(roles_db.app_url, pool_size=2, audit_keys=TEST_KEYS)
    try:
        stack.worker("jobs", queues="keel.jobs,keel.jobs.low")
        stack.worker("relay", queues="keel.outbox")
        stack.beat()
        api_env = {k: v for k, v in stack.env.items() if k.startswith("KEEL_") and k != "KEEL_IMPORTS"}
        cli_env = {k: v for k, v in api_env.items() if k != "KEEL_DATABASE_URL"}
        # An operator's command that writes, as the application role in production: a token for the producer.
        created = keel(roles_db.app_url, "token", "create", "deployer", "--scope", "producer", "--json", **cli_env)
        assert created.returncode == 0, created.stderr
        secret = json.loads(created.stdout)["secret"]
        with running_api(db, roles_db.app_url, broker, tmp_path, env=api_env) as api, api.http(secret) as http:
            agent = http.post("/v1/agents", json={"name": "deployer"})
            assert agent.status_code == 201, agent.text
            url = f"/v1/agents/{agent.json()['id']}"
            submitted = http.post(
                f"{url}/requests",
                json={"input": {"prompt": "Tell the channel", "script": REPLIES}},
                headers={"Idempotency-Key": "roles-r1"},
            )
            assert submitted.status_code == 201, submitted.text
            wait_until("the request to be done", lambda: http.get(url).json()["phase"] == "done", 90)
            # Nothing connects as anyone but the application role (this test's own queries aside).
            connected = stack.query(
                "SELECT DISTINCT usename FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid()"
            )
            assert set(connected) == {(names.app,)}
            api_log = api.log()
        wait_until("the Slack post", lambda: sum(slack.delivered_keys().values()) == 1, 60)
        wait_until("its confirmation", lambda: stack.query("SELECT count(*) FROM delivery_log") == [(1,)], 30)
        assert stack.query("SELECT status FROM outbox") == [("sent",)]
        # The leading beat's chores, as the application role: KPI folds, alert evaluation, its periodic verify.
        wait_until("a KPI fold", lambda: stack.query("SELECT count(*) > 0 FROM kpi_rollups") == [(True,)], 30)
        wait_until(
            "the beat's verify",
            lambda: (
                stack.query("SELECT count(*) > 0 FROM audit_verifications WHERE source = 'beat' AND ok") == [(True,)]
            ),
            30,
        )
        assert stack.query("SELECT count(*) > 0 FROM beat_terms") == [(True,)]
        # Read back as the auditor: every chain holds.
        verified = keel(roles_db.auditor_url, "audit", "verify", **cli_env)
        assert verified.returncode == 0 and verified.stdout.startswith("ok: "), verified.stdout + verified.stderr
    finally:
        stack.stop_all()
        db.dispose()
        slack.stop()
    logs = {name: stack.log(name) for name in ("jobs", "relay", "beat")} | {"api": api_log}
    for name, text in logs.items():
        assert not PRIVILEGE_ERROR.search(text), f"{name}:\n{text[-3000:]}"
