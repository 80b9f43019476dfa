"""README.md's "Your own agent", run as printed: its module is written to a directory of its own as `myagents.py`, and
its `keel` commands are run there by the real console script, with `KEEL_IMPORTS` as the README exports it and no
`PYTHONPATH`. A worker is what `keel up` would add: here the in-process runner, with the README's handler, runs the
job while `keel submit … --wait` waits for it."""

from __future__ import annotations

import shlex
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest

import agents.jobs.handlers as handlers
from agents.client import Client
from agents.core.policies import DEFAULT_RULES
from agents.jobs.runner import Runner
from models.db import Database
from models.jobs_sql import job_row
from tests.support.cli import KEEL, keel_env
from tests.support.keys import scoped

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"


def the_example() -> tuple[str, dict[str, str], list[list[str]]]:
    """The README's module, the variables its shell block exports, and its `keel` commands' arguments."""
    part = README.read_text().split("<!-- readme-agent-example", 1)[1]
    module = part.split("```python\n", 1)[1].split("```", 1)[0]
    shell = part.split("```sh\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    exported: dict[str, str] = {}
    commands = []
    for line in shell.splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["export"]:
            exported.update(word.split("=", 1) for word in words[1:])  # type: ignore[misc]
        elif words:
            assert words[0] == ".venv/bin/keel", line
            commands.append(words[1:])
    return module, exported, commands


def test_the_readmes_own_agent_runs_as_printed(
    tmp_path: Path, db_url: str, db: Database, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    module, exported, commands = the_example()
    assert list(exported) == ["KEEL_IMPORTS"] and commands[0] == ["up"]
    (tmp_path / "myagents.py").write_text(module)
    env = keel_env(db_url, **exported)
    env.pop("PYTHONPATH", None)

    def keel(args: list[str]) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [KEEL, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    created = keel(commands[1])
    out, err = created.communicate(timeout=120)
    assert created.returncode == 0, out + err
    agent = client.get_state(commands[1][-1])

    submitted = keel(commands[2])  # --wait: it returns once a worker has run the job
    key = scoped(agent.id, "r1:summarise:1")
    deadline = time.monotonic() + 120
    while job_row(db, key) is None:
        if submitted.poll() is not None or time.monotonic() > deadline:
            submitted.kill()
            pytest.fail("keel submit: " + "".join(submitted.communicate()))
        time.sleep(0.05)

    # What `keel up`'s worker does with KEEL_IMPORTS: import the module (into a registry of this test's own) and run
    # the job it names.
    own = handlers.Registry()
    monkeypatch.setattr(handlers, "registry", own)
    exec(compile(module, "myagents.py", "exec"), {"__name__": "myagents"})
    Runner(db, own, worker="readme", lease=timedelta(seconds=30), rules=dict(DEFAULT_RULES)).run(key)

    out, err = submitted.communicate(timeout=120)
    assert submitted.returncode == 0, out + err
    assert "done" in out, out
    job = job_row(db, key)
    assert job is not None and job["status"] == "succeeded"
    assert job["result"]["answer"] == "Keel runs each job once, however often Celery …"
    assert client.get_state(agent.id).phase == "done"
