"""compose.yaml's beat health check, run as Docker runs it, against a real PostgreSQL: healthy while a beat holds the
leader lease, unhealthy (naming why) once none does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from models.settings import Settings
from models.urls import libpq_url
from tasks.leadership import Leadership

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _beat_check(db_url: str) -> subprocess.CompletedProcess[str]:
    test = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["beat"]["healthcheck"]["test"]
    assert test[:2] == ["CMD", "python"]
    env = {**os.environ, "KEEL_DATABASE_URL": libpq_url(db_url)}  # compose's URL is a plain postgresql:// one
    return subprocess.run([sys.executable, *test[2:]], env=env, capture_output=True, text=True, timeout=60)


def test_beat_is_healthy_while_a_beat_leads_and_unhealthy_when_none_does(db_url: str) -> None:
    assert _beat_check(db_url).returncode == 1, "no beat runs yet"
    leader = Leadership(libpq_url(db_url), Settings())
    try:
        assert leader.held()  # what a running beat does on its first tick
        healthy = _beat_check(db_url)
        assert healthy.returncode == 0, healthy.stderr
    finally:
        leader.release()
    gone = _beat_check(db_url)
    assert gone.returncode == 1
    assert gone.stderr == "no beat holds the leader lease\n", "a beat that stops hands its lease back at once"
