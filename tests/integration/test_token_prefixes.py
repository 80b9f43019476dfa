"""A token's agent prefix ends in a delimiter ('-', '.', '_'), so ``acme-`` never covers ``acmecorp-…``: a prefix
without one is refused at every door that makes a token, and one stored before the rule (``acme``) covers only
``acme-…`` in every scope check — the API's reads and lists, the inbox, the console."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from agents.core.errors import InvalidInput
from agents.ingress.tokens import SECRET_PREFIX, create_token, secret_hash
from models import tokens_sql
from models.db import Database
from tests.support.api import Api, waiting_agent
from tests.support.audit import clean_env
from tests.support.cli import run_keel
from tests.support.console import Browsers

pytestmark = pytest.mark.integration

KEEL = str(Path(sys.executable).parent / "keel")
SCRATCH = tempfile.mkdtemp(prefix="keel-prefixes-")


def _tokens(raw: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return raw.execute("SELECT * FROM api_tokens ORDER BY name").fetchall()


@pytest.mark.parametrize("prefix", ["acme", "acme-bot", "a"])
def test_a_prefix_that_does_not_end_in_a_delimiter_is_refused_naming_the_rule(
    db: Database, db_url: str, raw: psycopg.Connection[Any], prefix: str
) -> None:
    before = _tokens(raw)
    with pytest.raises(InvalidInput) as refused:
        create_token(db, "tenant", ["approver"], agent_prefix=prefix, actor="alice")
    assert f"agent prefix {prefix!r} must end in '-', '.' or '_'" in str(refused.value)
    env = clean_env()
    env["KEEL_DATABASE_URL"] = db_url
    result = run_keel(["token", "create", "tenant", "--scope", "approver", "--agent-prefix", prefix], env, SCRATCH)
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "must end in '-', '.' or '_'" in lines[0], result.stderr
    assert _tokens(raw) == before


@pytest.mark.parametrize("prefix", ["acme-", "acme.", "acme_"])
def test_a_prefix_ending_in_a_delimiter_is_taken(db: Database, prefix: str) -> None:
    token, _ = create_token(db, "tenant", ["approver"], agent_prefix=prefix, actor="alice")
    assert token.agent_prefix == prefix and token.sees(f"{prefix}bot") and not token.sees("acmecorp-bot")


@pytest.fixture
def legacy(api: Api) -> Iterator[str]:
    """The secret of an operator token stored before the rule, with the prefix ``acme`` (written as a database
    from before would hold it: by the table, not by ``create_token``)."""
    secret = SECRET_PREFIX + "L" * 43
    row = tokens_sql.insert_token(
        api.db,
        name="legacy-acme",
        scopes=["operator", "approver"],
        agent_prefix="acme",
        secret_hash=secret_hash(secret),
        created_by="before",
    )
    assert row is not None
    yield secret


def test_a_prefix_stored_without_a_delimiter_covers_only_its_names_followed_by_a_dash(api: Api, legacy: str) -> None:
    with api.http(api.token("operator")) as http:
        for name in ("acme-bot", "acmecorp-bot", "acme.bot", "acme"):
            waiting_agent(api, http, name)
    with api.http(legacy) as http:
        listed = [a["name"] for a in http.get("/v1/agents").json()["agents"]]
        assert listed == ["acme-bot"], listed
        assert http.get("/v1/tokens/me").json()["agent_prefix"] == "acme-"
        assert http.get("/v1/agents/acme-bot").status_code == 200
        for other in ("acmecorp-bot", "acme.bot", "acme"):
            assert http.get(f"/v1/agents/{other}").status_code == 404, other
        inbox = [a["agent"] for a in http.get("/v1/approvals").json()["approvals"]]
        assert inbox == ["acme-bot"], inbox
        narrowed = [a["agent"] for a in http.get("/v1/approvals?agent_prefix=acmecorp").json()["approvals"]]
        assert narrowed == [], narrowed
        created = http.post("/v1/agents", json={"name": "acmecorp-new"})
        assert created.status_code == 403, created.text
    browsers = Browsers(api)
    try:
        console = browsers.signed_in(legacy)
        page = console.get("/agents").text
        assert "acme-bot" in page and "acmecorp-bot" not in page and "acme.bot" not in page
        assert console.get("/agents/acmecorp-bot").status_code == 404
        inbox_page = console.get("/inbox?agent_prefix=acmecorp").text
        assert "acmecorp-bot" not in inbox_page
    finally:
        browsers.close()
