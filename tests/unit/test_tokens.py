"""What each API token scope lets a caller do, and which agents a token sees."""

from __future__ import annotations

from datetime import UTC, datetime
from uuid import uuid4

import pytest

from agents.ingress.tokens import GRANTS, ApiToken, Permission, Scope, grants
from models.tables import TOKEN_SCOPES

P = Permission


def token(*scopes: Scope, prefix: str | None = None, revoked: bool = False) -> ApiToken:
    at = datetime(2026, 12, 16, tzinfo=UTC)
    return ApiToken(
        id=uuid4(),
        name="t",
        scopes=scopes,
        agent_prefix=prefix,
        created_at=at,
        created_by="alice",
        last_used_at=None,
        revoked_at=at if revoked else None,
        revoked_by="bob" if revoked else None,
    )


def test_the_scopes_are_the_ones_the_database_accepts() -> None:
    assert TOKEN_SCOPES == tuple(Scope)


@pytest.mark.parametrize(
    ("scope", "expected"),
    [
        (Scope.PRODUCER, {P.CREATE_AGENT, P.SUBMIT, P.READ_STATE, P.READ_EVENTS}),
        (Scope.APPROVER, {P.APPROVE, P.REJECT, P.READ_STATE, P.READ_EVENTS, P.READ_JOURNAL, P.READ_APPROVALS}),
        (
            Scope.OPERATOR,
            {P.CREATE_AGENT, P.SUBMIT, P.READ_STATE, P.READ_EVENTS}  # what a producer may
            | {P.CANCEL, P.RETRY_OUTBOX, P.READ_OUTBOX, P.READ_JOB, P.READ_JOURNAL, P.READ_STORY, P.READ_APPROVALS},
        ),
        (
            Scope.AUDITOR,
            {P.READ_JOURNAL, P.READ_STORY, P.READ_JOB, P.READ_OUTBOX, P.READ_STATE, P.READ_EVENTS, P.READ_APPROVALS},
        ),
    ],
)
def test_what_each_scope_grants(scope: Scope, expected: set[Permission]) -> None:
    assert grants([scope]) == expected


def test_an_operator_may_do_everything_a_producer_may_but_decide_nothing() -> None:
    assert grants([Scope.PRODUCER]) < grants([Scope.OPERATOR])
    assert not grants([Scope.OPERATOR]) & {P.APPROVE, P.REJECT}


def test_only_approvers_decide_and_auditors_change_nothing() -> None:
    deciders = {scope for scope in Scope if grants([scope]) & {P.APPROVE, P.REJECT}}
    assert deciders == {Scope.APPROVER}
    writes = {P.CREATE_AGENT, P.SUBMIT, P.APPROVE, P.REJECT, P.CANCEL, P.RETRY_OUTBOX}
    assert not grants([Scope.AUDITOR]) & writes


def test_several_scopes_grant_what_any_of_them_grants_and_every_permission_has_a_scope() -> None:
    assert grants([Scope.PRODUCER, Scope.APPROVER]) == GRANTS[Scope.PRODUCER] | GRANTS[Scope.APPROVER]
    assert grants([]) == frozenset()
    assert grants(Scope) == set(Permission)


def test_can_follows_the_scopes_and_a_revoked_token_can_nothing() -> None:
    producer = token(Scope.PRODUCER)
    assert producer.can(P.SUBMIT) and producer.can(P.CREATE_AGENT)
    assert not producer.can(P.APPROVE) and not producer.can(P.READ_JOURNAL)
    both = token(Scope.PRODUCER, Scope.APPROVER)
    assert both.can(P.SUBMIT) and both.can(P.APPROVE)
    assert not any(token(*Scope, revoked=True).can(p) for p in Permission)


@pytest.mark.parametrize(
    ("agent_name", "seen"),
    [("acme-bot", True), ("acme-", True), ("acme", False), ("ACME-bot", False), ("other-acme-bot", False)],
)
def test_a_prefix_limits_the_agents_a_token_sees(agent_name: str, seen: bool) -> None:
    assert token(Scope.PRODUCER, prefix="acme-").sees(agent_name) is seen
    assert token(Scope.PRODUCER).sees(agent_name)  # no prefix: every agent


@pytest.mark.parametrize(
    ("agent_name", "seen"),
    [("acme-bot", True), ("acmecorp-bot", False), ("acme.bot", False), ("acme_bot", False), ("acme", False)],
)
def test_a_prefix_stored_without_a_delimiter_reaches_only_its_names_followed_by_a_dash(
    agent_name: str, seen: bool
) -> None:
    legacy = token(Scope.APPROVER, prefix="acme")
    assert legacy.agent_prefix == "acme-"  # what every scope check (SQL lists too) is given
    assert legacy.sees(agent_name) is seen
    assert token(Scope.APPROVER, prefix="acme.").sees("acme.bot")  # one with a delimiter is kept as it is
