"""A real ``keel serve`` (uvicorn) process on the test's own database and Redis prefix, and tokens to call it with."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from agents.ingress.tokens import create_token
from models.db import Database
from tests.support.audit import clean_env
from tests.support.broker import Broker
from tests.support.cli import Forked, fork_keel
from tests.support.ports import free_port
from tests.support.runs import run_all

ROOT = Path(__file__).resolve().parents[2]
KEEL = str(Path(sys.executable).parent / "keel")


class Api:
    """One running API process: ``url``, ``token(...)`` for a secret, ``http(secret)`` for a client, ``log()``."""

    def __init__(self, db: Database, url: str, proc: Forked, log: Path) -> None:
        self.db = db
        self.url = url
        self.proc = proc
        self.log_path = log
        self._n = 0

    def token(self, *scopes: str, prefix: str | None = None, name: str | None = None) -> str:
        """A new token's secret."""
        self._n += 1
        _, secret = create_token(
            self.db, name or f"t{self._n}-{'-'.join(scopes)}", list(scopes), agent_prefix=prefix, actor="test"
        )
        return secret

    def http(self, secret: str | None = None, **kwargs: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30, **kwargs)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def running_api(
    db: Database,
    db_url: str,
    broker: Broker,
    logs: Path,
    *,
    env: dict[str, str] | None = None,
    args: Sequence[str] = (),
    ready: str = "/readyz",
) -> Iterator[Api]:
    """Start ``keel serve`` and wait until ``ready`` (``/readyz``: ready to serve) answers 200; stop it (by pid,
    SIGTERM then SIGKILL) after."""
    port = free_port()
    child_env = clean_env()
    child_env.update(
        {
            "KEEL_DATABASE_URL": db_url,
            **broker.env,
            "KEEL_IMPORTS": '["tests.support.handlers"]',
            "PYTHONPATH": str(ROOT),
            **(env or {}),
        }
    )
    log = logs / f"api-{port}.log"
    with open(log, "ab") as out, open(os.devnull, "rb") as nothing:
        # A fork of this process, which has Keel imported: no interpreter start per test (tests/support/cli.py).
        proc = fork_keel(
            ["serve", "--port", str(port), "-l", "warning", *args],
            child_env,
            logs,
            stdin=nothing.fileno(),
            stdout=out.fileno(),
            stderr=out.fileno(),
            new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    api = Api(db, url, proc, log)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"keel serve exited with {proc.returncode}:\n{api.log()}")
            try:
                if httpx.get(f"{url}{ready}", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"keel serve not ready in 60 s:\n{api.log()}")
            time.sleep(0.1)
        yield api
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


PROBLEM = "application/problem+json"


def script(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"prompt": "Summarise open incidents", "script": list(entries)}


COMMENT = script(
    {"tool_calls": [{"name": "github_comment", "arguments": {"repository": "acme/api", "issue": 7, "body": "Fixed"}}]},
    {"content": "Commented."},
    {"content": "Understood, no comment."},
)


def journal_count(db: Database) -> int:
    with db.connection() as conn:
        (n,) = conn.execute("SELECT count(*) FROM audit.journal").fetchone()  # type: ignore[misc]
        conn.rollback()
    return int(n)


def problem(response: httpx.Response, status: int, slug: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    body: dict[str, Any] = response.json()
    assert body["type"] == f"/problems/{slug}", body
    assert body["status"] == status and body["title"] and body["detail"]
    assert "Traceback" not in response.text
    return body


def waiting_agent(api: Api, http: httpx.Client, name: str = "commenter") -> dict[str, Any]:
    created = http.post("/v1/agents", json={"name": name})
    assert created.status_code == 201, created.text
    agent = created.json()
    submitted = http.post(
        f"/v1/agents/{agent['id']}/requests", json={"input": COMMENT}, headers={"Idempotency-Key": f"{name}-r1"}
    )
    assert submitted.status_code == 201, submitted.text
    run_all(api.db)
    state = http.get(f"/v1/agents/{agent['id']}").json()
    assert state["phase"] == "waiting_approval", state
    return state  # type: ignore[no-any-return]
