"""Property-based tests of the live API from its own OpenAPI schema (Schemathesis): whatever it is sent, it answers
without a 5xx, with a status the schema documents, a body that matches it, and the documented content type."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agents.client import Client
from tests.support.api import Api, script
from tests.support.audit import clean_env

pytestmark = pytest.mark.integration

SCHEMATHESIS = str(Path(sys.executable).parent / "schemathesis")
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


@pytest.mark.timeout(900)
def test_no_5xx_and_every_response_matches_the_schema(api: Api, client: Client, tmp_path: Path) -> None:
    # Something to find: agents in several phases, a request with jobs, so lookups by name succeed sometimes.
    agent = client.create_agent("fuzzed")
    client.submit(agent.id, "fuzz-1", script({"content": "hi"}))
    client.create_agent("idle-one")
    secret = api.token("producer", "approver", "operator", "auditor", name="fuzzer")
    env = clean_env()
    env["HOME"] = str(tmp_path)  # schemathesis keeps its own state under the home directory
    found = subprocess.run(
        [
            SCHEMATHESIS,
            "run",
            f"{api.url}/openapi.json",
            "--checks",
            CHECKS,
            "--header",
            f"Authorization: Bearer {secret}",
            "--max-examples",
            os.environ.get("KEEL_TEST_FUZZ_EXAMPLES", "25"),
            "--seed",
            "1",
            "--generation-deterministic",
            "--request-timeout",
            "30",
            "--workers",
            "2",
            "--warnings",
            "off",
            "--exclude-path",
            "/v1/agents/{agent}/events",  # a stream that never ends: tests/integration/test_api_events.py
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=840,
    )
    assert found.returncode == 0, found.stdout[-6000:] + found.stderr[-2000:]
    assert "Traceback" not in api.log(), api.log()[-4000:]
