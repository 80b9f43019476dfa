"""Benchmark: `keel audit verify`'s full pass beside an incremental one, on journals of 1,000 and of 100,000 events,
in one run (``make bench-verify``; :data:`DESCRIPTION`, its ``--help``, says how it measures).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from agents.cli.progress import Progress
from agents.core import journal
from models import migrations
from models.audit_keys import AuditKeys, audit_keys_for
from models.db import Database
from models.embedded import database_url_for
from models.settings import Settings
from models.tables import GENESIS_HASH
from models.urls import libpq_url, with_database

#: The benchmark's ``--help``: what it measures and how.
DESCRIPTION = """\
Benchmark: `keel audit verify` on a journal of 1,000 and of 100,000 events, in one run: the full pass (every chain
from its start) beside an incremental pass (each chain from its sealed checkpoint) after a few new events, and the
longest chunk of each (one chunk = one transaction = the longest any snapshot of the verify lives).

Each database is seeded directly (COPY, triggers off, as history is: the links are real HMACs under the audit key,
so the walk checks every one): 1k events = 500 agents x 2 events, 100k events = 1,000 agents x 100 events, so a
chunk of 500 chains is full in both. A full pass with checkpoints saved comes first (it is also what sets them),
then 10 chains get one event each and the incremental pass is timed; medians of ``--rounds``. Run with ``make
bench-verify`` (or ``python -m bench.verify``). Uses KEEL_DATABASE_URL's server, else the embedded one; it
creates and drops databases of its own.
"""

OUT = Progress()  # live on a terminal, plain lines in a pipe or a file


class Chains:
    """The seeded chains' heads, so new events can be appended to them as the journal would."""

    def __init__(self, keys: AuditKeys) -> None:
        self.keys = keys
        self.heads: dict[uuid.UUID, tuple[int, str]] = {}
        self.next_id = 1
        self.at = datetime.now(UTC).replace(microsecond=0)

    def events(self, agent_id: uuid.UUID, n: int) -> list[tuple[Any, ...]]:
        seq, prev = self.heads.get(agent_id, (0, GENESIS_HASH))
        rows = []
        for _ in range(n):
            seq += 1
            self.at += timedelta(microseconds=1)
            fields: dict[str, Any] = {
                "agent_id": agent_id, "seq": seq, "kind": "rejected", "event": "cancel", "actor": "bench",
                "request_id": None, "from_phase": "idle", "to_phase": "idle", "revision": 0,
                "decision": "stale_revision", "details_json": "{}", "at": self.at,
            }  # fmt: skip
            digest = journal.event_mac(self.keys, self.keys.current, prev_hash=prev, **fields)
            rows.append(
                (self.next_id, agent_id, seq, "rejected", "cancel", "bench", None, "idle", "idle", 0,
                 "stale_revision", "{}", self.at, prev, digest, self.keys.current)
            )  # fmt: skip
            self.next_id += 1
            prev = digest
        self.heads[agent_id] = (seq, prev)
        return rows


def _write(url: str, chains: Chains, rows: list[tuple[Any, ...]], agents: list[uuid.UUID], *, new: bool) -> None:
    with psycopg.connect(libpq_url(url)) as conn:
        conn.execute("SET session_replication_role = replica")  # history: past the append guard, as a restore is
        with conn.cursor() as cur:
            with cur.copy(
                "COPY audit.journal (id, agent_id, seq, kind, event, actor, request_id, from_phase, to_phase,"
                " revision, decision, details, at, prev_hash, hash, key_id) FROM STDIN"
            ) as copy:
                for row in rows:
                    copy.write_row(row)
            heads = [(a, *chains.heads[a]) for a in agents]
            if new:
                cur.executemany(
                    "INSERT INTO agents (id, name, journal_seq, journal_head) VALUES (%s, %s, %s, %s)",
                    [(a, f"bench-{a.hex[:12]}", s, h) for a, s, h in heads],
                )
            else:
                cur.executemany(
                    "UPDATE agents SET journal_seq = %s, journal_head = %s WHERE id = %s",
                    [(s, h, a) for a, s, h in heads],
                )
            cur.execute("SELECT setval('audit.journal_id_seq', %s)", (chains.next_id,))
        conn.commit()
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE audit.journal")
        conn.execute("VACUUM ANALYZE agents")


def _timed(db: Database, *, full: bool) -> tuple[float, float, journal.VerifyReport]:
    """The pass's seconds, its longest chunk's (from its start or the previous chunk's end), and its report."""
    marks: list[float] = []
    start = time.perf_counter()
    report = journal.verify(db, full=full, save_checkpoints=True, on_chunk=lambda _: marks.append(time.perf_counter()))
    total = time.perf_counter() - start
    edges = [start, *marks]
    return total, max(b - a for a, b in itertools.pairwise(edges)), report


def measure(server: str, keys: AuditKeys, agents: int, per_chain: int, rounds: int) -> dict[str, float]:
    name = f"keel_bench_verify_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(libpq_url(with_database(server, "postgres")), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = with_database(server, name)
    try:
        migrations.upgrade(url)
        chains = Chains(keys)
        ids = sorted(uuid.uuid4() for _ in range(agents))
        _write(url, chains, [r for a in ids for r in chains.events(a, per_chain)], ids, new=True)
        db = Database(url, pool_size=2, audit_keys=keys)
        fulls, full_chunks, incs, inc_chunks = [], [], [], []
        try:
            for _ in range(rounds):
                seconds, chunk, report = _timed(db, full=True)
                assert report.ok and report.read_events == report.events, report
                fulls.append(seconds)
                full_chunks.append(chunk)
                touched = ids[:: max(1, agents // 10)][:10]
                _write(url, chains, [r for a in touched for r in chains.events(a, 1)], touched, new=False)
                seconds, chunk, report = _timed(db, full=False)
                assert report.ok and report.read_events == len(touched), report
                incs.append(seconds)
                inc_chunks.append(chunk)
        finally:
            db.dispose()
        return {
            "events": agents * per_chain,
            "full": statistics.median(fulls),
            "full_chunk": statistics.median(full_chunks),
            "incremental": statistics.median(incs),
            "incremental_chunk": statistics.median(inc_chunks),
        }
    finally:
        with psycopg.connect(libpq_url(with_database(server, "postgres")), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    settings = Settings()
    server, keys = database_url_for(settings), audit_keys_for(settings)
    results = []
    with OUT.task("seed and verify 1k and 100k events", total=2) as step:
        for agents, per_chain in ((500, 2), (1000, 100)):
            results.append(measure(server, keys, agents, per_chain, args.rounds))
            step.advance()
    small, large = results
    OUT.line(
        f"audit verify benchmark: median of {args.rounds}, {journal.VERIFY_CHUNK_CHAINS} chains per chunk;"
        " incremental = after one new event on each of 10 chains"
    )
    OUT.line(f"  {'':34}{'1k events':>12}{'100k events':>14}{'100k / 1k':>12}")
    for label, key in (
        ("full pass", "full"),
        ("  its longest chunk", "full_chunk"),
        ("incremental pass", "incremental"),
        ("  its longest chunk", "incremental_chunk"),
    ):
        a, b = small[key] * 1000, large[key] * 1000
        OUT.line(f"  {label:34}{a:10.1f}ms{b:12.1f}ms{b / a:11.2f}x")
    OUT.line(
        f"  incremental / full at 100k events: {large['incremental'] / large['full']:.3f}x;"
        f" longest incremental chunk / longest full chunk: {large['incremental_chunk'] / large['full_chunk']:.3f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
