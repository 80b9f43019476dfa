"""``keel token``: create, list and revoke the HTTP API's tokens."""

from __future__ import annotations

from typing import Any

import click

from agents.cli.common import actor_option, emit, friendly, json_option, open_client, timestamp
from models.tables import TOKEN_SCOPES


def _reach(token: Any) -> str:
    return "every agent" if token.agent_prefix is None else f"agents named {token.agent_prefix}…"


def _revoked(token: Any) -> str:
    return f"revoked at {timestamp(token.revoked_at)} by {token.revoked_by}" if token.revoked_at else "live"


@click.group()
def token() -> None:
    """API tokens for the HTTP API: who may do what, to which agents.

    Scopes: producer (create agents, submit), approver (approve, reject), operator (what a producer may, cancel,
    retry outbox messages, read everything), auditor (read the journal, stories, jobs and the outbox)."""


@token.command("create")
@click.argument("name")
@click.option(
    "--scope",
    "scopes",
    multiple=True,
    required=True,
    type=click.Choice(TOKEN_SCOPES),
    help="What the token may do (repeat for several).",
)
@click.option(
    "--agent-prefix",
    metavar="PREFIX",
    help="Only agents whose name starts with PREFIX, which ends in '-', '.' or '_' (e.g. acme-; default: all).",
)
@actor_option
@json_option
@friendly
def token_create(name: str, scopes: tuple[str, ...], agent_prefix: str | None, actor: str, as_json: bool) -> None:
    """Create the token NAME and print its secret, once: only a hash of it is kept."""
    from agents.ingress.tokens import create_token

    with open_client() as client:
        created, secret = create_token(client.db, name, scopes, agent_prefix=agent_prefix, actor=actor)
    text = "\n".join(
        [
            f"created token {created.name!r} ({created.id}): {', '.join(created.scopes)}, {_reach(created)}",
            f"secret: {secret}",
            "This secret will not be shown again (Keel keeps only a hash of it): store it now.",
        ]
    )
    emit({**created.model_dump(), "secret": secret}, as_json, text)


@token.command("list")
@json_option
@friendly
def token_list(as_json: bool) -> None:
    """Every token, oldest first, revoked ones included; never a secret."""
    from agents.ingress.tokens import list_tokens

    with open_client(writes=False) as client:
        tokens = list_tokens(client.db)
    if not tokens:
        emit({"tokens": []}, as_json, "no tokens")
        return
    rows = [
        (
            t.name,
            ",".join(t.scopes),
            t.agent_prefix or "-",
            timestamp(t.created_at),
            timestamp(t.last_used_at) if t.last_used_at else "-",
            timestamp(t.revoked_at) if t.revoked_at else "-",
        )
        for t in tokens
    ]
    table = [("NAME", "SCOPES", "PREFIX", "CREATED", "LAST USED", "REVOKED"), *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths, strict=True)).rstrip() for row in table]
    emit({"tokens": tokens}, as_json, "\n".join(lines))


@token.command("revoke")
@click.argument("name_or_id", metavar="NAME_OR_ID")
@actor_option
@json_option
@friendly
def token_revoke(name_or_id: str, actor: str, as_json: bool) -> None:
    """Revoke a token for good: its secret is refused from now on. Revoking it again changes nothing."""
    from agents.ingress.tokens import revoke_token

    with open_client() as client:
        revoked = revoke_token(client.db, name_or_id, actor=actor)
    emit(revoked, as_json, f"token {revoked.name!r} ({revoked.id}): {_revoked(revoked)}")


COMMANDS = (token,)
