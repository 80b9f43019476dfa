"""The HTTP guide's example (docs/how-to/http-api.md, "Submit a request"), run as written against a real
``keel serve`` on the embedded defaults' model: the token it creates, its curl commands, and the request it submits
answered by the stand-in model once a worker runs it (it used to fail: the scripted provider needed a script)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.api import Api
from tests.support.cli import keel
from tests.support.runs import run_all

pytestmark = pytest.mark.integration

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "http-api.md"


def submit_example() -> list[str]:
    """The section's shell block as command lines (continuations joined)."""
    section = GUIDE.read_text().split("## Submit a request", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_the_http_guides_submit_example_runs_as_written(api: Api, db_url: str, db: Any) -> None:
    lines = submit_example()
    assert lines[0].startswith("keel token create ingest --scope producer")
    created = keel(db_url, *shlex.split(lines[0].split("#", 1)[0])[1:])
    secret = re.search(r"^secret: (\S+)$", created.stdout, re.M)
    assert secret is not None, created.stdout
    assert lines[1] == "export TOKEN=keel_…"  # the secret the line above printed
    host = api.url.removeprefix("http://")
    answers = []
    for line in lines[2:]:
        assert line.startswith("curl "), line
        done = subprocess.run(
            ["bash", "-c", line.replace("localhost:8000", host)],
            env={"PATH": "/usr/bin:/bin", "TOKEN": secret.group(1)},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        answers.append(json.loads(done.stdout))
    agent, request, read = answers
    assert agent["name"] == "analyst" and agent["phase"] == "idle", agent
    assert (request["request_id"], request["operation"]) == ("req-1", "plan"), request
    assert read["outcome"]["phase"] == "planning", read
    for _ in range(3):
        run_all(db)
    again = subprocess.run(
        ["bash", "-c", lines[-1].replace("localhost:8000", host)],
        env={"PATH": "/usr/bin:/bin", "TOKEN": secret.group(1)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    outcome = json.loads(again.stdout)["outcome"]
    assert outcome["phase"] == "done", outcome
    assert outcome["answer"].startswith("[stand-in model] You asked: 'Summarise open incidents'"), outcome
