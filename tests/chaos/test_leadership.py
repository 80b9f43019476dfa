"""The beat leader's lease (tasks/leadership.py) with real beat processes behind a real PgBouncer in transaction mode:
one leader at a time, a leader frozen past its lease steps down when it resumes, before it dispatches again."""

from __future__ import annotations

import signal
import time

import psutil
import pytest

from agents.client import Client
from tests.chaos.conftest import Stack, wait_until

pytestmark = pytest.mark.chaos


@pytest.fixture
def database_route() -> str:
    return "pgbouncer"


def _leaders(stack: Stack, *names: str) -> list[str]:
    return [name for name in names if "this beat is the leader" in stack.log(name)]


def _signal_family(stack: Stack, name: str, sig: signal.Signals) -> None:
    proc = psutil.Process(stack.procs[name].pid)
    for member in [proc, *proc.children(recursive=True)]:
        member.send_signal(sig)


def _succeeded(stack: Stack, prefix: str) -> int:
    rows = stack.query("SELECT count(*) FROM jobs WHERE status = 'succeeded' AND starts_with(request_id, %s)", prefix)
    return int(rows[0][0])


def test_two_beats_behind_pgbouncer_keep_exactly_one_leader(stack: Stack, client: Client) -> None:
    assert stack.env["KEEL_DATABASE_POOLER"] == "transaction"
    stack.worker("w1", concurrency=2)
    stack.beat("beat-a")
    stack.beat("beat-b")
    wait_until("a beat to lead", lambda: _leaders(stack, "beat-a", "beat-b"), 60)
    for n in range(20):
        client.submit(client.create_agent(f"a{n}").id, f"req-{n}", None, operation="count")
    wait_until("every job to run", lambda: _succeeded(stack, "req-") == 20, 90)
    time.sleep(3)  # a lease's worth of ticks more: nobody takes over a live leader
    assert len(_leaders(stack, "beat-a", "beat-b")) == 1, "two leaders at once"
    assert stack.query("SELECT term FROM beat_leadership WHERE name = 'beat'") == [(1,)], "one term, never handed on"
    assert stack.query("SELECT count(*) FROM beat_terms") == [(1,)]
    assert "prepared statement" not in stack.log("beat-a") + stack.log("beat-b") + stack.log("w1")


def test_a_leader_frozen_past_its_lease_steps_down_before_dispatching_again(stack: Stack, client: Client) -> None:
    stack.worker("w1", concurrency=2)
    stack.beat("beat-a")
    wait_until("beat-a to lead", lambda: _leaders(stack, "beat-a"), 60)
    stack.beat("beat-b")
    wait_until("beat-b to start", lambda: "Starting..." in stack.log("beat-b"), 60)
    client.submit(client.create_agent("warm").id, "warm", None, operation="count")
    wait_until("beat-a to dispatch", lambda: _succeeded(stack, "warm") == 1, 60)

    _signal_family(stack, "beat-a", signal.SIGSTOP)  # a long pause: GC, a VM migration, a debugger
    wait_until("beat-b to take over", lambda: _leaders(stack, "beat-b"), 30)
    assert stack.query("SELECT term FROM beat_leadership") == [(2,)]
    resumed_at = len(stack.log("beat-a"))
    assert "dispatched" in stack.log("beat-a"), "what a dispatching beat logs (so its absence below means something)"
    _signal_family(stack, "beat-a", signal.SIGCONT)
    wait_until("beat-a to step down", lambda: "no longer the leader" in stack.log("beat-a")[resumed_at:], 30)

    for n in range(10):
        client.submit(client.create_agent(f"after-{n}").id, f"after-{n}", None, operation="count")
    wait_until("the jobs to run, dispatched by beat-b", lambda: _succeeded(stack, "after-") == 10, 60)
    after = stack.log("beat-a")[resumed_at:]
    assert "dispatched" not in after, f"beat-a dispatched after it resumed:\n{after}"
    # How it learns it lost the lease depends on where SIGSTOP landed: between renewals it reads the new term; in
    # the middle of one, the answer arrives after the lease it asked for has run out. Either way it steps down.
    assert (
        "this beat is no longer the leader (term 1): its lease was taken over (term 2" in after
        or "this beat is no longer the leader (term 1): the database's answer came too late" in after
    ), after
    assert stack.query("SELECT term FROM beat_leadership") == [(2,)], "beat-a did not take it back"
