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
    return subprocess.run(
        [KEEL, *args], env=env, capture_output=True, text=True, timeout=180, check=True, cwd=home.parent
    )


def test_the_demo_alone_starts_both_embedded_servers_and_dev_stop_stops_them(tmp_path: Path) -> None:
    home = tmp_path / "keel"
    try:
        demo = keel(home, "demo")
        assert f"Keel demo on embedded servers under {home}" in demo.stdout
        assert "all invariants held" in demo.stdout
        status = json.loads(keel(home, "dev", "status", "--json").stdout)
        assert status["postgres"]["running"] and status["redis"]["running"]
        assert embedded.start_redis(home) == status["redis"]["url"], "a second start reuses the running server"
        with psycopg.connect(libpq_url(embedded.start_postgres(home))) as conn:
            assert conn.execute("SELECT count(*) FROM agents").fetchone() == (7,)
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
