"""A sender without its token: the relay built from the settings records each of its messages dead with the reason
the start-up warning quotes, and the warning names the setting; with the token set there is no warning and the
message is sent."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import SecretStr

from agents.client import Client
from agents.outbox.credentials import missing_senders, not_configured
from agents.outbox.relay import Relay
from models.db import Database
from models.outbox_sql import message_row
from models.settings import Settings
from tests.support.fakes import FakeGitHub, FakeSlack
from tests.support.keys import scoped
from tests.support.outbox import GITHUB_TOKEN, OPEN, SLACK_TOKEN, close_relays, emit, fake_github, fake_slack, gh_msg

pytestmark = pytest.mark.integration


@pytest.fixture
def slack() -> Iterator[FakeSlack]:
    yield from fake_slack()


@pytest.fixture
def github() -> Iterator[FakeGitHub]:
    yield from fake_github()


@pytest.fixture(autouse=True)
def _close_relays() -> Iterator[None]:
    yield from close_relays()


def _relay(db: Database, settings: Settings) -> Relay:
    made = Relay.from_settings(db, settings)
    OPEN.append(made)
    return made


def test_a_github_comment_without_a_token_is_dead_with_the_reason_the_warning_gave(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub
) -> None:
    settings = Settings(
        slack_token=SecretStr(SLACK_TOKEN), slack_api_url=f"{slack.url}/api/", github_api_url=github.url
    )
    (warning,) = missing_senders(settings)
    assert warning.startswith("KEEL_GITHUB_TOKEN is not set: GitHub messages (github_comment) will go dead unsent")
    bot = client.create_agent("bot")
    emit(client, "bot", gh_msg("acme/api#1", "c"))
    _relay(db, settings).run_pass()
    row = message_row(db, scoped(bot.id, "req-bot:github:c"))
    assert row is not None and (row["status"], row["last_error"]) == ("dead", not_configured("github"))
    assert row["last_error"] == "github is not configured: set KEEL_GITHUB_TOKEN"
    assert f'("{row["last_error"]}")' in warning, "the warning quotes the reason the message is dead with"


def test_with_both_tokens_set_there_is_no_warning_and_the_comment_is_sent(
    client: Client, db: Database, slack: FakeSlack, github: FakeGitHub
) -> None:
    settings = Settings(
        slack_token=SecretStr(SLACK_TOKEN),
        slack_api_url=f"{slack.url}/api/",
        github_token=SecretStr(GITHUB_TOKEN),
        github_api_url=github.url,
    )
    assert missing_senders(settings) == []
    bot = client.create_agent("bot")
    emit(client, "bot", gh_msg("acme/api#1", "c"))
    _relay(db, settings).run_pass()
    row = message_row(db, scoped(bot.id, "req-bot:github:c"))
    assert row is not None and row["status"] == "sent"


def test_without_any_token_each_sender_has_its_warning() -> None:
    warnings = missing_senders(Settings())
    assert [warning.split(" ", 1)[0] for warning in warnings] == ["KEEL_SLACK_TOKEN", "KEEL_GITHUB_TOKEN"]
    assert 'will go dead unsent ("slack is not configured: set KEEL_SLACK_TOKEN")' in warnings[0]
    assert all("keel outbox retry" in warning for warning in warnings)
