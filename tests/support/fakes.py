"""The fake receivers live in agents/demo/fake_servers.py (the demo uses them too); tests import them from here.

The test versions also count the pages of history (Slack) or comments (GitHub) read, and can answer those reads
slowly (``page_delay``), to test how the relay bounds its reconciliation; the Slack one can refuse a channel for a
while (``refusing``), to make a dead letter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from agents.demo import fake_servers as sinks
from agents.demo.fake_servers import FakeLLM

__all__ = ["FakeGitHub", "FakeLLM", "FakeSlack"]


@dataclass
class FakeSlack(sinks.FakeSlack):
    page_delay: float = 0.0
    pages_read: int = 0
    #: Channels refused with channel_not_found (a permanent failure: the message goes dead) while listed here.
    refusing: set[str] = field(default_factory=set)

    def post_message(self, request: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        if body.get("channel") in self.refusing:
            return self.reply(request, 200, {"ok": False, "error": "channel_not_found"})
        super().post_message(request, body)

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
