"""What the shipping tests share: a journal with a few agents' events, a store on the moto server, shipping it all,
checking that every event was shipped exactly once, and the `keel` command run with the tests' keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg

from agents.audit.ship import ship
from agents.audit.store import S3Store
from agents.client import Client
from agents.core.commands import Command
from agents.core.phases import Event
from agents.core.transition import transition
from models.audit_destination import parse_store_url
from models.db import Database
from tests.support.cli import run_keel
from tests.support.s3 import AWS_ENV, KEYS, KEYS_ENV, MotoS3

KEEL = str(Path(sys.executable).parent / "keel")
ASK = {"prompt": "What changed?", "script": [{"content": "Nothing.", "cost": "0.5"}]}


def history(client: Client, agents: int = 4) -> None:
    """A few agents with a handful of events each, interleaved."""
    made = [client.create_agent(f"shipped-{uuid.uuid4().hex[:8]}") for _ in range(agents)]
    for agent in made:
        client.submit(agent.id, f"r-{agent.id}", ASK)
    for agent in made:
        transition(client.db, Command(agent.id, Event.PLAN, "worker", details={"model": "m"}))
    for agent in made[::2]:
        transition(client.db, Command(agent.id, Event.FINISH, "worker"))


def journal_ids(raw: psycopg.Connection[Any]) -> list[int]:
    return [r[0] for r in raw.execute("SELECT id FROM audit.journal ORDER BY id")]


def store_for(s3: MotoS3, bucket: str, *, endpoint: str | None = None, **kwargs: Any) -> S3Store:
    return S3Store(
        parse_store_url(f"s3://{bucket}/keel"),
        client=s3.client(
            endpoint, retries={"mode": "standard", "total_max_attempts": 3}, read_timeout=2, connect_timeout=2
        ),
        **kwargs,
    )


def ship_all(db: Database, store: Any, destination: str, **kwargs: Any) -> Any:
    kwargs.setdefault("segment_events", 5)
    return ship(db, store, KEYS, destination=destination, segment_age=timedelta(minutes=10), flush=True, **kwargs)


def shipped_ids(store: Any) -> list[int]:
    """Every event id in every segment body of the store, in order, duplicates kept; each body has its manifest."""
    names = list(store.names())
    bodies = [n for n in names if n.endswith(".jsonl")]
    assert sorted(n for n in names if n.endswith(".manifest.json")) == sorted(
        n.removesuffix(".jsonl") + ".manifest.json" for n in bodies
    )
    ids: list[int] = []
    for name in sorted(bodies):
        ids += [json.loads(line)["id"] for line in store.get(name).decode().splitlines()]
    return ids


def assert_shipped_once(store: Any, raw: psycopg.Connection[Any]) -> None:
    ids = shipped_ids(store)
    assert ids == journal_ids(raw)  # every event, once, in id order
    assert len(set(ids)) == len(ids)


def keel(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    child = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "OTEL_"))}
    return run_keel(args, child | AWS_ENV | KEYS_ENV | env)
