"""Benchmark: messages/s the outbox relay delivers to a local fake Slack that answers at once, beside a raw loop
posting the same payloads with the same HTTP client (slack_sdk's WebClient) in the same run.

Like for like, the relay runs with one destination line at a time (``concurrency=1``, one message in flight, as
the raw loop); it is also shown with its default concurrency over 8 destinations. Run with ``make bench-outbox``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from datetime import timedelta

import psycopg
from slack_sdk import WebClient

from agents.cli.progress import Progress
from agents.client import Client
from agents.core.commands import Command, MessageSpec
from agents.core.phases import Event
from agents.core.transition import transition
from agents.jobs.handlers import registry
from agents.outbox.relay import Backoff, Relay
from agents.outbox.senders import SlackSender
from models import migrations
from models.audit_keys import audit_keys_for
from models.db import Database
from models.embedded import database_url_for
from models.settings import Settings
from models.urls import libpq_url, with_database
from tests.support.fakes import FakeSlack

OUT = Progress()  # live on a terminal, plain lines in a pipe or a file

TOKEN = "xoxb-bench-token-0000"
registry.declare("noop")  # the request that emits the messages runs no job here: the client only needs to know it


def emit(client: Client, n: int, destinations: int) -> None:
    agent = client.create_agent(f"bench-{uuid.uuid4().hex[:8]}")
    client.submit(agent.id, f"r{uuid.uuid4().hex[:10]}", None, operation="noop")
    batch: list[MessageSpec] = []
    for i in range(n):
        batch.append(MessageSpec("slack", f"C{i % destinations:02d}", f"m{i}", {"text": f"message {i}"}))
        if len(batch) == 100:
            transition(client.db, Command(agent.id, Event.PROGRESS, "bench", messages=tuple(batch)))
            batch = []
    if batch:
        transition(client.db, Command(agent.id, Event.PROGRESS, "bench", messages=tuple(batch)))


def relay_rate(db: Database, client: Client, fake: FakeSlack, n: int, concurrency: int, destinations: int) -> float:
    with OUT.task(f"seeding {n} outbox messages"):
        emit(client, n, destinations)
    relay = Relay(
        db,
        {"slack": SlackSender(TOKEN, f"{fake.url}/api/", 10.0)},
        lease=timedelta(seconds=60),
        concurrency=concurrency,
        backoff=Backoff(0.1, 1.0, 5),
        pass_seconds=600,
    )
    before = sum(fake.delivered_keys().values())
    started = time.perf_counter()
    while sum(fake.delivered_keys().values()) - before < n:
        relay.run_pass()
    elapsed = time.perf_counter() - started
    relay.close()
    return n / elapsed


def raw_rate(fake: FakeSlack, n: int) -> float:
    web = WebClient(token=TOKEN, base_url=f"{fake.url}/api/", retry_handlers=[])
    started = time.perf_counter()
    for i in range(n):
        web.chat_postMessage(
            channel=f"C{i % 8:02d}",
            text=f"message {i}",
            metadata={"event_type": "keel_outbox", "event_payload": {"key": f"raw-{uuid.uuid4().hex}"}},
        )
    return n / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    server = database_url_for(Settings())
    name = f"keel_bench_outbox_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(libpq_url(with_database(server, "postgres")), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = with_database(server, name)
    fake = FakeSlack(token=TOKEN).start()
    assert isinstance(fake, FakeSlack)
    try:
        migrations.upgrade(url)
        db = Database(url, pool_size=12, audit_keys=audit_keys_for(Settings()))
        client = Client(db)
        raw_rate(fake, 100)  # warm-up
        raws, relays, wide = [], [], []
        with OUT.task("raw loop and relay, one line at a time", total=2 * args.rounds) as step:
            for _ in range(args.rounds):
                raws.append(raw_rate(fake, args.messages))
                step.advance()
                relays.append(relay_rate(db, client, fake, args.messages, 1, 1))
                step.advance()
        with OUT.task("relay, 8 destinations, concurrency 8", total=args.rounds) as step:
            for _ in range(args.rounds):
                wide.append(relay_rate(db, client, fake, args.messages, 8, 8))
                step.advance()
        raw, like, many = statistics.median(raws), statistics.median(relays), statistics.median(wide)
        OUT.line(f"outbox benchmark: {args.messages} messages a run, median of {args.rounds}, fake Slack on {fake.url}")
        OUT.line(
            f"  raw WebClient loop, 1 in flight      {raw:8.0f} msg/s   runs: {', '.join(f'{x:.0f}' for x in raws)}"
        )
        OUT.line(
            f"  relay, 1 line at a time              {like:8.0f} msg/s   runs: {', '.join(f'{x:.0f}' for x in relays)}"
        )
        OUT.line(f"  ratio relay/raw                      {like / raw:8.2f}x")
        OUT.line(f"  relay, 8 destinations, concurrency 8 {many:8.0f} msg/s   ({many / raw:.2f}x the raw loop)")
        OUT.line(f"\ntarget: at least 0.70x -> {like / raw:.2f}x {'met' if like / raw >= 0.7 else 'NOT MET'}")
        db.dispose()
    finally:
        fake.stop()
        with psycopg.connect(libpq_url(with_database(server, "postgres")), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return 0


if __name__ == "__main__":
    sys.exit(main())
