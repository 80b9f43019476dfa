"""`keel demo` picks its API's port while nothing listens on it, but someone else may bind it before the API does:
then the API is started again on another port, rather than the demo failing (agents/demo/run.py, Stack.start_api)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import httpx
import pytest

from agents.core.errors import KeelError
from agents.demo.run import Stack
from models.embedded import free_port
from tests.support.broker import Broker

pytestmark = pytest.mark.integration


def _env(db_url: str, broker: Broker, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
    return {**env, "KEEL_DATABASE_URL": db_url, **broker.env, "KEEL_HOME": str(home)}


def test_the_api_moves_to_another_port_when_its_port_was_taken_in_between(
    db_url: str, broker: Broker, tmp_path: Path
) -> None:
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    picks = iter([taken, free_port()])
    stack = Stack(_env(db_url, broker, tmp_path), tmp_path)
    try:
        url = stack.start_api(pick_port=lambda: next(picks))
        assert url != f"http://127.0.0.1:{taken}"
        assert httpx.get(f"{url}/readyz", timeout=5).status_code == 200
        assert b"address already in use" in (tmp_path / "api.log").read_bytes().lower()
    finally:
        stack.stop()
        squatter.close()


def test_an_api_that_fails_for_another_reason_is_not_started_again(db_url: str, broker: Broker, tmp_path: Path) -> None:
    env = {**_env(db_url, broker, tmp_path), "KEEL_DB_POOL_SIZE": "0"}  # a bad setting: it exits at start
    picked: list[int] = []
    stack = Stack(env, tmp_path)

    def pick() -> int:
        picked.append(free_port())
        return picked[-1]

    try:
        with pytest.raises(KeelError, match="api did not start"):
            stack.start_api(pick_port=pick)
        assert len(picked) == 1, "started once: its failure was not a port taken"
    finally:
        stack.stop()
