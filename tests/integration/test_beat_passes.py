"""The beat's passes on their own threads: the leader's duties go on without the broker, deadlines and schedules
are taken a batch at a time, a slow pass holds up no other, and a closing or signalled beat gives up its lease
without waiting twice or re-entering its close."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from agents.client import Client
from agents.core import transition as core
from agents.core.commands import Command
from agents.core.transition import now
from agents.jobs import deadlines, schedules
from agents.jobs.handlers import registry
from models.db import Database
from models.settings import Settings
from tests.support.broker import Broker
from tests.support.dispatchers import published
from tests.support.keys import scoped

pytestmark = pytest.mark.integration

for _operation in ("count",):
    registry.declare(_operation)


def test_the_leaders_duties_go_on_while_the_broker_is_away(
    db_url: str, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis cut with nothing due: the dispatcher asks the queues' depths every tick and fails, but the leader's
    heartbeat (and its alerts, audit chores) need the database only and go on every tick; they used to wait out
    the broker's backoff, and the heartbeat grew as old as the outage (KeelNoBeatLeader fires at two minutes)."""
    from tests.support.proxy import redis_behind

    proxy, url = redis_behind(broker.url)
    beat = _leading_scheduler(db_url, broker, monkeypatch, broker_url=url)
    try:
        proxy.down()
        end = time.monotonic() + 6
        while time.monotonic() < end:
            time.sleep(min(max(beat.tick(), 0.01), 1.0))
        assert beat.broker.down, "the broker's outage was noticed"
        with psycopg.connect(beat.db.libpq_url) as raw:
            (age,) = raw.execute(  # type: ignore[misc]
                "SELECT extract(epoch FROM clock_timestamp() - max(last_tick_at))::float8 FROM beat_terms"
            ).fetchone()
        assert age < 2.0, f"the heartbeat is {age:.1f}s old after 6 s without the broker"
    finally:
        beat.close()
        proxy.down()


def test_the_deadline_pass_goes_through_every_batch_past_an_agent_that_fails(
    client: Client, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    agents = [client.create_agent(f"late-{n}") for n in range(7)]
    for n, agent in enumerate(agents):
        client.submit(agent.id, f"req-{n}", None, operation="count", hard_deadline=timedelta(seconds=60 + n))
    soft = client.create_agent("soft")
    client.submit(soft.id, "req-soft", None, operation="count", soft_deadline=timedelta(seconds=30))
    broken = agents[1].id  # in the first batch: the batches after it must still be read, and it not read again
    real = core.transition

    def failing(db: Database, command: Command, **kw: Any) -> Any:
        if command.agent_id == broken:
            raise RuntimeError("this agent's move breaks")
        return real(db, command, **kw)

    monkeypatch.setattr(core, "transition", failing)
    report = deadlines.enforce(db, now() + timedelta(seconds=120), batch=2)
    assert report.failed == [broken]
    assert report.stopped == [a.id for a in agents if a.id != broken], "hard deadlines in order, each once"
    assert report.demoted == [soft.id]
    assert client.get_state(broken).phase == "planning"
    assert client.journal(agent_id=broken)[-1].decision == "deadline_enforcement_failed"


def test_schedules_fire_in_batches_each_once_with_two_beats_racing(client: Client, db: Database) -> None:
    agents = [client.create_agent(f"s{n}") for n in range(9)]
    t0 = now()
    for n, agent in enumerate(agents):
        schedules.ensure_schedule(db, f"every-{n}", agent.id, every=timedelta(minutes=1), operation="count", now=t0)
    at = t0 + timedelta(minutes=1, seconds=1)
    fired: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(2)

    def beat() -> None:
        barrier.wait()
        got = schedules.fire_due(db, at, batch=2)
        with lock:
            fired.extend(got)

    threads = [threading.Thread(target=beat) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(fired) == sorted(schedules.fire_request_id(f"every-{n}", t0 + timedelta(minutes=1)) for n in range(9))
    assert schedules.fire_due(db, at, batch=2) == [], "moved on: not fired again at the same time"


def test_a_slow_deadline_pass_does_not_hold_up_dispatching(
    client: Client, db_url: str, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery import Celery

    from tasks.app import celery_config
    from tasks.dispatcher import KeelScheduler

    for name, value in {"KEEL_DATABASE_URL": db_url, **broker.env}.items():
        monkeypatch.setenv(name, value)
    entered, release = threading.Event(), threading.Event()
    real = deadlines.enforce

    def slow(*args: Any, **kw: Any) -> Any:
        entered.set()
        release.wait(60)
        return real(*args, **kw)

    monkeypatch.setattr(deadlines, "enforce", slow)
    app = Celery("passes-test", set_as_current=False)
    app.conf.update(celery_config(Settings()))
    beat = KeelScheduler(app=app)
    try:
        beat.tick()
        assert entered.wait(30), "the deadline pass started"
        agent = client.create_agent("a")
        client.submit(agent.id, "r-1", None, operation="count")
        beat.tick()  # returns while the deadline pass is still under way, and dispatches
        assert published(broker) == [scoped(agent.id, "r-1:count:1")]
        assert beat.passes[1].running()
        beat.tick()
        assert beat.passes[1].running(), "never two deadline passes at once"
    finally:
        release.set()
        for timed in beat.passes:  # (on a loaded machine longer than a closing beat waits)
            timed.join(60)
        beat.close()


def test_a_closing_beat_waits_for_its_passes_once_and_within_one_budget(
    db_url: str, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Celery closes a scheduler twice on SIGTERM (its signal handler, then its loop's end): with every pass stuck,
    the two closes together wait CLOSE_WAIT_SECONDS once, not once per pass and close (`keel up`'s stop timeout is
    20 s: 2 closes x 3 passes x 5 s overran it), and the beat's leadership is given up for the next beat."""
    from celery import Celery

    from tasks.app import celery_config
    from tasks.dispatcher import CLOSE_WAIT_SECONDS, KeelScheduler

    for name, value in {"KEEL_DATABASE_URL": db_url, **broker.env}.items():
        monkeypatch.setenv(name, value)
    release = threading.Event()
    started = threading.Semaphore(0)

    def stuck() -> None:
        started.release()
        release.wait(120)

    app = Celery("close-test", set_as_current=False)
    app.conf.update(celery_config(Settings()))
    beat = KeelScheduler(app=app)
    joins: list[float] = []
    try:
        for timed in beat.passes:
            monkeypatch.setattr(timed, "_run", stuck)
            real_join = timed.join
            monkeypatch.setattr(timed, "join", lambda t=None, j=real_join: (joins.append(t), j(t))[1])
        beat.tick()
        assert beat.leadership.term is not None, "this beat leads"
        for _ in beat.passes:
            assert started.acquire(timeout=30), "every pass started, and is stuck"
        began = time.monotonic()
        beat.close()
        beat.close()
        waited = time.monotonic() - began
        assert len(joins) == len(beat.passes), f"the second close waited again: {joins}"
        assert sum(joins) <= CLOSE_WAIT_SECONDS + 0.01, joins
        assert waited < 2 * CLOSE_WAIT_SECONDS, f"closing took {waited:.1f}s"
        assert beat.leadership.term is None, "leadership given up"
        assert all(timed.running() for timed in beat.passes), "the stuck passes were left to end with the process"
    finally:
        release.set()
        for timed in beat.passes:
            timed.join(60)


def test_a_closing_beat_waits_for_its_leaders_chores_within_the_same_budget(
    db_url: str, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader's audit verify (shipping, pruning) runs on a thread of its own: a close that did not wait for it
    disposed of the pool under it, and the connection it held was never closed (a ResourceWarning in the tests)."""
    from tasks.leader import LeaderDuties

    ended = threading.Event()
    real = LeaderDuties._verify

    def slow(self: LeaderDuties) -> None:
        time.sleep(1.0)
        real(self)
        ended.set()

    monkeypatch.setattr(LeaderDuties, "_verify", slow)
    beat = _leading_scheduler(db_url, broker, monkeypatch)
    assert "keel-audit-verify" in [t.name for t in beat.duties.chores_under_way()]
    beat.close()
    assert ended.is_set() and not beat.duties.chores_under_way(), "the close waited for the chore"


def _leading_scheduler(
    db_url: str, broker: Broker, monkeypatch: pytest.MonkeyPatch, *, broker_url: str | None = None
) -> Any:
    """A KeelScheduler on this test's database and broker (reached through ``broker_url`` when given: a proxy)
    that has ticked once and leads."""
    from celery import Celery

    from tasks.app import celery_config
    from tasks.dispatcher import KeelScheduler

    env = {"KEEL_DATABASE_URL": db_url, **broker.env}
    if broker_url is not None:
        env["KEEL_BROKER_URL"] = broker_url
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    app = Celery("signal-test", set_as_current=False)
    app.conf.update(celery_config(Settings()))
    beat = KeelScheduler(app=app)
    beat.tick()
    assert beat.leadership.term is not None
    return beat


def test_a_second_stop_signal_during_a_close_does_not_reenter_it(
    db_url: str, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second SIGTERM while the beat closes (the kernel's parent-death signal beside a supervisor's) ran Celery's
    handler inside the close: the nested close waited for the lease connection the first was using, for ever (a
    SIGKILLed `keel demo` left its beat running). Now the close is not re-entered, and it still gives up the lease."""
    import signal as signals

    beat = _leading_scheduler(db_url, broker, monkeypatch)
    depth: list[int] = []
    inside = [0]
    real_release = beat.leadership.release

    def releasing() -> None:
        inside[0] += 1
        depth.append(inside[0])
        try:
            if len(depth) == 1:  # a second signal arrives in the middle of the close
                os.kill(os.getpid(), signals.SIGTERM)
                time.sleep(0.2)
            real_release()
        finally:
            inside[0] -= 1

    monkeypatch.setattr(beat.leadership, "release", releasing)
    previous = signals.signal(signals.SIGTERM, lambda signum, frame: beat.close())  # as Celery's handler does
    try:
        beat.close()
        assert depth == [1], f"the close was re-entered: {depth}"
        assert beat.leadership.term is None, "the lease was given up"
        assert signals.getsignal(signals.SIGTERM) is not signals.SIG_IGN, "the handler is back after the close"
        beat.close()  # Celery's second close: repeats what is left, waits for nothing
        assert depth == [1, 1]
    finally:
        signals.signal(signals.SIGTERM, previous)


@pytest.mark.timeout(60)
def test_a_stop_signal_inside_a_tick_leaves_the_close_to_the_loops_end(
    db_url: str, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM while the tick waits on the lease connection (the database slow to answer): Celery's handler ran the
    close right there, whose release waited for the very connection the interrupted statement held, for ever. Now a
    close asked inside a tick does nothing, the handler's SystemExit ends the tick, and the close at the loop's end
    gives up the lease."""
    import signal as signals

    from models.urls import libpq_url

    beat = _leading_scheduler(db_url, broker, monkeypatch)

    def celery_handler(signum: int, frame: Any) -> None:  # what celery/apps/beat.py installs
        beat.close()
        raise SystemExit()

    previous = signals.signal(signals.SIGTERM, celery_handler)
    blocker = psycopg.connect(libpq_url(db_url))
    timers = [threading.Timer(0.5, os.kill, (os.getpid(), signals.SIGTERM)), threading.Timer(1.5, blocker.rollback)]
    try:
        blocker.execute("SELECT 1 FROM beat_leadership FOR UPDATE")  # the lease's renewal waits for this
        for timer in timers:
            timer.start()
        with pytest.raises(SystemExit):
            beat.tick()  # its renewal waits on the row; the signal comes in the middle of it
        assert beat.leadership.term is not None, "nothing was closed inside the tick"
        beat.close()  # the close at the end of Celery's loop
        assert beat.leadership.term is None and beat.leadership.conn is None
    finally:
        for timer in timers:  # the rollback's timer uses the blocker: never beside its close
            if timer.is_alive():
                timer.join(10)
        signals.signal(signals.SIGTERM, previous)
        blocker.close()


def test_the_beat_sends_no_relay_pass_while_one_still_waits_on_its_queue(
    db_url: str, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relay passes took longer than the interval (a slow receiver) or every worker was busy: beat kept sending one
    per interval, and they piled up on keel.outbox for as long as it lasted. Now a pass is sent only when none waits
    (no expiry: that would be stamped on beat's clock and checked on the worker's)."""
    beat = _leading_scheduler(db_url, broker, monkeypatch)
    entry = beat.schedule["relay-outbox"]
    queue = broker.key("keel.outbox")
    try:
        with broker.redis() as redis:
            redis.delete(queue)  # whatever the first tick sent: a worker took it
            beat.apply_entry(entry, producer=beat.producer)
            assert redis.llen(queue) == 1, "a pass is sent when none waits"
            for _ in range(3):
                beat.apply_entry(entry, producer=beat.producer)
            assert redis.llen(queue) == 1, "no pass piles up behind one still waiting"
            redis.lpop(queue)  # a relay worker took it
            beat.apply_entry(entry, producer=beat.producer)
            assert redis.llen(queue) == 1, "the next one goes out"
    finally:
        beat.close()
