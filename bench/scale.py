"""Benchmark: does the cost of Keel's hot paths grow with history? The same measures on 1,000,000 agents' seeded
history and on 1/1000 of it, in one run (``make bench-scale``; :data:`DESCRIPTION`, its ``--help``, says how it
measures).
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from uuid import UUID

import psycopg
import redis
from celery import Celery

from agents.cli.progress import Progress
from agents.core.commands import Command, JobSpec, MessageSpec
from agents.core.journal import verify
from agents.core.keys import make_key, request_id_of, request_key
from agents.core.phases import Event
from agents.core.transition import create_agent, transition
from agents.jobs.deadlines import enforce
from agents.outbox.relay import Backoff, Relay
from agents.outbox.senders import SlackSender
from agents.runtime.loop import conversation
from bench import seed
from models import migrations
from models.db import Database
from models.embedded import broker_url_for, database_url_for
from models.jobs_sql import claim, pending_jobs, unpublish
from models.kpi_sql import snapshot, totals
from models.settings import Settings
from models.urls import libpq_url, with_database
from tasks.app import make_app
from tasks.dispatcher import dispatch_once
from tests.support.fakes import FakeSlack

#: The benchmark's ``--help``: what it measures and how.
DESCRIPTION = """\
Benchmark: does the cost of Keel's hot paths grow with history? The same measures on a database holding
1,000,000 agents' finished history (10,000,000 jobs, 1,000,000 delivered messages, 12,000,000 journal events) and on
one holding 1/1000 of it, in the same run; the target is every p95 at 1M within 1.2x of its value at 1k.

The histories are seeded once (bench/seed.py: COPY and generate_series, minutes) into databases of their own,
``keel_bench_scale_1m`` and ``keel_bench_scale_1k``, which later runs reuse: a database comment records the seed's
version and sizes (``--reseed`` rebuilds them). Each run migrates them to the code's head (a migration adding an
index lands on 10M jobs, as it would in production), measures on throwaway copies of them
(``CREATE DATABASE … TEMPLATE``, dropped at the end), so the seeds stay as they were, and on both starts the same
work in flight: ``--live`` agents, each with a request whose plan step is due.

Each measure is a small function calling the Keel function that does the work (``MEASURES``): when that function
changes, the bench measures the new code. Run with ``make bench-scale`` (or ``python -m bench.scale``). Uses
KEEL_DATABASE_URL's server (as a superuser: the seed switches the journal's guards off), else the embedded one,
and KEEL_BROKER_URL's Redis, under a key prefix of its own that it deletes afterwards.
"""

OUT = Progress()  # live on a terminal, plain lines in a pipe or a file

TARGET = 1.2
DEFAULT_AGENTS = 1_000_000
SMALL_FACTOR = 1000  # the small database holds 1/1000 of the large one
TOKEN = "xoxb-bench-scale-0000"
LIVE_CHANNEL = "C900001"
#: Seeded databases are named so; nothing else is ever dropped.
DATABASE_PREFIX = "keel_bench_scale_"


def database_name(agents: int) -> str:
    if agents % 1_000_000 == 0:
        return f"{DATABASE_PREFIX}{agents // 1_000_000}m"
    if agents % 1000 == 0:
        return f"{DATABASE_PREFIX}{agents // 1000}k"
    return f"{DATABASE_PREFIX}{agents}"


@dataclass
class Bed:
    """One database under test and the work in flight on it."""

    label: str
    db: Database
    settings: Settings
    celery: Celery
    relay: Relay
    sizes: seed.Sizes
    live: list[UUID] = field(default_factory=list)  # agents with a request in flight (planning)
    live_requests: list[str] = field(default_factory=list)  # each live agent's request key
    counter: itertools.count[int] = field(default_factory=itertools.count)
    rng: random.Random = field(default_factory=lambda: random.Random(15))

    def next(self) -> int:
        return next(self.counter)


def timed(call: Callable[[], Any]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


# --- the measures: one sample each; what is set up before the timed call is not counted --------------------------


def measure_transition(bed: Bed) -> float:
    """One committed transition (agents/core/transition.py) of an agent in flight."""
    agent = bed.live[bed.next() % len(bed.live)]
    return timed(lambda: transition(bed.db, Command(agent, Event.PROGRESS, "bench")))


def measure_claim(bed: Bed) -> float:
    """A worker's claim of a due job (models/jobs_sql.py claim, what Runner.run does first)."""
    i = bed.next()
    n = i % len(bed.live)
    transition(bed.db, Command(bed.live[n], Event.PROGRESS, "bench", jobs=(JobSpec("tool", f"claim.{i}"),)))
    key = make_key(bed.live_requests[n], "tool", f"claim.{i}")
    return timed(lambda: claim(bed.db, key, "bench", timedelta(minutes=30)))


def measure_dispatch(bed: Bed) -> float:
    """One dispatcher tick (tasks/dispatcher.py dispatch_once) with ten jobs due again."""
    agents = [bed.live[(bed.next() * 10 + n) % len(bed.live)] for n in range(10)]
    keys = [job["key"] for agent in agents for job in pending_jobs(bed.db, agent) if job["status"] == "enqueued"]
    unpublish(bed.db, keys)
    return timed(lambda: dispatch_once(bed.db, bed.celery, bed.settings))


def measure_relay(bed: Bed) -> float:
    """One relay pass (agents/outbox/relay.py run_pass) delivering the one message due."""
    i = bed.next()
    agent = bed.live[i % len(bed.live)]
    message = MessageSpec("slack", LIVE_CHANNEL, f"bench.{i}", {"text": f"message {i}"})
    transition(bed.db, Command(agent, Event.PROGRESS, "bench", messages=(message,)))
    return timed(bed.relay.run_pass)


def measure_conversation(bed: Bed) -> float:
    """A plan step's conversation read (agents/runtime/loop.py conversation, over models/jobs_sql.py)."""
    n = bed.next() % len(bed.live_requests)
    request = bed.live_requests[n]
    return timed(
        lambda: conversation(bed.db, bed.live[n], request_id_of(f"{request}::"), make_key(request, "plan", "2"))
    )


def measure_deadlines(bed: Bed) -> float:
    """One deadline pass (agents/jobs/deadlines.py enforce); the agents in flight have deadlines still ahead."""
    return timed(lambda: enforce(bed.db))


def measure_kpi(bed: Bed) -> float:
    """`keel kpi`: the KPIs since the counters began (models/kpi_sql.py totals)."""
    return timed(lambda: totals(bed.db))


def measure_scrape(bed: Bed) -> float:
    """A /metrics scrape's read: the counters and the live gauges in one transaction (models/kpi_sql.py snapshot)."""
    return timed(lambda: snapshot(bed.db, statement_timeout=timedelta(seconds=30)))


VERIFY_BATCH = 100


class _OneChunk(Exception):
    """Raised from verify's ``on_chunk``: the timed chunk's reads are done."""


def measure_verify(bed: Bed) -> float:
    """One chunk of `keel audit verify` (agents/core/journal/verification.py, incremental, VERIFY_BATCH chains a chunk):
    timed from the call to the end of its first chunk's reads and checks, when ``on_chunk`` stops it."""

    def stop(raw: Any) -> None:
        raise _OneChunk

    def one_chunk() -> None:
        try:
            verify(bed.db, full=False, chunk_chains=VERIFY_BATCH, on_chunk=stop)
        except _OneChunk:
            return
        raise AssertionError("verify ended before its first chunk was done")

    return timed(one_chunk)


MEASURES: dict[str, Callable[[Bed], float]] = {
    "transition": measure_transition,
    "claim": measure_claim,
    "dispatcher tick": measure_dispatch,
    "relay pass": measure_relay,
    "conversation read": measure_conversation,
    "deadline pass": measure_deadlines,
    "kpi": measure_kpi,
    "kpi scrape": measure_scrape,
    f"audit verify, a chunk of {VERIFY_BATCH} chains": measure_verify,
}


# --- seeded databases ----------------------------------------------------------------------------------------------


def _admin(server: str) -> psycopg.Connection[Any]:
    return psycopg.connect(libpq_url(with_database(server, "postgres")), autocommit=True)


def _comment(admin: psycopg.Connection[Any], name: str) -> str | None:
    row = admin.execute(
        "SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = %s", (name,)
    ).fetchone()
    return None if row is None else (row[0] or "")


def _drop(admin: psycopg.Connection[Any], name: str) -> None:
    if not name.startswith(DATABASE_PREFIX):  # the bench's own, nothing else
        raise ValueError(f"refusing to drop {name!r}: not a bench-scale database")
    admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def ensure_seeded(server: str, sizes: seed.Sizes, *, reseed: bool) -> str:
    """The name of a database holding ``sizes``' seed, migrated to the code's head: reused when its comment says it
    holds exactly that seed, else (or with ``reseed``) seeded again."""
    name = database_name(sizes.agents)
    url = with_database(server, name)
    with _admin(server) as admin:
        comment = _comment(admin, name)
        if comment == sizes.marker() and not reseed:
            OUT.line(f"reusing {name} ({comment})")
            admin.close()
            migrations.upgrade(url)
            return name
        if comment is not None:
            why = "--reseed" if reseed else f"its seed is not this one ({comment or 'unfinished'})"
            OUT.line(f"dropping {name}: {why}")
            _drop(admin, name)
        admin.execute(f'CREATE DATABASE "{name}"')
    migrations.upgrade(url)
    started = time.perf_counter()
    with OUT.task(f"seeding {name}: {sizes.agents} agents", total=sizes.agents) as step:
        with psycopg.connect(libpq_url(url)) as conn:
            last = 0

            def progress(done: int) -> None:
                nonlocal last
                step.advance(done - last)
                last = done

            seed.seed(conn, sizes, progress)
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE)")
    db = Database(url, pool_size=2, audit_keys=seed.BENCH_KEYS)
    try:
        problems = seed.check(db, sizes)
    finally:
        db.dispose()
    if problems:
        raise SystemExit(f"the seed of {name} is not sound:\n  " + "\n  ".join(problems))
    with _admin(server) as admin:
        admin.execute(f"COMMENT ON DATABASE \"{name}\" IS '{sizes.marker()}'")
    OUT.line(f"seeded {name} in {time.perf_counter() - started:.0f}s: {sizes.marker()}")
    return name


# --- a run ---------------------------------------------------------------------------------------------------------


def make_bed(label: str, url: str, sizes: seed.Sizes, live: int, slack_url: str, prefix: str) -> Bed:
    settings = Settings(broker_prefix=prefix)
    db = Database(url, pool_size=8, audit_keys=seed.BENCH_KEYS)
    relay = Relay(
        db,
        {"slack": SlackSender(TOKEN, f"{slack_url}/api/", 10.0)},
        lease=timedelta(seconds=60),
        concurrency=1,
        backoff=Backoff(0.1, 1.0, 5),
        pass_seconds=30,
    )
    bed = Bed(label, db, settings, make_app(settings), relay, sizes)
    run = uuid.uuid4().hex[:6]
    for n in range(live):
        row = create_agent(db, f"live-{run}-{n}", budget_tokens=None, budget_cost=None, actor="bench")
        request = f"live-{run}-{n}-r"
        transition(
            db,
            Command(row.id, Event.SUBMIT, "bench", request_id=request, hard_deadline=timedelta(hours=6),
                    jobs=(JobSpec("plan", "1"),)),
            input_json='{"text": "look something up"}',
        )  # fmt: skip
        bed.live.append(row.id)
        bed.live_requests.append(request_key(row.id, request))
    dispatch_once(db, bed.celery, settings)  # the plan steps are published: the steady state every tick starts from
    return bed


def pct(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] * 1000


MIN_SAMPLES = 10


def run(beds: list[Bed], samples: int, budget: float) -> dict[str, dict[str, list[float]]]:
    """Every measure on every bed, alternating in blocks so neither database always goes first. A measure stops
    early once it has :data:`MIN_SAMPLES` samples on every bed and has run ``budget`` seconds on one of them (a
    full scan of 10M rows can take seconds a sample)."""
    results: dict[str, dict[str, list[float]]] = {}
    with OUT.task(
        f"{len(MEASURES)} measures x {samples} samples on {len(beds)} databases", total=len(MEASURES)
    ) as step:
        for name, measure in MEASURES.items():
            by_bed: dict[str, list[float]] = {bed.label: [] for bed in beds}
            results[name] = by_bed
            for bed in beds:
                for _ in range(3):  # warm-up: caches, prepared plans, pool connections
                    measure(bed)
            block = 5
            for start in range(0, samples, block):
                if start >= MIN_SAMPLES and max(sum(taken) for taken in by_bed.values()) > budget:
                    break
                order = beds if (start // block) % 2 == 0 else list(reversed(beds))
                for bed in order:
                    for _ in range(min(block, samples - start)):
                        by_bed[bed.label].append(measure(bed))
            step.advance()
    return results


#: Resamples behind a ratio's interval (:func:`ratio_interval`); seeded, so a report can be run again on its samples.
RESAMPLES = 2000


def ratio_interval(
    small: list[float], large: list[float], p: float = 95, *, level: float = 0.90, resamples: int = RESAMPLES
) -> tuple[float, float]:
    """A bootstrap interval (percentile method, ``level`` of the resamples) of ``pct(large, p) / pct(small, p)``,
    each side resampled with replacement on its own: how far the ratio could move on the same measure taken again
    (why: docs/explanation/runtime-outbox-and-workers.md#ratio-intervals-in-the-scale-benchmark)."""
    if not small or not large:
        raise ValueError("a ratio interval needs samples on both sides")
    rng = random.Random(15)
    ratios = sorted(
        pct(rng.choices(large, k=len(large)), p) / pct(rng.choices(small, k=len(small)), p) for _ in range(resamples)
    )
    tail = (1 - level) / 2
    return ratios[int(tail * (resamples - 1))], ratios[round((1 - tail) * (resamples - 1))]


def report(results: dict[str, dict[str, list[float]]], small: str, large: str) -> None:
    OUT.line("")
    header = f"{'measure':<28} {small + ' p50':>10} {small + ' p95':>10} {large + ' p50':>10} {large + ' p95':>10}"
    OUT.line(f"{header} {'p95 ratio':>10} {'90% interval':>14}  {'samples':>7}  target <= {TARGET}x")
    met = grew = 0
    for name, by_bed in results.items():
        a, b = by_bed[small], by_bed[large]
        ratio = pct(b, 95) / pct(a, 95)
        low, high = ratio_interval(a, b)
        ok = ratio <= TARGET
        met += ok
        grew += low > TARGET
        verdict = "met" if ok else "NOT MET" + (" (grew)" if low > TARGET else " (within its interval)")
        OUT.line(
            f"{name:<28} {pct(a, 50):>8.2f}ms {pct(a, 95):>8.2f}ms {pct(b, 50):>8.2f}ms {pct(b, 95):>8.2f}ms"
            f" {ratio:>9.2f}x {low:>6.2f}-{high:.2f}x  {len(b):>7}  {verdict}"
        )
    OUT.line(f"\n{met} of {len(results)} measures within {TARGET}x (p95 at {large} over p95 at {small})")
    OUT.line(
        f"{grew} of {len(results)} with the whole 90% interval of the ratio above {TARGET}x (the cost grew with the"
        " history, not one slow tail)"
    )


def _positive(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below the minimum, {minimum}")
        return value

    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.scale", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--agents",
        type=_positive(SMALL_FACTOR),
        default=DEFAULT_AGENTS,
        help=f"agents in the large database, a multiple of {SMALL_FACTOR} (default 1,000,000); the small one holds"
        f" 1/{SMALL_FACTOR} of them",
    )
    p.add_argument("--samples", type=_positive(5), default=200, help="samples per measure and database (default 200)")
    p.add_argument(
        "--budget",
        type=_positive(1),
        default=60,
        help=f"seconds a measure may take on one database before it stops at its samples so far (at least"
        f" {MIN_SAMPLES}; default 60)",
    )
    p.add_argument("--live", type=_positive(10), default=100, help="agents in flight on each database (default 100)")
    p.add_argument("--reseed", action="store_true", help="seed both databases again, even if their seed matches")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if args.agents % SMALL_FACTOR:
        p.error(f"--agents must be a multiple of {SMALL_FACTOR}, got {args.agents}")
    return args


def _label(agents: int) -> str:
    return database_name(agents).removeprefix(DATABASE_PREFIX)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = database_url_for(Settings())
    large, small = seed.Sizes(args.agents), seed.Sizes(args.agents // SMALL_FACTOR)
    seeded = [(small, ensure_seeded(server, small, reseed=args.reseed))]
    seeded.append((large, ensure_seeded(server, large, reseed=args.reseed)))
    run_id = uuid.uuid4().hex[:8]
    prefix = f"keel-bench-scale-{run_id}:"
    copies: list[str] = []
    fake = FakeSlack(token=TOKEN).start()
    beds: list[Bed] = []
    try:
        for sizes, name in seeded:
            copy = f"{DATABASE_PREFIX}run_{run_id}_{_label(sizes.agents)}"
            started = time.perf_counter()
            with _admin(server) as admin:
                copies.append(copy)
                admin.execute(f'CREATE DATABASE "{copy}" TEMPLATE "{name}" STRATEGY FILE_COPY')
            OUT.line(f"copied {name} to {copy} in {time.perf_counter() - started:.1f}s")
            bed = make_bed(_label(sizes.agents), with_database(server, copy), sizes, args.live, fake.url, prefix)
            beds.append(bed)
        results = run(beds, args.samples, args.budget)
        OUT.line(
            f"\nscale benchmark: {args.samples} samples per measure, {args.live} agents in flight on each database;"
            f" history: {large.agents} vs {small.agents} agents, {large.jobs} vs {small.jobs} finished jobs,"
            f" {large.events} vs {small.events} journal events"
        )
        report(results, beds[0].label, beds[1].label)
    finally:
        for bed in beds:
            bed.relay.close()
            bed.db.dispose()
        fake.stop()
        with _admin(server) as admin:
            for copy in copies:
                _drop(admin, copy)
        broker = redis.Redis.from_url(broker_url_for(Settings()))
        keys = list(broker.scan_iter(match=f"{prefix}*"))
        if keys:
            broker.delete(*keys)
    return 0


if __name__ == "__main__":
    sys.exit(main())
