"""API tokens against a real database: created with a secret shown once, found by its hash, revoked for good."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import psycopg
import pytest

from agents.core.errors import InvalidInput, KeelError, TokenExists, TokenNotFound
from agents.ingress.tokens import Permission, Scope, authenticate, create_token, list_tokens, revoke_token
from models.db import Database
from tests.support.audit import clean_env
from tests.support.cli import run_keel

pytestmark = pytest.mark.integration

KEEL = str(Path(sys.executable).parent / "keel")
SCRATCH = tempfile.mkdtemp(prefix="keel-tokens-")


def rows(raw: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return raw.execute("SELECT * FROM api_tokens ORDER BY name").fetchall()


def row_version(raw: psycopg.Connection[Any], name: str) -> tuple[str, Any]:
    """The row's xmin (changes with every write of it) and its last_used_at."""
    found = raw.execute("SELECT xmin::text, last_used_at FROM api_tokens WHERE name = %s", (name,)).fetchone()
    assert found is not None
    return found[0], found[1]


def test_a_token_is_created_with_its_secret_and_authenticates_with_it(db: Database) -> None:
    token, secret = create_token(
        db, "ci-bot", ["approver", Scope.PRODUCER, "producer"], agent_prefix="acme-", actor="alice"
    )
    assert secret.startswith("keel_") and len(secret) == len("keel_") + 43
    assert (token.name, token.scopes, token.agent_prefix, token.created_by) == (
        "ci-bot",
        (Scope.PRODUCER, Scope.APPROVER),  # each once, in the table's order
        "acme-",
        "alice",
    )
    assert token.last_used_at is None and token.revoked_at is None
    found = authenticate(db, secret)
    assert found is not None and found.id == token.id and found.last_used_at is not None
    assert found.can(Permission.SUBMIT) and found.can(Permission.APPROVE) and not found.can(Permission.CANCEL)
    assert found.sees("acme-triage") and not found.sees("globex-triage")
    other, other_secret = create_token(db, "reader", ["auditor"], actor="alice")
    assert other_secret != secret
    found_other = authenticate(db, other_secret)
    assert found_other is not None and found_other.model_copy(update={"last_used_at": None}) == other
    assert [t.name for t in list_tokens(db)] == ["ci-bot", "reader"]


def test_only_a_hash_of_the_secret_is_stored(db: Database, raw: psycopg.Connection[Any]) -> None:
    _, secret = create_token(db, "ci-bot", ["producer"], actor="alice")
    assert authenticate(db, secret) is not None
    revoke_token(db, "ci-bot", actor="bob")
    stored = raw.execute("SELECT t::text, secret_hash FROM api_tokens t").fetchall()
    assert len(stored) == 1
    assert secret not in stored[0][0] and secret[len("keel_") :] not in stored[0][0]
    assert stored[0][1] == hashlib.sha256(secret.encode()).hexdigest()
    assert raw.execute("SELECT count(*) FROM audit.journal").fetchone() == (0,)  # tokens are not agents' history


@pytest.mark.parametrize(
    "presented",
    [
        "",
        "keel_",
        "Bearer keel_",
        "keel_" + "A" * 43,  # well-formed, but nobody's
        "KEEL_" + "A" * 43,
        "keel_" + "A" * 44,
        "keel_" + "A" * 42 + "\x00",
        None,
        42,
    ],
)
def test_an_unknown_or_malformed_secret_authenticates_nobody(
    db: Database, raw: psycopg.Connection[Any], presented: Any
) -> None:
    _, secret = create_token(db, "ci-bot", ["producer"], actor="alice")
    assert authenticate(db, presented) is None
    assert authenticate(db, secret[:-1]) is None and authenticate(db, secret + "x") is None
    assert row_version(raw, "ci-bot")[1] is None  # no attempt counted as a use


def test_a_busy_token_notes_its_use_at_most_once_a_minute(db: Database, raw: psycopg.Connection[Any]) -> None:
    _, secret = create_token(db, "ci-bot", ["producer"], actor="alice")
    first = authenticate(db, secret)
    assert first is not None and first.last_used_at is not None
    written = row_version(raw, "ci-bot")
    assert written[1] == first.last_used_at
    for _ in range(5):
        again = authenticate(db, secret)
        assert again is not None and again.last_used_at == first.last_used_at
    assert row_version(raw, "ci-bot") == written  # the row was not written again
    raw.execute("UPDATE api_tokens SET last_used_at = last_used_at - interval '61 seconds' WHERE name = 'ci-bot'")
    aged = row_version(raw, "ci-bot")
    later = authenticate(db, secret)
    assert later is not None and later.last_used_at is not None and later.last_used_at > aged[1]
    noted = row_version(raw, "ci-bot")
    assert noted[0] != aged[0] and noted[1] == later.last_used_at


def test_a_revoked_token_is_refused_and_revoking_again_changes_nothing(
    db: Database, raw: psycopg.Connection[Any]
) -> None:
    token, secret = create_token(db, "ci-bot", ["operator"], actor="alice")
    assert authenticate(db, secret) is not None
    revoked = revoke_token(db, "ci-bot", actor="bob")
    assert revoked.revoked_at is not None and revoked.revoked_by == "bob"
    assert not revoked.can(Permission.READ_STATE)
    assert authenticate(db, secret) is None
    before = rows(raw)
    assert revoke_token(db, token.id, actor="carol") == revoked  # by id, idempotent: bob's revocation stays
    assert revoke_token(db, str(token.id), actor="carol") == revoked
    assert rows(raw) == before
    assert [(t.name, t.revoked_by) for t in list_tokens(db)] == [("ci-bot", "bob")]
    with pytest.raises(TokenExists, match="an API token named 'ci-bot' exists already"):
        create_token(db, "ci-bot", ["producer"], actor="alice")  # a revoked token's name is not reused


def test_revoking_an_unknown_token_names_it(db: Database) -> None:
    with pytest.raises(TokenNotFound, match="no API token has the id or name 'ghost'"):
        revoke_token(db, "ghost", actor="bob")
    with pytest.raises(TokenNotFound, match="no API token has the id or name"):
        revoke_token(db, "00000000-0000-0000-0000-000000000000", actor="bob")


@pytest.mark.parametrize(
    ("name", "scopes", "prefix", "actor", "error", "message"),
    [
        ("bad name", ["producer"], None, "alice", InvalidInput, "token name 'bad name' must start with a letter"),
        ("", ["producer"], None, "alice", InvalidInput, "token name must be 1-200 characters, got 0"),
        ("x" * 201, ["producer"], None, "alice", InvalidInput, "token name must be 1-200 characters, got 201"),
        ("-x", ["producer"], None, "alice", InvalidInput, "must start with a letter or digit"),
        ("ok\n", ["producer"], None, "alice", InvalidInput, "must start with a letter or digit"),
        ("x\x00", ["producer"], None, "alice", InvalidInput, "token name must not contain NUL characters"),
        ("x\udcff", ["producer"], None, "alice", InvalidInput, "token name is not valid Unicode"),
        ("ok", ["producer"], "acme\x00", "alice", InvalidInput, "agent prefix must not contain NUL characters"),
        (
            "6f1c9c3e-0b7a-4d7e-9a7c-1b2c3d4e5f60",
            ["producer"],
            None,
            "alice",
            InvalidInput,
            "token name must not look like a UUID",
        ),
        ("ok", [], None, "alice", InvalidInput, "a token needs at least one scope (producer, approver, operator"),
        ("ok", ["producer", "admin"], None, "alice", InvalidInput, "unknown scope 'admin' (scopes: producer,"),
        ("ok", ["Producer"], None, "alice", InvalidInput, "unknown scope 'Producer'"),
        ("ok", ["producer"], "", "alice", InvalidInput, "agent prefix must be 1-200 characters, got 0"),
        ("ok", ["producer"], "acme/", "alice", InvalidInput, "agent prefix 'acme/' must start with a letter"),
        ("ok", ["producer"], None, "", InvalidInput, "actor must be 1-200 characters"),
        ("taken", ["auditor"], None, "alice", TokenExists, "an API token named 'taken' exists already"),
    ],
)
def test_bad_input_is_refused_naming_the_problem_and_changes_nothing(
    db: Database,
    raw: psycopg.Connection[Any],
    name: str,
    scopes: list[str],
    prefix: str | None,
    actor: str,
    error: type[KeelError],
    message: str,
) -> None:
    create_token(db, "taken", ["producer"], actor="alice")
    before = rows(raw)
    with pytest.raises(error) as refused:
        create_token(db, name, scopes, agent_prefix=prefix, actor=actor)
    assert message in str(refused.value)
    assert rows(raw) == before


def test_the_database_keeps_a_token_as_created_and_a_revocation_for_good(
    db: Database, raw: psycopg.Connection[Any]
) -> None:
    """Beyond the code: a token's scopes cannot be widened in place, a revocation undone, or the record deleted."""
    create_token(db, "ci-bot", ["auditor"], actor="alice")
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="changes only when used or revoked"):
        raw.execute("UPDATE api_tokens SET scopes = '{operator}'")
    with pytest.raises(psycopg.errors.CheckViolation, match="ck_api_tokens_scopes"):
        raw.execute(
            "INSERT INTO api_tokens (name, scopes, secret_hash, created_by) VALUES ('x', '{root}', %s, 'a')",
            ("0" * 64,),
        )
    revoke_token(db, "ci-bot", actor="bob")
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="was revoked: that is for good"):
        raw.execute("UPDATE api_tokens SET revoked_at = NULL, revoked_by = NULL")
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="DELETE refused"):
        raw.execute("DELETE FROM api_tokens")
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="TRUNCATE refused"):
        raw.execute("TRUNCATE api_tokens")
    assert [(t.name, t.revoked_by) for t in list_tokens(db)] == [("ci-bot", "bob")]


# --- keel token ---------------------------------------------------------------------------------------------------


def keel(db_url: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = clean_env()
    env["KEEL_DATABASE_URL"] = db_url
    result = run_keel(args, env)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def test_keel_token_create_list_revoke(db_url: str, db: Database) -> None:
    shown = keel(db_url, "token", "create", "ci-bot", "--scope", "producer", "--scope", "approver", "--actor", "alice")
    lines = shown.stdout.splitlines()
    secret = next(line.removeprefix("secret: ") for line in lines if line.startswith("secret: "))
    assert shown.stdout.count(secret) == 1
    assert "will not be shown again" in shown.stdout
    assert "created token 'ci-bot'" in lines[0] and "producer, approver" in lines[0] and "every agent" in lines[0]
    assert (found := authenticate(db, secret)) is not None and found.name == "ci-bot"

    created = json.loads(
        keel(db_url, "token", "create", "acme-reader", "--scope", "auditor", "--agent-prefix", "acme-", "--json").stdout
    )
    assert (created["name"], created["scopes"], created["agent_prefix"], created["created_by"]) == (
        "acme-reader",
        ["auditor"],
        "acme-",
        "cli",
    )
    assert (reader := authenticate(db, created["secret"])) is not None and reader.name == "acme-reader"

    listed = keel(db_url, "token", "list").stdout
    assert secret not in listed and created["secret"] not in listed
    header, *table = listed.splitlines()
    assert header.split() == ["NAME", "SCOPES", "PREFIX", "CREATED", "LAST", "USED", "REVOKED"]
    assert [line.split()[:3] for line in table] == [
        ["ci-bot", "producer,approver", "-"],
        ["acme-reader", "auditor", "acme-"],
    ]
    as_json = json.loads(keel(db_url, "token", "list", "--json").stdout)["tokens"]
    assert [(t["name"], t["revoked_at"]) for t in as_json] == [("ci-bot", None), ("acme-reader", None)]
    assert all(t["last_used_at"] is not None for t in as_json)  # both authenticated above
    assert "secret" not in as_json[0] and "secret_hash" not in as_json[0]

    revoked = keel(db_url, "token", "revoke", "ci-bot", "--actor", "bob").stdout
    assert revoked.startswith("token 'ci-bot' (") and "revoked at " in revoked and "by bob" in revoked
    assert keel(db_url, "token", "revoke", created["id"], "--actor", "carol").returncode == 0
    assert authenticate(db, secret) is None and authenticate(db, created["secret"]) is None
    again = json.loads(keel(db_url, "token", "revoke", "ci-bot", "--json").stdout)
    assert again["revoked_by"] == "bob"  # revoking again changes nothing
    _, *table = keel(db_url, "token", "list").stdout.splitlines()
    assert [line.split()[-1].endswith("Z") for line in table] == [True, True]  # the REVOKED column


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (("token", "create", "x"), 2, "Missing option '--scope'"),
        (("token", "create", "x", "--scope", "root"), 2, "'--scope': 'root' is not one of 'producer', 'approver'"),
        (("token", "create", "bad name", "--scope", "producer"), 1, "token name 'bad name' must start with"),
        (("token", "create", "taken", "--scope", "producer"), 1, "an API token named 'taken' exists already"),
        (("token", "revoke", "ghost"), 1, "no API token has the id or name 'ghost'"),
    ],
)
def test_keel_token_refusals_are_one_line_and_change_nothing(
    db_url: str, db: Database, raw: psycopg.Connection[Any], args: tuple[str, ...], status: int, message: str
) -> None:
    create_token(db, "taken", ["auditor"], actor="alice")
    before = rows(raw)
    result = keel(db_url, *args, check=False)
    assert result.returncode == status
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert result.stdout == "" and rows(raw) == before
