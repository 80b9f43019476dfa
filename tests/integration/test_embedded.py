"""The embedded default: a real PostgreSQL and Redis under KEEL_HOME, shown and stopped by `keel dev`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from models import embedded
from models.urls import libpq_url

pytestmark = pytest.mark.integration

KEEL = str(Path(sys.executable).parent / "keel")


def keel(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run keel with no server URLs at all, as on a fresh machine: it must use the embedded servers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
    env["KEEL_HOME"] = str(home)
    return subprocess.run([KEEL, *args], env=env, capture_output=True, text=True, timeout=120, check=True)


def test_embedded_servers_start_report_and_stop(tmp_path: Path) -> None:
    home = tmp_path / "keel"
    try:
        pg_url = embedded.start_postgres(home)
        redis_url = embedded.start_redis(home)
        assert embedded.start_redis(home) == redis_url, "a second start reuses the running server"
        with psycopg.connect(libpq_url(pg_url)) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        import redis

        client = redis.Redis.from_url(redis_url)
        assert client.ping()
        client.close()
        demo = keel(home, "demo")
        assert f"Keel demo on embedded servers under {home}" in demo.stdout
        assert "all invariants held" in demo.stdout
        status = json.loads(keel(home, "dev", "status", "--json").stdout)
        assert status["postgres"]["running"] and status["redis"]["running"]
        assert status["redis"]["url"] == redis_url
        assert "stopped" in keel(home, "dev", "stop").stdout
        status = json.loads(keel(home, "dev", "status", "--json").stdout)
        assert not status["postgres"]["running"] and not status["redis"]["running"]
    finally:
        embedded.stop_postgres(home)
        embedded.stop_redis(home)
