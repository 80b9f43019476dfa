"""`keel up` runs worker, beat and Flower together and stops all three on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.chaos.conftest import free_port, wait_until
from tests.support.broker import Broker

pytestmark = pytest.mark.chaos
KEEL = str(Path(sys.executable).parent / "keel")


def test_keel_up_runs_the_stack_until_ctrl_c(db_url: str, broker: Broker, tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
    env.update({"KEEL_DATABASE_URL": db_url, **broker.env, "FLOWER_UNAUTHENTICATED_API": "true"})
    with open(tmp_path / "up.log", "wb") as log:
        up = subprocess.Popen([KEEL, "up", "--flower-port", str(port)], env=env, stdout=log, stderr=log, cwd=tmp_path)
    try:

        def workers() -> Any:
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/api/workers?refresh=1", timeout=5)
            except httpx.HTTPError:
                return None
            return response.json() if response.status_code == 200 and response.json() else None

        assert wait_until("Flower to list the worker", workers, 90, every=1)
        children = psutil.Process(up.pid).children()
        assert len(children) == 3, "worker, beat and Flower"
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        _gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"left running: {alive}"
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
