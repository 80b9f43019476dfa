"""Racing writers serialize on the agent row's lock: no lost update, revisions 1..N without gap or repeat."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from uuid import UUID

import pytest

from agents.client import Client
from agents.core.commands import Command
from agents.core.errors import StaleRevision
from agents.core.phases import Event, Phase
from agents.core.transition import transition

pytestmark = pytest.mark.integration

# A loop through the phase table that every phase can continue from.
NEXT = {
    Phase.IDLE: Event.SUBMIT,
    Phase.PLANNING: Event.PLAN,
    Phase.EXECUTING: Event.REQUEST_APPROVAL,
    Phase.WAITING_APPROVAL: Event.APPROVE,
}


@dataclass(frozen=True)
class Win:
    agent_id: UUID
    revision: int
    actor: str
    event: str


def _hammer(client: Client, agent_ids: list[UUID], threads: int, commands: int) -> tuple[list[Win], int]:
    wins: list[Win] = []
    stale = [0]
    lock = threading.Lock()
    start = threading.Barrier(threads)

    def worker(n: int) -> None:
        rng = random.Random(n)
        seen = {a: client.get_state(a) for a in agent_ids}
        start.wait()
        for i in range(commands):
            agent_id = rng.choice(agent_ids)
            state = seen[agent_id]
            phase = Phase(state.phase)
            event = NEXT.get(phase, Event.SUBMIT)
            if phase is Phase.EXECUTING and state.revision % 3 == 0:
                event = Event.OBSERVE
            actor = f"t{n}-{i}"
            request_id = f"{agent_id.hex[:8]}-{actor}" if event is Event.SUBMIT else None
            command = Command(agent_id, event, actor, expected_revision=state.revision, request_id=request_id)
            try:
                result = transition(client.db, command)
            except StaleRevision:
                with lock:
                    stale[0] += 1
                seen[agent_id] = client.get_state(agent_id)  # re-read after a stale rejection
                continue
            with lock:
                wins.append(Win(agent_id, result.agent.revision, actor, event.value))
            seen[agent_id] = client.get_state(agent_id)

    pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return wins, stale[0]


def _check(client: Client, agent_ids: list[UUID], wins: list[Win], stale: int) -> None:
    assert wins, "no command succeeded"
    rejected_total = 0
    for agent_id in agent_ids:
        mine = [w for w in wins if w.agent_id == agent_id]
        final = client.get_state(agent_id).revision
        assert final == len(mine), "final revision != number of successful commands"
        assert sorted(w.revision for w in mine) == list(range(1, final + 1))
        events = client.journal(agent_id=agent_id)
        transitions = [e for e in events if e.kind == "transition"]
        assert [e.revision for e in transitions] == list(range(1, final + 1)), "journal revisions gap or repeat"
        by_revision = {e.revision: (e.actor, e.event) for e in transitions}
        for win in mine:  # every successful command is on record, at the revision it was told
            assert by_revision[win.revision] == (win.actor, win.event)
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        rejected_total += sum(1 for e in events if e.kind == "rejected")
    assert rejected_total == stale


def test_eight_threads_on_one_agent(client: Client) -> None:
    agent = client.create_agent("hot")
    wins, stale = _hammer(client, [agent.id], threads=8, commands=200)
    _check(client, [agent.id], wins, stale)
    assert stale > 0, "the race never raced"
    assert len(wins) + stale == 8 * 200


def test_eight_threads_over_a_hundred_agents(client: Client) -> None:
    ids = [client.create_agent(f"agent-{n}").id for n in range(100)]
    wins, stale = _hammer(client, ids, threads=8, commands=200)
    _check(client, ids, wins, stale)
    assert len(wins) + stale == 8 * 200
