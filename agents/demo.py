"""``keel demo``: agents moving through their phases, with the journal that explains every step.

It exits 0 only if every invariant it checks held: revisions 1..N without gaps, stale and illegal commands
rejected and journaled, duplicate submits suppressed, racing writers serialized, and every hash chain intact.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from agents import journal
from agents.cli import journal_table
from agents.client import Client
from agents.commands import Command
from agents.core import transition
from agents.errors import IllegalTransition, KeelError, StaleRevision
from agents.phases import Event
from models import migrations
from models.db import Database
from models.embedded import broker_url_for
from models.settings import Settings

Echo = Callable[[str], None]


@dataclass
class Checks:
    results: list[tuple[str, bool]] = field(default_factory=list)

    def __call__(self, name: str, ok: bool) -> None:
        self.results.append((name, ok))

    @property
    def ok(self) -> bool:
        return all(ok for _, ok in self.results)


def run_demo(settings: Settings, echo: Echo) -> int:
    """Run the demo; return the process exit status."""
    started = time.perf_counter()
    db = Database.from_settings(settings)
    broker = broker_url_for(settings)
    home = settings.home
    database_where = "configured" if settings.database_url else f"embedded under {home}"
    broker_where = "configured" if settings.broker_url else f"embedded under {home}"
    echo(f"Keel demo: PostgreSQL {database_where}; Redis {broker_where} ({broker})")
    migrations.upgrade(db.url)
    client = Client(db, settings)
    check = Checks()
    try:
        _approval_story(client, echo, check)
        _race(client, echo, check)
        report = journal.verify(db)
        check("every journal hash chain verifies", report.ok)
        echo(f"\naudit verify: {report.events} events in {report.agents} chains, {len(report.breaks)} broken")
    finally:
        client.close()
    echo("\nInvariants:")
    for name, ok in check.results:
        echo(f"  [{'ok' if ok else 'FAILED'}] {name}")
    echo(f"\n{'all invariants held' if check.ok else 'SOME INVARIANTS FAILED'} ({time.perf_counter() - started:.1f}s)")
    return 0 if check.ok else 1


def _approval_story(client: Client, echo: Echo, check: Checks) -> None:
    run = uuid.uuid4().hex[:8]
    agent = client.create_agent(f"demo-{run}", budget_tokens=10_000, budget_cost="2.50", actor="demo")
    echo(f"\nCreated agent {agent.name} ({agent.id}), phase {agent.phase}, revision {agent.revision}")
    request = f"req-{run}"

    def step(label: str, event: Event, **kw: object) -> None:
        state = client.get_state(agent.id)
        result = transition(client.db, Command(agent_id=agent.id, event=event, actor="demo-worker", **kw))  # type: ignore[arg-type]
        echo(f"  {label:<44} {state.phase} -> {result.agent.phase} (revision {result.agent.revision})")

    state = client.submit(agent.id, request, {"prompt": "Summarise open incidents"}, expected_revision=0, actor="alice")
    echo(f"  {'alice submits ' + request:<44} idle -> {state.phase} (revision {state.revision})")
    again = client.submit(agent.id, request, {"prompt": "Summarise open incidents"}, expected_revision=0, actor="alice")
    echo(f"  {'alice retries the same submit':<44} suppressed, still revision {again.revision}")
    check("a repeated submit is suppressed and changes nothing", again.revision == state.revision)
    step("the model plans a tool call", Event.PLAN)
    step("the tool needs a person", Event.REQUEST_APPROVAL)
    waiting = client.get_state(agent.id)
    try:
        client.approve(agent.id, expected_revision=waiting.revision - 1, actor="bob")
        check("a stale approval is rejected", False)
    except StaleRevision as exc:
        echo(f"  {'bob approves from an old page':<44} rejected: {exc}")
        check("a stale approval is rejected", exc.current_revision == waiting.revision)
    approved = client.approve(agent.id, expected_revision=waiting.revision, actor="carol")
    echo(f"  {'carol approves revision ' + str(waiting.revision):<44} waiting_approval -> {approved.phase}")
    step("tool results go back to the model", Event.OBSERVE)
    step("the model answers", Event.FINISH)
    try:
        client.cancel(agent.id, actor="dave")
        check("cancelling a finished request is refused", False)
    except IllegalTransition as exc:
        echo(f"  {'dave cancels the finished request':<44} rejected: {exc}")
        check("cancelling a finished request is refused", "submit" in exc.allowed)
    after = client.get_state(agent.id)
    check(
        "rejections left the agent as it was",
        (after.phase, after.revision) == ("done", approved.revision + 2),
    )

    events = client.journal(agent_id=agent.id)
    echo(f"\nJournal of {agent.name}:")
    echo(journal_table(events))
    revisions = [e.revision for e in events if e.kind == "transition"]
    check("journal revisions are 1..N with no gap", revisions == list(range(1, after.revision + 1)))
    kinds = [e.kind for e in events]
    check(
        "rejected and suppressed commands are journaled",
        kinds.count("rejected") == 2 and "suppressed" in kinds,
    )


def _race(client: Client, echo: Echo, check: Checks) -> None:
    """Four writers hammer one agent; the row lock serializes them and no update is lost."""
    agent = client.create_agent(f"race-{uuid.uuid4().hex[:8]}", actor="demo")
    cycle = {"idle": Event.SUBMIT, "planning": Event.PLAN, "executing": Event.FINISH, "done": Event.SUBMIT}
    wins: list[int] = []
    stale = 0
    lock = threading.Lock()

    def writer(n: int) -> None:
        nonlocal stale
        for i in range(25):
            state = client.get_state(agent.id)
            event = cycle[state.phase]
            request = f"race-{agent.id.hex[:8]}-{n}-{i}" if event is Event.SUBMIT else None
            try:
                result = transition(
                    client.db,
                    Command(agent.id, event, f"writer-{n}", expected_revision=state.revision, request_id=request),
                )
                with lock:
                    wins.append(result.agent.revision)
            except (StaleRevision, IllegalTransition):
                with lock:
                    stale += 1
            except KeelError:
                raise

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = client.get_state(agent.id).revision
    echo(f"\nRace: 4 writers x 25 commands on {agent.name}: {len(wins)} applied, {stale} rejected as stale")
    check("racing writers: final revision == applied commands", final == len(wins))
    check("racing writers: each applied command got its own revision", sorted(wins) == list(range(1, final + 1)))
