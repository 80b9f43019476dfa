"""The embedded default: a real PostgreSQL and Redis under KEEL_HOME, shown and stopped by `keel dev`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from models import embedded, migrations
from models.urls import libpq_url

pytestmark = pytest.mark.integration

KEEL = str(Path(sys.executable).parent / "keel")


def keel(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run keel with no server URLs at all, as on a fresh machine: it must use the embedded servers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
    env["KEEL_HOME"] = str(home)
    return subprocess.run(
        [KEEL, *args], env=env, capture_output=True, text=True, timeout=180, check=True, cwd=home.parent
    )


def test_the_demo_alone_starts_both_embedded_servers_and_dev_stop_stops_them(tmp_path: Path) -> None:
    home = tmp_path / "keel"
    try:
        demo = keel(home, "demo")
        assert f"Keel demo on embedded servers under {home}" in demo.stdout
        # A fresh machine: the embedded database is migrated without an extra step, and the demo says so.
        assert f"database: migrated base → {migrations.head()}" in demo.stdout.splitlines()
        assert "all invariants held" in demo.stdout
        status = json.loads(keel(home, "dev", "status", "--json").stdout)
        assert status["postgres"]["running"] and status["redis"]["running"]
        assert embedded.start_redis(home) == status["redis"]["url"], "a second start reuses the running server"
        with psycopg.connect(libpq_url(embedded.start_postgres(home))) as conn:
            assert conn.execute("SELECT count(*) FROM agents").fetchone() == (8,)  # its 8 scenarios (one Pydantic AI)
        import redis

        client = redis.Redis.from_url(status["redis"]["url"])
        assert client.ping()
        client.close()
        assert "stopped" in keel(home, "dev", "stop").stdout
        status = json.loads(keel(home, "dev", "status", "--json").stdout)
        assert not status["postgres"]["running"] and not status["redis"]["running"]
    finally:
        embedded.stop_postgres(home)
        embedded.stop_redis(home)


def _urls(home: Path) -> dict[str, str]:
    started = json.loads(keel(home, "dev", "start", "--json").stdout)
    return {name: server["url"] for name, server in started.items()}


def test_dev_start_prints_the_urls_is_idempotent_and_a_restart_keeps_them(tmp_path: Path) -> None:
    home = tmp_path / "keel"
    try:
        first = keel(home, "dev", "start").stdout
        assert "postgres  started" in first and "redis     started" in first
        urls = _urls(home)
        assert urls["redis"] in first and urls["postgres"] in first
        again = keel(home, "dev", "start").stdout
        assert "postgres  already running" in again and "redis     already running" in again
        keel(home, "dev", "stop")
        assert _urls(home) == urls, "a restarted server keeps its URL, so running workers reconnect"
        with psycopg.connect(libpq_url(urls["postgres"])) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        embedded.stop_postgres(home)
        embedded.stop_redis(home)


def test_a_restarted_redis_moves_only_when_someone_else_took_its_port(tmp_path: Path) -> None:
    import socket

    home = tmp_path / "keel"
    try:
        url = embedded.start_redis(home)
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        embedded.stop_redis(home)
        with socket.socket() as squatter:
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
            env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
            env["KEEL_HOME"] = str(home)
            # Only Redis: `keel dev start` would start PostgreSQL too; the library call is what it runs.
            moved = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "from pathlib import Path; import logging; logging.basicConfig();"
                    f"from models.embedded import start_redis; print(start_redis(Path({str(home)!r})))",
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
        assert moved.stdout.strip() != url
        assert f"its port {port} is taken by another process" in moved.stderr
    finally:
        embedded.stop_redis(home)


def test_dev_status_and_stop_cover_the_test_suites_servers(tmp_path: Path) -> None:
    home = tmp_path / "keel"
    suite = home / "test"
    try:
        url = embedded.start_redis(suite)
        status = " ".join(keel(home, "dev", "status").stdout.split())
        assert f"redis (tests) running (pid {embedded.redis_status(suite).pid}) {url}" in status
        assert json.loads(keel(home, "dev", "status", "--json").stdout)["tests"]["redis"]["running"]
        stopped = " ".join(keel(home, "dev", "stop").stdout.split())
        assert "redis (tests) stopped" in stopped
        assert not embedded.redis_status(suite).running
    finally:
        embedded.stop_redis(suite)


def test_the_suites_servers_are_stopped_by_the_last_session_using_them(tmp_path: Path) -> None:
    from tests.support.suite_servers import start_for_session

    home = tmp_path / "test"
    first: list[Any] = []
    second: list[Any] = []
    try:
        url = start_for_session(home, "redis", first.append)
        pid = embedded.redis_status(home).pid
        assert start_for_session(home, "redis", second.append) == url, "a second session shares the server"
        first.pop()()
        assert embedded.redis_status(home).pid == pid, "the other session still uses it"
        second.pop()()
        assert not embedded.redis_status(home).running
    finally:
        embedded.stop_redis(home)


def test_dev_start_and_status_say_which_servers_the_configuration_does_not_use(
    db_url: str, redis_server_url: str, tmp_path: Path
) -> None:
    """Before: with KEEL_DATABASE_URL set, `keel dev start` started an embedded PostgreSQL nothing would use, and
    neither command said the configuration points elsewhere."""
    from agents.cli.supervisor import where

    home = tmp_path / "keel"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
    env.update({"KEEL_HOME": str(home), "KEEL_DATABASE_URL": db_url})

    def run(*args: str, **more: str) -> str:
        done = subprocess.run(
            [KEEL, *args], env={**env, **more}, capture_output=True, text=True, timeout=180, cwd=tmp_path
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    unused = f"KEEL_DATABASE_URL is set ({where(db_url)}): this configuration does not use the embedded postgres"
    try:
        started = run("dev", "start").splitlines()
        assert started[0] == f"postgres  not started: {unused}"
        assert started[1].startswith("redis     started (pid ")
        assert not embedded.postgres_status(home).running, "no embedded PostgreSQL that nothing uses"
        status = run("dev", "status").splitlines()
        assert f"postgres          {unused}" in status
        assert json.loads(run("dev", "status", "--json"))["postgres"]["configured"] == where(db_url)
        assert json.loads(run("dev", "status", "--json"))["redis"]["configured"] is None
        broker = f"{redis_server_url}/0"
        both = run("dev", "start", KEEL_BROKER_URL=broker).splitlines()
        assert both == [
            f"postgres  not started: {unused}",
            f"redis     not started: KEEL_BROKER_URL is set ({where(broker)}): this configuration does not use the"
            " embedded redis",
        ]
    finally:
        embedded.stop_postgres(home)
        embedded.stop_redis(home)
