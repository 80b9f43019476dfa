"""Many jobs in one process (the threads pool): one lease statement for all of them, a run limit that ends one job
(its thread fenced off) and not its neighbours, and the process replaced only once its stuck work reaches the
limit."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from agents.client import Client
from agents.core.errors import FencedOff
from agents.core.phases import Event
from agents.core.policies import DEFAULT_RULES
from agents.jobs import leases
from agents.jobs.handler_threads import StuckWork
from agents.jobs.handlers import FencedDatabase, JobContext, JobResult, Registry, registry
from agents.jobs.leases import LeaseKeeper
from agents.jobs.runner import Runner
from models.db import Database
from models.jobs_sql import ClaimedJob, claim, extend_leases, job_row
from tests.support.db import expire_lease
from tests.support.keys import scoped

pytestmark = pytest.mark.integration

for _operation in ("hang", "work"):
    registry.declare(_operation)


def claimed(client: Client, db: Database, request: str, operation: str = "work") -> ClaimedJob:
    agent = client.create_agent(f"a-{request}")
    client.submit(agent.id, request, None, operation=operation)
    job = claim(db, scoped(agent.id, f"{request}:{operation}:1"), "w", timedelta(seconds=30))
    assert isinstance(job, ClaimedJob)
    return job


def test_one_statement_renews_every_lease_and_names_the_ones_lost(client: Client, db: Database) -> None:
    jobs = [claimed(client, db, f"r{n}") for n in range(3)]
    held = [(job.key, job.fencing_token) for job in jobs]
    assert extend_leases(db, held, timedelta(seconds=30)) == set(held)
    expire_lease(db, jobs[1].key)  # its worker looks dead: another takes it over
    assert isinstance(claim(db, jobs[1].key, "other", timedelta(seconds=30)), ClaimedJob)
    assert extend_leases(db, held, timedelta(seconds=30)) == {held[0], held[2]}


def test_the_lease_keeper_renews_all_its_jobs_in_one_call_per_round(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = [claimed(client, db, f"r{n}") for n in range(3)]
    rounds: list[int] = []
    real = leases.extend_leases

    def counted(db: Database, held: list[tuple[str, int]], lease: timedelta) -> set[tuple[str, int]]:
        rounds.append(len(held))
        return real(db, held, lease)

    monkeypatch.setattr(leases, "extend_leases", counted)
    expire_lease(db, jobs[2].key)
    assert isinstance(claim(db, jobs[2].key, "other", timedelta(seconds=30)), ClaimedJob)
    keeper = LeaseKeeper(db, timedelta(seconds=0.6))  # a round every 0.2 s
    lost = [threading.Event() for _ in jobs]
    with keeper.hold(jobs[0].key, jobs[0].fencing_token, lost[0]):
        with keeper.hold(jobs[1].key, jobs[1].fencing_token, lost[1]):
            with keeper.hold(jobs[2].key, jobs[2].fencing_token, lost[2]):
                assert lost[2].wait(5), "the job taken over was never told"
                while len(rounds) < 3:
                    threading.Event().wait(0.05)
    assert rounds[0] == 3 and set(rounds[1:]) <= {2}, f"one call per round with every lease held: {rounds}"
    assert not lost[0].is_set() and not lost[1].is_set()


def test_a_keeper_that_reaches_no_database_for_a_whole_lease_stops_the_runs_it_holds(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past a whole lease without a renewal another worker may run these jobs: their runs stop here (``lost``), and
    the keeper holds them no more. Before that, a failed round is only retried (every second at most)."""
    job = claimed(client, db, "r-away")

    def away(*_: Any) -> set[tuple[str, int]]:
        raise psycopg.OperationalError("connection refused")

    monkeypatch.setattr(leases, "extend_leases", away)
    keeper = LeaseKeeper(db, timedelta(seconds=0.9))  # a round every 0.3 s, retried every 0.3 s
    lost = threading.Event()
    started = time.monotonic()
    with keeper.hold(job.key, job.fencing_token, lost):
        assert not lost.wait(0.5), "stopped before a whole lease had gone by"
        assert lost.wait(5), "a run whose lease nobody renewed for a whole lease went on"
        assert time.monotonic() - started >= 0.9
        assert keeper.held() == 0
    assert job_row(db, job.key)["status"] == "running"  # nothing written: its lease runs out, the job is recovered


def test_a_keeper_idle_for_longer_than_a_lease_gives_its_next_job_a_whole_lease_before_it_gives_up(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The give-up counts time without a renewal while jobs are held, not an idle spell before them: a job claimed
    after one, whose first rounds fail, runs on until a whole lease has gone by."""
    first, second = claimed(client, db, "r-first"), claimed(client, db, "r-second")
    keeper = LeaseKeeper(db, timedelta(seconds=0.9))  # a round every 0.3 s
    with keeper.hold(first.key, first.fencing_token, threading.Event()):
        time.sleep(0.4)  # one round renews it
    time.sleep(1.5)  # idle for longer than a lease

    def away(*_: Any) -> set[tuple[str, int]]:
        raise psycopg.OperationalError("connection refused")

    monkeypatch.setattr(leases, "extend_leases", away)
    lost = threading.Event()
    with keeper.hold(second.key, second.fencing_token, lost):
        assert not lost.wait(0.5), "stopped at its first failed round, as if the idle spell had been without renewal"
        assert lost.wait(5), "and stopped once a whole lease went by without one"


def test_leases_are_renewed_while_the_jobs_hold_every_connection_of_the_pool(client: Client, db_url: str) -> None:
    """The keeper renews on a connection of its own: 200 steps holding the worker's whole pool cannot make their
    own leases run out."""
    small = Database(db_url, pool_size=2, max_overflow=0, audit_keys=client.db.audit_keys)
    try:
        job = claimed(client, small, "r-busy")
        runner = threads_runner(small, StuckWork(), {}, stuck_limit=10)
        keeper = runner.leases
        keeper.lease = timedelta(seconds=30)
        before = job_row(small, job.key)["lease_until"]
        with small.connection(), small.connection():  # every connection of the jobs' pool is taken
            lost = threading.Event()
            with keeper.hold(job.key, job.fencing_token, lost):
                assert keeper._renew_all(1.0), "the renewal waited for (or failed on) the jobs' pool"
        assert not lost.is_set()
        assert job_row(small, job.key)["lease_until"] > before
        runner.leases.db.dispose()
    finally:
        small.dispose()


def hanging(gate: threading.Event, seen: list[str]) -> Any:
    def hang(ctx: JobContext) -> JobResult:
        gate.wait(10)
        # Past its run limit: everything it tries through Keel is refused.
        for name, attempt in (
            ("transaction", lambda: ctx.db.transaction().__enter__()),
            ("checkpoint", lambda: ctx.checkpoint({"late": True})),
        ):
            try:
                attempt()
            except FencedOff:
                seen.append(f"{name} refused")
            else:
                seen.append(f"{name} ran")
        return JobResult(event=Event.FINISH)

    return hang


def threads_runner(db: Database, stuck: StuckWork, handlers: dict[str, Any], *, stuck_limit: int) -> Runner:
    own = Registry()
    for name, fn in handlers.items():
        own.register(name, fn)
    return Runner(
        db,
        own,
        worker="threads",
        lease=timedelta(seconds=30),
        rules=DEFAULT_RULES,
        run_limits={"hang": 0.5},
        stuck_limit=stuck_limit,
        stuck=stuck,
    )


def test_a_handler_past_its_run_limit_is_fenced_off_and_the_process_runs_on(client: Client, db: Database) -> None:
    gate, seen, stuck = threading.Event(), [], StuckWork()
    runner = threads_runner(db, stuck, {"hang": hanging(gate, seen)}, stuck_limit=3)
    agent = client.create_agent("hung")
    client.submit(agent.id, "r1", None, operation="hang")
    key = scoped(agent.id, "r1:hang:1")
    outcome = runner.run(key)
    assert (outcome.status, outcome.end_process) == ("retrying", False), "one job ended, not its process"
    row = job_row(db, key)
    assert row is not None and row["error_attempts"] == {"unknown": 1} and "run limit of 0.5s" in row["last_error"]
    assert stuck.count() == 1
    gate.set()  # the stuck handler wakes up and tries to act
    for _ in range(100):
        if len(seen) == 2:
            break
        threading.Event().wait(0.05)
    assert seen == ["transaction refused", "checkpoint refused"]
    assert stuck.count() == 0, "a stuck thread that ends is no longer counted"
    row = job_row(db, key)
    assert row is not None and row["status"] == "pending" and row["result"] is None


def test_the_process_is_replaced_once_its_stuck_work_reaches_the_limit(client: Client, db: Database) -> None:
    gate, seen, stuck = threading.Event(), [], StuckWork()
    runner = threads_runner(db, stuck, {"hang": hanging(gate, seen)}, stuck_limit=2)
    ends = []
    for request in ("r1", "r2"):
        agent = client.create_agent(f"hung-{request}")
        client.submit(agent.id, request, None, operation="hang")
        ends.append(runner.run(scoped(agent.id, f"{request}:hang:1")).end_process)
    gate.set()
    assert ends == [False, True]


def test_a_renewal_skips_a_row_another_transaction_holds_and_still_counts_it_held(client: Client, db: Database) -> None:
    jobs = [claimed(client, db, f"r{n}") for n in range(2)]
    held = [(job.key, job.fencing_token) for job in jobs]

    def leases() -> list[Any]:
        with psycopg.connect(db.libpq_url) as conn:
            sql = "SELECT lease_until FROM jobs WHERE key = ANY(%s) ORDER BY key = %s DESC"
            return [row[0] for row in conn.execute(sql, ([job.key for job in jobs], jobs[0].key))]

    before = leases()
    with psycopg.connect(db.libpq_url) as other:  # a transition holding one job's row, as an outcome's does
        other.execute("SELECT 1 FROM jobs WHERE key = %s FOR UPDATE", (jobs[0].key,))
        started = time.monotonic()
        assert extend_leases(db, held, timedelta(seconds=30)) == set(held), "both are still held"
        assert time.monotonic() - started < 2, "the renewal waited for the other transaction"
        other.rollback()
    after = leases()
    assert after[0] == before[0] and after[1] > before[1], "the locked row was skipped this round, the other renewed"


def test_a_transaction_a_run_had_open_when_it_was_fenced_off_does_not_commit(db: Database) -> None:
    lost = threading.Event()
    fenced = FencedDatabase(db, "k", lost)
    with pytest.raises(FencedOff), fenced.transaction() as cur:
        cur.execute("CREATE TABLE fenced_probe (x int)")
        lost.set()  # its run limit passed meanwhile
    with db.transaction() as cur:
        cur.execute("SELECT to_regclass('fenced_probe')")
        assert cur.fetchone() == (None,), "what it wrote was rolled back"
    with pytest.raises(FencedOff), fenced.connection():
        pass
