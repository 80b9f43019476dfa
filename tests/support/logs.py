"""Reading the JSON log lines a Keel process writes (``KEEL_LOG_FORMAT=json``, the default on a file or a pipe)."""

from __future__ import annotations

import json
from typing import Any


def log_lines(text: str) -> list[dict[str, Any]]:
    """The JSON log lines in ``text``, in order; other lines (Celery's banner, a traceback Python printed itself)
    are left out."""
    found = []
    for line in text.split("\n"):  # not splitlines(): a reader of JSON lines splits on "\n" alone
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                found.append(record)
    return found
