"""Running the `keel` command as a user would: the installed console script, a clean environment, a directory of
its own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.audit import TEST_ENV

KEEL = str(Path(sys.executable).parent / "keel")
PROMPT = '{"prompt": "hi"}'
SCRATCH = tempfile.mkdtemp(prefix="keel-cli-")
#: The one time format every ``keel`` output uses.
RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")


def keel(
    db_url: str, *args: str, check: bool = True, broker: str | None = None, **more: str
) -> subprocess.CompletedProcess[str]:
    """``keel ARGS`` on the database at ``db_url``; with ``check``, it must exit 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "OTEL_"))} | TEST_ENV | more
    env["KEEL_DATABASE_URL"] = db_url
    if broker:
        env["KEEL_BROKER_URL"] = broker
    # In a directory of its own: a developer's .env must not leak into the test.
    result = subprocess.run([KEEL, *args], env=env, capture_output=True, text=True, timeout=180, cwd=SCRATCH)
    if check:
        assert result.returncode == 0, result.stderr
    return result
