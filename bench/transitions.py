"""Benchmark: transitions through ``agents.core.transition()`` beside a raw psycopg baseline, in the same run, with
metrics on and off (``make bench-transitions``; :data:`DESCRIPTION`, its ``--help``, says how it measures).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import random
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import psycopg

from agents.cli.progress import Progress
from agents.cli.progress import Step as ProgressStep
from agents.client import Client
from agents.core import observe
from agents.core.commands import Command, JobSpec
from agents.core.phases import Event, Phase
from agents.core.transition import create_agent, transition
from agents.observability.metrics import MetricsObserver
from models import migrations
from models.audit_keys import audit_keys_for
from models.db import Database
from models.embedded import database_url_for
from models.kpi_sql import fold
from models.settings import Settings
from models.urls import libpq_url, with_database

#: The benchmark's ``--help``: what it measures and how.
DESCRIPTION = """\
Benchmark: transitions through ``agents.core.transition()`` beside a raw psycopg baseline, in the same run.

The baseline runs the same statements with no Keel code around them — ``SELECT … FOR UPDATE`` on the agent row,
``INSERT`` one journal event, ``UPDATE`` the row, ``COMMIT`` — on its own connections and its own agents, with the same
threads. Keel's transitions run twice per round: with metrics on (the KPI triggers of migration 0009 counting in
every transaction, the leading beat's fold every ``KEEL_KPI_FOLD_SECONDS``, and the observers in
:data:`OBSERVERS`) and with metrics off (those triggers disabled in the benchmark's own database, no observer, no
fold); the target is on within 10% of off. Scenarios:

  (a) one connection, one agent
  (b) 8 connections over 1,000 agents (each connection works through its own share of them)
  (c) 8 connections on one agent (every transaction waits for the row lock)
  (d) a producer's commands: submit and cancel in turn, 8 connections over 400 agents — raw psycopg running the
      statements a submit and a cancel run (lock the row, insert the request and its job or cancel the jobs,
      insert the event, update the row), ``transition()`` with the same commands, and ``Client.submit`` /
      ``Client.cancel`` (input checks, the command, the state it returns); metrics on throughout

Run with ``make bench`` (or ``python -m bench.transitions``). Uses KEEL_DATABASE_URL's server, else the embedded one;
the benchmark creates and drops a database of its own there.
"""

Step = Callable[[int], None]  # does one transition; the argument is the iteration number

#: The KPI triggers (migration 0009), by table: what "metrics off" disables.
KPI_TRIGGERS = {"audit.journal": "journal_kpis", "jobs": "jobs_kpis", "delivery_log": "delivery_log_kpis"}
#: Makers of the process-local observers that "metrics on" registers (agents.core.observe.register): the
#: Prometheus histograms every Keel process records.
OBSERVERS: list[Callable[[], observe.Observer]] = [MetricsObserver]


OUT = Progress()  # live on a terminal, plain lines in a pipe or a file


@dataclass
class Result:
    label: str
    count: int
    seconds: float
    latencies: list[float]

    @property
    def rate(self) -> float:
        return self.count / self.seconds

    def pct(self, p: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] * 1000


def run_threads(label: str, steps: list[Step], duration: float) -> Result:
    """Each thread runs its own step function for ``duration`` seconds; all start together."""
    barrier = threading.Barrier(len(steps) + 1)
    stop = threading.Event()
    per_thread: list[list[float]] = [[] for _ in steps]

    def loop(n: int) -> None:
        lat = per_thread[n]
        step = steps[n]
        barrier.wait()
        i = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            step(i)
            lat.append(time.perf_counter() - t0)
            i += 1

    threads = [threading.Thread(target=loop, args=(n,)) for n in range(len(steps))]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    time.sleep(duration)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    latencies = [x for lat in per_thread for x in lat]
    return Result(label, len(latencies), elapsed, latencies)


class Metrics:
    """Switches the KPI counting on or off in the benchmark's own database (and the observers in this process);
    while on, a thread folds the counters every ``fold_seconds``, as the leading beat does."""

    def __init__(self, db: Database, fold_seconds: float) -> None:
        self.db = db
        self.fold_seconds = fold_seconds
        self.observers = [make() for make in OBSERVERS]
        self._stop = threading.Event()
        self._folder: threading.Thread | None = None

    def switch(self, on: bool) -> None:
        self._stop.set()
        if self._folder is not None:
            self._folder.join()
        with self.db.transaction() as cur:
            for table, trigger in KPI_TRIGGERS.items():
                cur.execute(f"ALTER TABLE {table} {'ENABLE' if on else 'DISABLE'} TRIGGER {trigger}")
        for observer in self.observers:
            (observe.register if on else observe.unregister)(observer)
        fold(self.db)  # not measured: each run starts with no backlog of deltas
        self._stop = threading.Event()
        self._folder = threading.Thread(target=self._fold_every, args=(self._stop,), daemon=True) if on else None
        if self._folder is not None:
            self._folder.start()

    def stop(self) -> None:
        """Stop folding (before the database goes away)."""
        self._stop.set()
        if self._folder is not None:
            self._folder.join()
            self._folder = None

    def _fold_every(self, stop: threading.Event) -> None:
        while not stop.wait(self.fold_seconds):
            fold(self.db)


# --- the raw baseline ------------------------------------------------------------------------------------------

RAW_LOCK = "SELECT phase, revision, journal_seq, journal_head FROM agents WHERE id = %s FOR UPDATE"
RAW_UPDATE = (
    "UPDATE agents SET phase = %s, revision = %s, updated_at = %s, journal_seq = %s, journal_head = %s WHERE id = %s"
)
RAW_INSERT = (
    "INSERT INTO audit.journal (agent_id, seq, kind, event, actor, request_id, from_phase, to_phase, revision,"
    " decision, details, at, prev_hash, hash) VALUES (%s, %s, 'transition', %s, 'bench', NULL, %s, %s, %s,"
    " 'accepted', '{}', %s, %s, %s)"
)
FLIP = {"planning": ("executing", "plan"), "executing": ("planning", "observe")}


def raw_step(conn: psycopg.Connection[Any], agents: list[UUID], *, flip: bool) -> Step:
    def step(i: int) -> None:
        agent_id = agents[i % len(agents)]
        with conn.cursor() as cur:
            cur.execute(RAW_LOCK, (agent_id,))
            phase, revision, seq, head = cur.fetchone()  # type: ignore[misc]
            target, event = FLIP[phase] if flip else (phase, "progress")
            digest = hashlib.sha256(f"{head}{seq + 1}".encode()).hexdigest()
            at = datetime.now(UTC)
            # The event first, then the head (as Keel's CTE does): the journal's guard wants the head one behind.
            cur.execute(RAW_INSERT, (agent_id, seq + 1, event, phase, target, revision + 1, at, head, digest))
            cur.execute(RAW_UPDATE, (target, revision + 1, at, seq + 1, digest, agent_id))
        conn.commit()

    return step


RAW_REQUEST = "INSERT INTO requests (request_id, agent_id, input, actor, submitted_at) VALUES (%s, %s, %s, 'bench', %s)"
RAW_JOB = (
    "INSERT INTO jobs (key, agent_id, request_id, operation, target, payload, status, queue, priority, run_at,"
    " created_at, updated_at) VALUES (%s, %s, %s, 'plan', '1', %s, 'pending', 'keel.jobs', 5, %s, %s, %s)"
    " ON CONFLICT (key) DO NOTHING"
)
RAW_CANCEL_JOBS = (
    "UPDATE jobs SET status = 'cancelled', finished_at = %s, updated_at = %s"
    " WHERE agent_id = %s AND status IN ('pending', 'enqueued', 'running')"
)
RAW_COMMAND_UPDATE = (
    "UPDATE agents SET phase = %s, revision = %s, request_id = %s, updated_at = %s, journal_seq = %s,"
    " journal_head = %s WHERE id = %s"
)
#: A producer's input: what the plan handler's input model accepts.
INPUT = {"prompt": "bench"}


def raw_command_step(conn: psycopg.Connection[Any], agents: list[UUID], requests: itertools.count[int]) -> Step:
    """A submit (from rest) or a cancel (while planning), as the statements Keel's run, with nothing around them."""

    def step(i: int) -> None:
        agent_id = agents[i % len(agents)]
        with conn.cursor() as cur:
            cur.execute(RAW_LOCK, (agent_id,))
            phase, revision, seq, head = cur.fetchone()  # type: ignore[misc]
            at = datetime.now(UTC)
            if phase == "planning":
                target, event, request_id = "failed", "cancel", None
                cur.execute(RAW_CANCEL_JOBS, (at, at, agent_id))
            else:
                target, event, request_id = "planning", "submit", f"raw-{next(requests)}"
                payload = json.dumps({"input": INPUT})
                cur.execute(RAW_REQUEST, (request_id, agent_id, json.dumps(INPUT), at))
                cur.execute(RAW_JOB, (f"{request_id}:plan:1", agent_id, request_id, payload, at, at, at))
            digest = hashlib.sha256(f"{head}{seq + 1}".encode()).hexdigest()
            cur.execute(RAW_INSERT, (agent_id, seq + 1, event, phase, target, revision + 1, at, head, digest))
            cur.execute(RAW_COMMAND_UPDATE, (target, revision + 1, request_id, at, seq + 1, digest, agent_id))
        conn.commit()

    return step


# --- through Keel ----------------------------------------------------------------------------------------------


def keel_step(db: Database, agents: list[UUID], phases: dict[UUID, Phase], *, flip: bool) -> Step:
    def step(i: int) -> None:
        agent_id = agents[i % len(agents)]
        if flip:
            event = Event.PLAN if phases[agent_id] is Phase.PLANNING else Event.OBSERVE
        else:
            event = Event.PROGRESS
        result = transition(db, Command(agent_id, event, "bench"))
        if flip:
            phases[agent_id] = Phase(result.agent.phase)

    return step


def command_step(db: Database, agents: list[UUID], phases: dict[UUID, Phase], requests: itertools.count[int]) -> Step:
    """A producer's submit or cancel through ``transition()`` alone: the commands ``Client`` makes."""

    def step(i: int) -> None:
        agent_id = agents[i % len(agents)]
        if phases[agent_id] is Phase.PLANNING:
            command = Command(agent_id, Event.CANCEL, "bench", details={"reason": "bench"})
            input_json = "null"
        else:
            request_id = f"t-{next(requests)}"
            input_json = json.dumps(INPUT, sort_keys=True, separators=(",", ":"))
            jobs = (JobSpec("plan", "1", payload={"input": INPUT}),)
            command = Command(agent_id, Event.SUBMIT, "bench", request_id=request_id, jobs=jobs)
        phases[agent_id] = Phase(transition(db, command, input_json=input_json).agent.phase)

    return step


def client_step(client: Client, agents: list[UUID], phases: dict[UUID, Phase], requests: itertools.count[int]) -> Step:
    """A producer's submit or cancel through ``Client``, taking the state it returns."""

    def step(i: int) -> None:
        agent_id = agents[i % len(agents)]
        if phases[agent_id] is Phase.PLANNING:
            state = client.cancel(agent_id, actor="bench", reason="bench")
        else:
            state = client.submit(agent_id, f"c-{next(requests)}", INPUT, actor="bench")
        phases[agent_id] = Phase(state.phase)

    return step


def make_agents(
    db: Database, prefix: str, n: int, step: ProgressStep | None = None, *, submit: bool = True
) -> list[UUID]:
    ids = []
    for k in range(n):
        row = create_agent(db, f"{prefix}-{k}", budget_tokens=None, budget_cost=None, actor="bench")
        if submit:
            transition(db, Command(row.id, Event.SUBMIT, "bench", request_id=f"{prefix}-{k}-r"))
        ids.append(row.id)
        if step is not None:
            step.advance()
    return ids


def report(name: str, raw: list[Result], keel: list[Result], off: list[Result]) -> tuple[float, float]:
    """Print the three sides of a scenario; returns (keel/raw, metrics on/off)."""
    raw_rate = statistics.mean(r.rate for r in raw)
    keel_rate = statistics.mean(r.rate for r in keel)
    off_rate = statistics.mean(r.rate for r in off)
    ratio = keel_rate / raw_rate
    OUT.line(f"\n{name}")
    for label, runs in (("raw psycopg", raw), ("keel, metrics off", off), ("keel, metrics on", keel)):
        lat = [x for r in runs for x in r.latencies]
        merged = Result(label, sum(r.count for r in runs), sum(r.seconds for r in runs), lat)
        OUT.line(
            f"  {label:<18} {merged.rate:>8.0f} transitions/s   p50 {merged.pct(50):6.2f} ms   "
            f"p95 {merged.pct(95):6.2f} ms   p99 {merged.pct(99):6.2f} ms   ({merged.count} in {merged.seconds:.1f}s)"
        )
    OUT.line(f"  ratio keel/raw     {ratio:.2f}x")
    OUT.line(f"  ratio on/off       {keel_rate / off_rate:.2f}x (metrics on costs {1 - keel_rate / off_rate:+.1%})")
    return ratio, keel_rate / off_rate


def commands(
    db: Database,
    raw_conns: list[psycopg.Connection[Any]],
    args: argparse.Namespace,
    shares: Callable[[list[UUID]], list[list[UUID]]],
) -> dict[str, float]:
    """Scenario (d): a producer's submit and cancel, raw, through ``transition()`` and through ``Client``, the three
    sides alternated round by round; returns each Keel side's ratio to raw."""
    n = args.command_agents
    label = f"(d) submit/cancel, {args.threads} connections over {n} agents"
    with OUT.task(f"seeding {3 * n} idle agents", total=3 * n) as seeding:
        raw_ids = make_agents(db, "dr", n, seeding, submit=False)
        core_ids = make_agents(db, "dt", n, seeding, submit=False)
        client_ids = make_agents(db, "dc", n, seeding, submit=False)
    phases = dict.fromkeys(core_ids + client_ids, Phase.IDLE)
    requests = itertools.count()
    client = Client(db)
    sides: dict[str, list[Step]] = {
        "raw psycopg": [raw_command_step(c, s, requests) for c, s in zip(raw_conns, shares(raw_ids), strict=True)],
        "transition()": [command_step(db, s, phases, requests) for s in shares(core_ids)],
        "client": [client_step(client, s, phases, requests) for s in shares(client_ids)],
    }
    runs: dict[str, list[Result]] = {side: [] for side in sides}
    for steps in sides.values():
        run_threads("warm-up", steps, 0.5)
    order = list(sides)
    with OUT.task(f"{label}: {args.rounds} rounds of {args.duration}s each side", total=3 * args.rounds) as step:
        for n_round in range(args.rounds):
            for side in order[n_round % 3 :] + order[: n_round % 3]:  # rotated: no side always first
                runs[side].append(run_threads(side, sides[side], args.duration))
                step.advance()
    raw_rate = statistics.mean(r.rate for r in runs["raw psycopg"])
    OUT.line(f"\n{label}")
    for side, side_runs in runs.items():
        lat = [x for r in side_runs for x in r.latencies]
        merged = Result(side, sum(r.count for r in side_runs), sum(r.seconds for r in side_runs), lat)
        OUT.line(
            f"  {side:<18} {merged.rate:>8.0f} commands/s      p50 {merged.pct(50):6.2f} ms   "
            f"p95 {merged.pct(95):6.2f} ms   p99 {merged.pct(99):6.2f} ms   ({merged.count} in {merged.seconds:.1f}s)"
        )
    ratios = {
        "transition": statistics.mean(r.rate for r in runs["transition()"]) / raw_rate,
        "client": statistics.mean(r.rate for r in runs["client"]) / raw_rate,
    }
    OUT.line(f"  ratio transition()/raw {ratios['transition']:.2f}x")
    OUT.line(f"  ratio client/raw       {ratios['client']:.2f}x")
    return ratios


def transitions(
    db: Database,
    raw_conns: list[psycopg.Connection[Any]],
    metrics: Metrics,
    args: argparse.Namespace,
    shares: Callable[[list[UUID]], list[list[UUID]]],
) -> tuple[float, float]:
    """Scenarios (a)-(c): raw beside ``transition()`` with metrics on and off; returns (b)'s keel/raw and on/off."""
    with OUT.task(f"seeding {2 * args.agents + 4} agents", total=2 * args.agents + 4) as seeding:
        keel_many, raw_many = make_agents(db, "k", args.agents, seeding), make_agents(db, "r", args.agents, seeding)
        keel_one, raw_one = make_agents(db, "k1", 1, seeding), make_agents(db, "r1", 1, seeding)
        keel_hot, raw_hot = make_agents(db, "kh", 1, seeding), make_agents(db, "rh", 1, seeding)
    phases = dict.fromkeys(keel_many + keel_one + keel_hot, Phase.PLANNING)
    scenarios = [
        (
            "(a) 1 connection, 1 agent",
            [raw_step(raw_conns[0], raw_one, flip=True)],
            [keel_step(db, keel_one, phases, flip=True)],
        ),
        (
            f"(b) {args.threads} connections over {args.agents} agents",
            [raw_step(c, s, flip=True) for c, s in zip(raw_conns, shares(raw_many), strict=True)],
            [keel_step(db, s, phases, flip=True) for s in shares(keel_many)],
        ),
        (
            f"(c) {args.threads} connections on 1 agent",
            [raw_step(c, raw_hot, flip=False) for c in raw_conns],
            [keel_step(db, keel_hot, phases, flip=False) for _ in range(args.threads)],
        ),
    ]
    ratios, costs = {}, {}
    for label, raw_steps, keel_steps in scenarios:
        run_threads("warm-up", raw_steps, 0.5)
        run_threads("warm-up", keel_steps, 0.5)
        raw_runs, keel_runs, off_runs = [], [], []
        with OUT.task(f"{label}: {args.rounds} rounds of {args.duration}s each side", total=3 * args.rounds) as step:
            for n in range(args.rounds):
                raw_runs.append(run_threads("raw", raw_steps, args.duration))
                step.advance()
                for on in (True, False) if n % 2 else (False, True):  # alternated: neither side always first
                    metrics.switch(on)
                    (keel_runs if on else off_runs).append(run_threads("keel", keel_steps, args.duration))
                    step.advance()
        metrics.switch(True)
        ratios[label], costs[label] = report(label, raw_runs, keel_runs, off_runs)
    return ratios[scenarios[1][0]], costs[scenarios[1][0]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per measured run (default 4)")
    parser.add_argument("--rounds", type=int, default=2, help="raw/keel alternations per scenario (default 2)")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--command-agents", type=int, default=400, help="agents of scenario (d) per side")
    parser.add_argument(
        "--only-commands", action="store_true", help="run scenario (d) alone (when profiling the client's path)"
    )
    parser.add_argument("--fold-seconds", type=float, default=Settings().kpi_fold_seconds)
    args = parser.parse_args(argv)

    server = database_url_for(Settings())
    name = f"keel_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(libpq_url(with_database(server, "postgres")), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = with_database(server, name)
    try:
        migrations.upgrade(url)
        db = Database(url, pool_size=args.threads + 2, audit_keys=audit_keys_for(Settings()))
        OUT.line(f"transition benchmark on {name}: {args.duration}s runs, {args.rounds} rounds, threads={args.threads}")
        metrics = Metrics(db, args.fold_seconds)
        raw_conns = [psycopg.connect(libpq_url(url)) for _ in range(args.threads)]

        def shares(ids: list[UUID]) -> list[list[UUID]]:
            shuffled = random.Random(7).sample(ids, len(ids))
            return [shuffled[n :: args.threads] for n in range(args.threads)]

        targets = None if args.only_commands else transitions(db, raw_conns, metrics, args, shares)
        metrics.switch(True)
        client_ratio = commands(db, raw_conns, args, shares)["client"]
        metrics.stop()
        for conn in raw_conns:
            conn.close()
        db.dispose()
        if targets is not None:
            target, on_off = targets
            OUT.line(
                f"\ntarget: (b) at least 0.70x the raw baseline -> {target:.2f}x"
                f" {'met' if target >= 0.7 else 'NOT MET'}"
            )
            OUT.line(
                f"target: (b) metrics on within 10% of metrics off -> {on_off:.2f}x"
                f" {'met' if on_off >= 0.9 else 'NOT MET'}"
            )
        OUT.line(
            f"target: (d) Client at least 0.70x the raw baseline -> {client_ratio:.2f}x"
            f" {'met' if client_ratio >= 0.7 else 'NOT MET'}"
        )
    finally:
        with psycopg.connect(libpq_url(with_database(server, "postgres")), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return 0


if __name__ == "__main__":
    sys.exit(main())
