"""docs/how-to/python-client.md: its `Client` example, taken from the page itself, run as printed against this test's
database and broker (the HttpClient example on the same page is run by test_http_client.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agents.client import Client
from tests.support.audit import TEST_ENV
from tests.support.broker import Broker

pytestmark = pytest.mark.integration

PAGE = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "python-client.md"


def test_the_client_example_runs_as_printed(
    db_url: str, broker: Broker, client: Client, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    block = PAGE.read_text().split("<!-- python-client-example", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    for name, value in {**TEST_ENV, **broker.env, "KEEL_DATABASE_URL": db_url}.items():
        monkeypatch.setenv(name, value)
    namespace: dict[str, Any] = {}
    try:
        exec(compile(block, str(PAGE), "exec"), namespace)
    finally:
        namespace["client"].close()
    printed = capsys.readouterr().out.splitlines()
    # No worker runs here: the request is still planning when the example cancels it, so the cancel goes through.
    assert printed == [
        "req-42 True",
        "2 transition submit client",
        "3 suppressed submit client",
        "4 transition cancel alice",
    ]
    state = client.get_state("ops-bot")
    assert (state.phase, state.budget_tokens) == ("failed", 200_000)
