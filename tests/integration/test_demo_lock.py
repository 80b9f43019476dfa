"""Two `keel demo` runs in one directory would relay each other's messages: the second refuses, naming the first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.broker import Broker

pytestmark = pytest.mark.integration

KEEL = str(Path(sys.executable).parent / "keel")
HOLD = (
    "import sys, time; from pathlib import Path; from agents.demo.run import only_demo_here\n"
    "with only_demo_here(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(600)"
)
TAKE = (
    "import sys; from pathlib import Path; from agents.demo.run import only_demo_here\n"
    "with only_demo_here(Path(sys.argv[1])):\n    print('taken')"
)


def test_a_second_demo_refuses_naming_the_first_and_the_lock_dies_with_it(
    db_url: str, broker: Broker, tmp_path: Path
) -> None:
    home = tmp_path / ".keel"
    first = subprocess.Popen([sys.executable, "-c", HOLD, str(home)], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout is not None and first.stdout.readline() == "held\n"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
        env.update({"KEEL_DATABASE_URL": db_url, **broker.env, "KEEL_HOME": str(home)})
        second = subprocess.run([KEEL, "demo"], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert second.returncode == 1
        assert second.stdout == ""
        assert second.stderr == (
            f"keel: error: another keel demo (pid {first.pid}) is running in {home}: wait until it ends, "
            "or run this one with another KEEL_HOME\n"
        )
        assert not (home / "demo").exists(), "the refused demo started nothing"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert first.stdout is not None
        first.stdout.close()
    taken = subprocess.run([sys.executable, "-c", TAKE, str(home)], capture_output=True, text=True, timeout=60)
    assert taken.stdout == "taken\n", "a SIGKILLed demo leaves no lock behind"
