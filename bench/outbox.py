"""Benchmark: messages/s the outbox relay delivers to a local fake Slack beside a raw loop posting the same payloads,
then the relay's head scan and emitters to one destination, each beside its baseline (``make bench-outbox``;
:data:`DESCRIPTION`, its ``--help``, says how it measures).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg
from slack_sdk import WebClient

from agents.cli.progress import Progress
from agents.client import Client
from agents.core import transition as core
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
from models.outbox_sql import NewMessage, due_destinations, insert_messages_txn
from models.settings import Settings
from models.urls import libpq_url, with_database
from tests.support.fakes import FakeSlack

#: The benchmark's ``--help``: what it measures and how.
DESCRIPTION = """\
Benchmark: messages/s the outbox relay delivers to a local fake Slack that answers at once, beside a raw loop
posting the same payloads with the same HTTP client (slack_sdk's WebClient) in the same run.

Like for like, the relay runs with one destination line at a time (``concurrency=1``, one message in flight, as
the raw loop); it is also shown with its default concurrency over 8 destinations. Run with ``make bench-outbox``.

Two more measures, each beside its baseline in the same run:

- how long a relay pass takes to find the due lines' heads with a live backlog (``--backlog`` messages over
  ``--lines`` destinations, a quarter of the lines waiting out a backoff), and with ten messages: the skip scan
  Keel runs now, beside the ``DISTINCT ON`` over every live message it ran before;
- emitters/s to one destination (``--emitters`` threads, each its own agent, each transition emitting one message
  to the same channel, as every hard-deadline notice does): now, beside the same transitions holding the
  destination's advisory lock to commit, as they did before.
"""

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


# --- finding the due heads: the skip scan, beside the DISTINCT ON it replaced ------------------------------------

# The pass's query before: every live message of every line read to find each line's head.
_DISTINCT_ON = """
WITH heads AS (SELECT DISTINCT ON (destination) key FROM outbox
  WHERE status IN ('pending', 'sending') ORDER BY destination, seq)
SELECT o.destination FROM outbox o JOIN heads h ON h.key = o.key
WHERE ((o.status = 'pending' AND o.next_attempt_at <= clock_timestamp())
       OR (o.status = 'sending' AND o.lease_until < clock_timestamp()))
ORDER BY o.seq LIMIT %s FOR UPDATE OF o SKIP LOCKED
"""


def seed_backlog(db: Database, agent_id: uuid.UUID, n: int, lines: int) -> None:
    """``n`` pending messages over ``lines`` destinations; the heads of a quarter of the lines wait out a backoff."""
    with psycopg.connect(db.libpq_url) as conn:
        conn.execute(
            "INSERT INTO outbox (key, agent_id, request_id, channel, destination, payload, next_attempt_at)"
            " SELECT 'rb:slack:' || %s || ':' || g, %s, 'rb', 'slack', 'L' || lpad((g %% %s)::text, 5, '0'),"
            " '{}'::jsonb, now()"
            " FROM generate_series(1, %s) g",
            (n, agent_id, lines, n),
        )
        conn.execute(
            "UPDATE outbox SET next_attempt_at = now() + interval '1 day' WHERE key IN (SELECT DISTINCT ON"
            " (destination) key FROM outbox WHERE request_id = 'rb' AND right(destination, 1) IN ('0', '4')"
            " ORDER BY destination, seq)"
        )
        conn.execute("ANALYZE outbox")


def clear_backlog(db: Database) -> None:
    with psycopg.connect(db.libpq_url) as conn:
        # Out of the lines (only sent messages may be deleted, by retention): dead rows are in no line.
        conn.execute("UPDATE outbox SET status = 'dead' WHERE request_id = 'rb'")
        conn.execute("ANALYZE outbox")


def head_pass_ms(db: Database, rounds: int) -> tuple[float, float]:
    """Median ms to find up to 8 due lines: the skip scan (its cursor going round), the DISTINCT ON."""
    cursor, scan, distinct = "", [], []
    for _ in range(rounds):
        started = time.perf_counter()
        _, cursor = due_destinations(db, 8, after=cursor)
        scan.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        with db.transaction() as cur:
            cur.execute(_DISTINCT_ON, (8,))
            cur.fetchall()
        distinct.append((time.perf_counter() - started) * 1000)
    return statistics.median(scan), statistics.median(distinct)


# --- emitters to one destination: now, beside the destination's lock held to commit as before ------------------


def _locked_insert(cur: psycopg.Cursor[Any], messages: list[NewMessage]) -> tuple[list[str], list[str]]:
    """The emit as it was: each destination's advisory lock taken first, held until the transaction commits."""
    for destination in sorted({m.destination for m in messages}):
        cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 7))", ("keel-outbox:" + destination,))
    return insert_messages_txn(cur, messages)


@contextmanager
def destination_lock_held_to_commit() -> Iterator[None]:
    core.insert_messages_txn = _locked_insert  # type: ignore[assignment]
    try:
        yield
    finally:
        core.insert_messages_txn = insert_messages_txn


def emit_rate(client: Client, emitters: int, per_emitter: int) -> float:
    """Transitions/s, each emitting one message to the channel every emitter shares, ``emitters`` at once."""
    agents = []
    for _ in range(emitters):
        agent = client.create_agent(f"emit-{uuid.uuid4().hex[:8]}")
        client.submit(agent.id, f"e{uuid.uuid4().hex[:10]}", None, operation="noop")
        agents.append(agent.id)
    start = threading.Barrier(emitters + 1)
    failed: list[BaseException] = []

    def run(agent_id: uuid.UUID) -> None:
        start.wait()
        try:
            for i in range(per_emitter):
                message = MessageSpec("slack", "C0HOTLINE", f"n{i}", {"text": "hard deadline passed"})
                transition(client.db, Command(agent_id, Event.PROGRESS, "bench", messages=(message,)))
        except BaseException as exc:
            failed.append(exc)
            raise

    threads = [threading.Thread(target=run, args=(a,)) for a in agents]
    for t in threads:
        t.start()
    start.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    if failed:
        raise RuntimeError("an emitter failed") from failed[0]
    return emitters * per_emitter / (time.perf_counter() - started)


def outbox_figures(db: Database, client: Client, args: argparse.Namespace) -> None:
    agent = client.create_agent(f"backlog-{uuid.uuid4().hex[:8]}")
    client.submit(agent.id, f"b{uuid.uuid4().hex[:10]}", None, operation="noop")
    with OUT.task("a pass's look at the heads, 10 live messages"):
        seed_backlog(db, agent.id, 10, min(10, args.lines))
        small_scan, small_distinct = head_pass_ms(db, 200)
        clear_backlog(db)
    with OUT.task(f"a pass's look at the heads, {args.backlog} live messages over {args.lines} lines"):
        seed_backlog(db, agent.id, args.backlog, args.lines)
        big_scan, big_distinct = head_pass_ms(db, 200)
        clear_backlog(db)
    before, after = [], []
    with OUT.task(f"{args.emitters} emitters to one destination", total=2 * args.rounds) as step:
        for _ in range(args.rounds):  # alternating, so both see the same machine
            with destination_lock_held_to_commit():
                before.append(emit_rate(client, args.emitters, args.emits))
            step.advance()
            after.append(emit_rate(client, args.emitters, args.emits))
            step.advance()
    locked, free = statistics.median(before), statistics.median(after)
    OUT.line(f"finding the due lines (up to 8), median ms a pass; {args.lines} lines, a quarter of heads backing off")
    OUT.line(f"  {'live messages':>14} {'skip scan (now)':>16} {'DISTINCT ON (before)':>21} {'ratio':>7}")
    OUT.line(f"  {10:>14} {small_scan:>16.2f} {small_distinct:>21.2f} {small_distinct / small_scan:>6.1f}x")
    OUT.line(f"  {args.backlog:>14} {big_scan:>16.2f} {big_distinct:>21.2f} {big_distinct / big_scan:>6.1f}x")
    OUT.line(f"  skip scan at {args.backlog} / at 10: {big_scan / small_scan:.2f}x (target: within 1.2x)")
    OUT.line(
        f"emitters to one destination: {args.emitters} threads, {args.emits} transitions each, median of {args.rounds}"
    )
    OUT.line(
        f"  lock held to commit (before)   {locked:8.0f} transitions/s   runs: {', '.join(f'{x:.0f}' for x in before)}"
    )
    OUT.line(
        f"  no lock (now)                  {free:8.0f} transitions/s   runs: {', '.join(f'{x:.0f}' for x in after)}"
    )
    OUT.line(f"  ratio now/before               {free / locked:8.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backlog", type=int, default=100_000, help="live messages for the pass measure")
    parser.add_argument("--lines", type=int, default=200, help="destinations the backlog is spread over")
    parser.add_argument("--emitters", type=int, default=8, help="threads emitting to one destination")
    parser.add_argument("--emits", type=int, default=100, help="transitions per emitter thread")
    parser.add_argument("--only-scale", action="store_true", help="only the pass and emitter measures")
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
        outbox_figures(db, client, args)
        if args.only_scale:
            db.dispose()
            return 0
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
