"""The fake receivers live in agents/demo/fake_servers.py (the demo uses them too); tests import them from here.

The test versions also count the pages of history (Slack) or comments (GitHub) read, and can answer those reads
slowly (``page_delay``), to test how the relay bounds its reconciliation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler

from agents.demo import fake_servers as sinks
from agents.demo.fake_servers import FakeLLM

__all__ = ["FakeGitHub", "FakeLLM", "FakeSlack"]


@dataclass
class FakeSlack(sinks.FakeSlack):
    page_delay: float = 0.0
    pages_read: int = 0

    def history(self, request: BaseHTTPRequestHandler, query: dict[str, str]) -> None:
        with self.lock:
            self.pages_read += 1
        time.sleep(self.page_delay)
        super().history(request, query)


@dataclass
class FakeGitHub(sinks.FakeGitHub):
    page_delay: float = 0.0
    pages_read: int = 0

    def list(self, request: BaseHTTPRequestHandler, destination: str, query: dict[str, str]) -> None:
        with self.lock:
            self.pages_read += 1
        time.sleep(self.page_delay)
        super().list(request, destination, query)
