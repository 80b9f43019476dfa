"""JSON a person or producer sends is parsed and bounded by one rule at every door — the API's body, the console's
edit-and-approve form, the ``keel`` command's ``--input`` and ``--arguments``: nesting deeper than the limit is a
clear refusal naming it (422 over HTTP, one line from the command), never a ``RecursionError`` and a 500, and
nothing is written."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.routing import APIRoute

from agents.core.json_input import MAX_JSON_DEPTH
from agents.ingress.app import create_app
from agents.ingress.bodies import JsonBodyRoute
from tests.support.api import Api, journal_count, problem, waiting_agent
from tests.support.audit import clean_env
from tests.support.broker import Broker
from tests.support.cli import run_keel
from tests.support.console import Browsers, csrf_of

pytestmark = pytest.mark.integration

KEEL = str(Path(sys.executable).parent / "keel")
RULE = f"more than {MAX_JSON_DEPTH} deep"


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


#: Just over the limit (pydantic would refuse it in its own words), and far over it (json.loads would recurse out).
TOO_DEEP = (MAX_JSON_DEPTH + 1, 100_000)


@pytest.fixture
def browsers(api: Api) -> Iterator[Browsers]:
    found = Browsers(api)
    yield found
    found.close()


def _footprint(api: Api) -> tuple[Any, ...]:
    with api.db.connection() as conn:
        found = (
            conn.execute("SELECT count(*) FROM audit.journal").fetchone(),
            conn.execute("SELECT id, revision, phase FROM agents ORDER BY id").fetchall(),
            conn.execute("SELECT count(*) FROM requests").fetchone(),
        )
        conn.rollback()
    return found


@pytest.mark.parametrize("depth", TOO_DEEP)
def test_the_api_refuses_a_body_nested_too_deep_with_a_422(api: Api, depth: int) -> None:
    with api.http(api.token("operator")) as http:
        agent = http.post("/v1/agents", json={"name": "deep"}).json()
        before = _footprint(api)
        body = '{"input": {"prompt": "hi", "x": ' + nested(depth) + "}}"
        answer = http.post(
            f"/v1/agents/{agent['id']}/requests",
            content=body,
            headers={"Idempotency-Key": "r1", "Content-Type": "application/json"},
        )
        refused = problem(answer, 422, "invalid-input")
        assert RULE in refused["detail"], refused
    with api.http(api.token("approver")) as http:
        edit = http.post(
            f"/v1/agents/{agent['id']}/approve",
            content='{"arguments": {"a": ' + nested(depth) + "}}",
            headers={"If-Match": '"r1"', "Content-Type": "application/json"},
        )
        assert RULE in problem(edit, 422, "invalid-input")["detail"]
    assert _footprint(api) == before
    assert "Traceback" not in api.log()


def test_the_api_takes_json_nested_up_to_the_limit(api: Api) -> None:
    """A body nested exactly as deep as the limit passes the rule (and meets the plan's input model instead)."""
    with api.http(api.token("operator")) as http:
        agent = http.post("/v1/agents", json={"name": "deep"}).json()
        body = '{"input": {"prompt": "hi", "x": ' + nested(MAX_JSON_DEPTH - 2) + "}}"
        answer = http.post(
            f"/v1/agents/{agent['id']}/requests",
            content=body,
            headers={"Idempotency-Key": "r1", "Content-Type": "application/json"},
        )
    refused = problem(answer, 422, "invalid-input")
    assert RULE not in refused["detail"] and "input.x: is not a field here" in refused["detail"], refused


@pytest.mark.parametrize("depth", TOO_DEEP)
def test_the_console_edit_form_refuses_arguments_nested_too_deep(api: Api, browsers: Browsers, depth: int) -> None:
    with api.http(api.token("operator")) as http:
        state = waiting_agent(api, http)
    client = browsers.signed_in(api.token("approver", name="erin"))
    page = client.get(f"/agents/{state['id']}")
    before = journal_count(api.db)
    typed = nested(min(depth, 40_000))  # within the form's size limit
    refused = client.post(
        f"/agents/{state['id']}/approve",
        data={"csrf": csrf_of(page), "revision": str(state["revision"]), "arguments": '{"a": ' + typed + "}"},
    )
    assert refused.status_code == 422, refused.text[-2000:]
    error = refused.text.split('id="edit-error">')[1].split("</p>")[0]
    assert RULE in error and "Nothing was changed" in error, error
    assert journal_count(api.db) == before
    assert "Traceback" not in api.log()


def keel(db_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = clean_env()
    env["KEEL_DATABASE_URL"] = db_url
    return run_keel(args, env)


@pytest.mark.parametrize("depth", TOO_DEEP)
@pytest.mark.parametrize("door", ["submit --input", "approve --arguments"])
def test_the_command_refuses_json_nested_too_deep(db_url: str, api: Api, door: str, depth: int) -> None:
    with api.http(api.token("operator")) as http:
        state = waiting_agent(api, http)
    before = _footprint(api)
    text = '{"a": ' + nested(min(depth, 50_000)) + "}"  # one argument holds at most 128 KiB
    if door == "submit --input":
        args = ["submit", state["name"], "r9", "--input", text]
    else:
        args = ["approve", state["name"], "--revision", str(state["revision"]), "--arguments", text]
    result = keel(db_url, *args)
    assert result.returncode != 0
    assert RULE in result.stderr.strip().splitlines()[-1], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert _footprint(api) == before


def test_every_api_route_that_takes_a_body_parses_it_by_the_rule(db_url: str, broker: Broker) -> None:
    """A route added later without ``route_class=JsonBodyRoute`` would parse its body its own way: refused here."""
    app = create_app(broker.settings(database_url=db_url))
    with_body = [r for r in _routes(app.routes) if isinstance(r, APIRoute) and r.body_field is not None]
    assert len(with_body) >= 5, with_body
    for route in with_body:
        assert isinstance(route, JsonBodyRoute), route.path


def _routes(routes: list[Any]) -> Iterator[Any]:
    """Every route, those of included routers too (FastAPI keeps an included router whole)."""
    for route in routes:
        included = getattr(route, "original_router", None)
        yield from _routes(included.routes) if included is not None else (route,)
