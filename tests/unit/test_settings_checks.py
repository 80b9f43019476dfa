"""Settings that would break later are refused at start-up, with one line naming the variable and the rule."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agents.core.commands import MessageSpec
from agents.core.errors import InvalidInput
from models.settings import SLACK_CONVERSATION_ID, BadConfiguration, Settings, check_imports, load_settings

KEEL = str(Path(sys.executable).parent / "keel")
SERVERS = {"KEEL_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none", "KEEL_BROKER_URL": "redis://127.0.0.1:1/0"}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"KEEL_NOTIFY_SLACK_CHANNEL": "#ops"},
            "KEEL_NOTIFY_SLACK_CHANNEL: must be a Slack conversation id like C0123ABCD",
        ),
        ({"KEEL_SLACK_API_URL": "slack.com/api"}, "KEEL_SLACK_API_URL: must be an http:// or https:// URL"),
        ({"KEEL_LLM_BASE_URL": "ftp://models.example"}, "KEEL_LLM_BASE_URL: must be an http:// or https:// URL"),
        ({"KEEL_GITHUB_API_URL": "https://"}, "KEEL_GITHUB_API_URL: must be an http:// or https:// URL with a host"),
        ({"KEEL_API_PUBLIC_URL": "keel.example.com"}, "KEEL_API_PUBLIC_URL: must be an http:// or https:// URL"),
        ({"KEEL_IMPORTS": '["my app.handlers"]'}, "KEEL_IMPORTS: 'my app.handlers' is not a module name"),
        ({"KEEL_IMPORTS": "myapp.handlers"}, "KEEL_IMPORTS: must be JSON"),
        (
            {"KEEL_RETRY_POLICY": '{"transient": {"max_attempts": "three"}}'},
            "KEEL_RETRY_POLICY: transient.max_attempts: Input should be a valid number",
        ),
        ({"KEEL_RETRY_POLICY": '{"transient": {"max_attempts": 2.5}}'}, "whole number of at least 1"),
        ({"KEEL_RETRY_POLICY": '{"transient": {"maxattempts": 3}}'}, "transient: unknown fields ['maxattempts']"),
        ({"KEEL_RETRY_POLICY": '{"transient": {"jitter": 4}}'}, "transient.jitter must be between 0 and 1"),
        (
            {"KEEL_RETRY_POLICY": '{"unknown": {"base_seconds": 10, "max_seconds": 5}}'},
            "unknown.max_seconds must not be below unknown.base_seconds",
        ),
        ({"KEEL_LLM_PRICES": '{"m": {"in": 1}}'}, "KEEL_LLM_PRICES: m: give prices as"),
        ({"KEEL_JOB_LEASE_SECONDS": "4000"}, "KEEL_JOB_LEASE_SECONDS: must be shorter than"),
        (
            {"KEEL_ENQUEUE_TIMEOUT_SECONDS": "0.5", "KEEL_DISPATCH_INTERVAL_SECONDS": "1"},
            "KEEL_ENQUEUE_TIMEOUT_SECONDS: must be longer than KEEL_DISPATCH_INTERVAL_SECONDS",
        ),
        ({"KEEL_OUTBOX_BACKOFF_MAX_SECONDS": "0.5"}, "KEEL_OUTBOX_BACKOFF_MAX_SECONDS: must not be below"),
        ({"KEEL_OUTBOX_LEASE_SECONDS": "10"}, "KEEL_OUTBOX_LEASE_SECONDS: must be at least 3 x"),
        ({"KEEL_LLM_PROVIDER": "openai"}, "KEEL_LLM_API_KEY: required when KEEL_LLM_PROVIDER=openai"),
        ({"KEEL_DB_POOL_SIZE": "0"}, "KEEL_DB_POOL_SIZE: Input should be greater than or equal to 1"),
        ({"KEEL_DB_POOL_SIZE_WORKER": "1"}, "KEEL_DB_POOL_SIZE_WORKER: Input should be greater than or equal to 2"),
        ({"KEEL_WORKER_POOL": "gevent"}, "KEEL_WORKER_POOL: Input should be 'threads', 'prefork' or 'solo'"),
        ({"KEEL_WORKER_CONCURRENCY": "0"}, "KEEL_WORKER_CONCURRENCY: Input should be greater than or equal to 1"),
        ({"KEEL_OPERATION_QUEUES": '{"summarise": "keel.jobs"}'}, "summarise: 'keel.jobs' is one of Keel's own queues"),
        ({"KEEL_OPERATION_QUEUES": '{"summarise": "a b"}'}, "summarise: 'a b' is not a queue name"),
        (
            {"KEEL_DATABASE_POOLER": "transaction"},
            "KEEL_DATABASE_DIRECT_URL: required with KEEL_DATABASE_POOLER=transaction",
        ),
        ({"KEEL_DATABASE_POOLER": "session"}, "KEEL_DATABASE_POOLER: Input should be 'none' or 'transaction'"),
        (
            {
                "KEEL_DATABASE_POOLER": "transaction",
                "KEEL_DATABASE_URL": "postgresql://keel@pgbouncer:6432/keel",
                "KEEL_DATABASE_DIRECT_URL": "postgres://keel@pgbouncer:6432/keel",
            },
            "KEEL_DATABASE_DIRECT_URL: must reach PostgreSQL itself, not the pooler",
        ),
        ({"KEEL_DB_KEEPALIVES_COUNT": "-1"}, "KEEL_DB_KEEPALIVES_COUNT: Input should be greater than or equal to 0"),
        ({"KEEL_DB_TCP_USER_TIMEOUT_MS": "2h"}, "KEEL_DB_TCP_USER_TIMEOUT_MS: Input should be a valid integer"),
        (
            {"KEEL_DATABASE_DIRECT_URL": "mysql://u:s3cret@db/keel"},
            "KEEL_DATABASE_DIRECT_URL: Keel needs PostgreSQL",
        ),
        (
            {"KEEL_BEAT_LEASE_SECONDS": "1", "KEEL_DISPATCH_INTERVAL_SECONDS": "0.5"},
            "KEEL_BEAT_LEASE_SECONDS: must be at least three times KEEL_DISPATCH_INTERVAL_SECONDS",
        ),
        ({"KEEL_ENVIRONMENT": "prod"}, "KEEL_ENVIRONMENT: Input should be 'development', 'test' or 'production'"),
        ({"KEEL_BROKER_PREFIX": "keel *"}, "KEEL_BROKER_PREFIX: may hold only letters, digits and . _ : / -"),
        (
            {"KEEL_API_RATE_LIMITS": '{"producer": {"rate": 0, "burst": 10}}'},
            "KEEL_API_RATE_LIMITS: producer.rate: Input should be greater than 0",
        ),
        (
            {"KEEL_API_RATE_LIMITS": '{"approver": {"rate": 5, "burst": 0}}'},
            "KEEL_API_RATE_LIMITS: approver.burst: Input should be greater than or equal to 1",
        ),
        (
            {"KEEL_API_RATE_LIMITS": '{"admin": {"rate": 5, "burst": 10}}'},
            "KEEL_API_RATE_LIMITS: unknown scopes ['admin']; known: ['producer', 'approver', 'operator', 'auditor']",
        ),
        ({"KEEL_API_RATE_LIMITS": '{"auditor": {"rate": 5}}'}, "KEEL_API_RATE_LIMITS: auditor.burst: Field required"),
        (
            {"KEEL_API_RATE_LIMITS": '{"auditor": {"rate": 5, "burst": true}}'},
            "KEEL_API_RATE_LIMITS: auditor.burst: must be a number, not true or false",
        ),
        ({"KEEL_API_RATE_LIMITS": "producer=50"}, "KEEL_API_RATE_LIMITS: must be JSON"),
        ({"KEEL_API_RATE_LIMIT_ENABLED": "maybe"}, "KEEL_API_RATE_LIMIT_ENABLED: Input should be a valid boolean"),
        ({"KEEL_API_WORKERS": "2"}, "KEEL_CONSOLE_SESSION_KEY: required when KEEL_API_WORKERS is above 1"),
        ({"KEEL_API_METRICS_PORT": "8000"}, "KEEL_API_METRICS_PORT: 8000 is the API's own port"),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_variable_and_the_rule(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(BadConfiguration) as refused:
        load_settings()
    text = str(refused.value)
    assert text.startswith("bad configuration: KEEL_") and message in text
    assert "\n" not in text


def test_urls_with_passwords_are_never_echoed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEL_DATABASE_URL", "postgresql://u:s3cret@[::1/db")
    monkeypatch.setenv("KEEL_BROKER_URL", "amqp://u:s3cret@host//")
    with pytest.raises(BadConfiguration) as refused:
        load_settings()
    assert "s3cret" not in str(refused.value)
    assert "KEEL_DATABASE_URL: not a database URL" in str(refused.value)
    assert "KEEL_BROKER_URL: must be a redis:// URL" in str(refused.value)


@pytest.mark.parametrize("value", ["C0123ABCD", "G1", "D0ABC", "#ops", "ops", "c0123abcd", "C0123ABCD ", "U0123ABCD"])
def test_settings_and_messages_agree_on_what_a_slack_channel_is(value: str) -> None:
    try:
        MessageSpec("slack", value, "t", {"text": "x"})
        accepted = True
    except InvalidInput:
        accepted = False
    assert bool(SLACK_CONVERSATION_ID.fullmatch(value)) == accepted


def test_good_values_pass_and_the_slack_url_gets_its_slash() -> None:
    settings = Settings(
        notify_slack_channel="C0123ABCD",
        slack_api_url="http://127.0.0.1:9999/api",
        retry_policy={"transient": {"max_attempts": 3, "base_seconds": 1, "max_seconds": 5, "jitter": 0.1}},
        llm_prices={"m": {"input": 0.15, "output": 0.6}},
        imports=["tests.support.handlers"],
    )
    assert settings.slack_api_url == "http://127.0.0.1:9999/api/"
    check_imports(settings)


def test_variables_compose_passes_on_empty_mean_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KEEL_NOTIFY_SLACK_CHANNEL", "KEEL_SLACK_TOKEN", "KEEL_GITHUB_TOKEN", "KEEL_LLM_API_KEY"):
        monkeypatch.setenv(name, "")
    settings = load_settings()
    assert (settings.notify_slack_channel, settings.slack_token, settings.github_token, settings.llm_api_key) == (
        None,
        None,
        None,
        None,
    )


def test_a_module_that_cannot_be_imported_is_named() -> None:
    with pytest.raises(BadConfiguration, match=r"KEEL_IMPORTS: module 'no_such_keel_module' cannot be imported"):
        check_imports(Settings(imports=["no_such_keel_module"]))


def _keel(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
    return subprocess.run(
        [KEEL, *args], env={**clean, **SERVERS, **env}, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize("command", [["worker"], ["beat"], ["up"], ["flower"], ["agent", "list"], ["db", "upgrade"]])
def test_every_keel_command_refuses_a_bad_setting_in_one_line(command: list[str]) -> None:
    done = _keel(*command, KEEL_NOTIFY_SLACK_CHANNEL="#ops")
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(
        "keel: error: bad configuration: KEEL_NOTIFY_SLACK_CHANNEL: must be a Slack conversation id"
    )


@pytest.mark.parametrize("command", [["worker"], ["up"]])
def test_a_worker_refuses_to_start_on_a_module_it_cannot_import(command: list[str]) -> None:
    done = _keel(*command, KEEL_IMPORTS='["no_such_keel_module"]')
    assert done.returncode != 0
    assert done.stderr.strip() == (
        "keel: error: bad configuration: KEEL_IMPORTS: module 'no_such_keel_module' cannot be imported"
        " (ModuleNotFoundError: No module named 'no_such_keel_module')"
    )


def test_serve_refuses_several_processes_without_a_shared_session_key() -> None:
    """Each process would sign console sessions with a random key of its own: sign-in would fail on alternate
    requests. ``--workers`` is held to the same rule as KEEL_API_WORKERS."""
    for args, env in ((["--workers", "2"], {}), ([], {"KEEL_API_WORKERS": "3"})):
        done = _keel("serve", "--port", "1", *args, **env)
        assert done.returncode != 0
        assert done.stderr.strip().splitlines() == [
            "keel: error: bad configuration: KEEL_CONSOLE_SESSION_KEY: required when KEEL_API_WORKERS is above 1"
            " (or keel serve --workers): each process would sign console sessions with a random key of its own,"
            " so signing in would fail on alternate requests"
        ], done.stderr


def test_several_processes_with_a_session_key_pass() -> None:
    settings = load_settings(api_workers=4, console_session_key="k" * 32)
    assert settings.api_workers == 4
