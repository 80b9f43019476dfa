"""Retention: finished jobs, sent messages with their delivery log rows, and old requests' inputs are pruned; live
work is never touched, a pruned key stays taken (a late duplicate is suppressed and counted, never run or sent again),
a pruned request still answers a repeated submit, and the KPI counters do not move."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict
from datetime import timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from agents.client import Client
from agents.core.commands import Command, MessageSpec, Usage
from agents.core.errors import RequestConflict
from agents.core.phases import RESTING, Event, Phase
from agents.core.policies import DEFAULT_RULES
from agents.core.transition import now, transition
from agents.jobs.handlers import JobContext, JobResult, Registry, registry
from agents.jobs.runner import Runner
from agents.outbox.relay import Backoff, Relay
from agents.outbox.senders import SlackSender
from models import kpi_sql
from models.db import Database
from models.jobs_sql import NewJob, insert_jobs_txn, job_row
from models.outbox_sql import NewMessage, insert_messages_txn, message_row, stats
from models.retention_sql import IN_FLIGHT, Retention, prune
from models.urls import libpq_url
from tests.support.cli import run_keel
from tests.support.fakes import FakeSlack
from tests.support.keys import scoped

pytestmark = pytest.mark.integration

registry.declare("answer")
SLACK_TOKEN = "xoxb-test-5ecret-slack-token"
KEEP_30 = Retention(jobs_days=30, messages_days=30, requests_days=30, batch=2)


@pytest.fixture
def slack() -> Iterator[FakeSlack]:
    fake = FakeSlack(token=SLACK_TOKEN, timeout_delay=1.5, retry_after=1.0)
    fake.start()
    yield fake
    fake.stop()


def relay(db: Database, slack: FakeSlack) -> Relay:
    return Relay(
        db,
        {"slack": SlackSender(SLACK_TOKEN, f"{slack.url}/api/", timeout=1.0)},
        lease=timedelta(seconds=10),
        concurrency=4,
        backoff=Backoff(0.05, 0.2, 6),
        pass_seconds=10,
    )


def runner(db: Database, calls: list[str]) -> Runner:
    def finish(ctx: JobContext) -> JobResult:
        calls.append(ctx.key)
        return JobResult(output={"answer": 42}, usage=Usage(7, Decimal("0.5")), event=Event.FINISH)

    handlers = Registry()
    handlers.register("answer", finish)
    return Runner(db, handlers, worker="test", lease=timedelta(seconds=30), rules=DEFAULT_RULES)


def sql(db: Database, statement: str, *params: Any, triggers: bool = True) -> list[dict[str, Any]]:
    """As the superuser; ``triggers=False`` ages rows the guards would not let anyone touch (the test's clock)."""
    with psycopg.connect(db.libpq_url, autocommit=True, row_factory=psycopg.rows.dict_row) as conn:
        if not triggers:
            conn.execute("SET session_replication_role = replica")
        cur = conn.execute(statement, params)
        return cur.fetchall() if cur.description else []


def age_everything(db: Database, days: int) -> None:
    """Every finished job, sent message and request as if it were ``days`` old."""
    sql(db, f"UPDATE jobs SET finished_at = finished_at - interval '{days} days' WHERE finished_at IS NOT NULL")
    sql(db, f"UPDATE outbox SET sent_at = sent_at - interval '{days} days' WHERE sent_at IS NOT NULL")
    sql(db, f"UPDATE requests SET submitted_at = submitted_at - interval '{days} days'", triggers=False)


def emit(db: Database, agent_id: Any, *messages: MessageSpec) -> None:
    transition(db, Command(agent_id, Event.PROGRESS, "worker", messages=messages))


def drain(r: Relay) -> None:
    for _ in range(40):
        r.run_pass()
        if not sql(r.db, "SELECT 1 FROM outbox WHERE status IN ('pending', 'sending')"):
            return
    raise AssertionError("the outbox did not drain")


def counters(db: Database) -> dict[str, Any]:
    kpi_sql.fold(db)
    return {k: v for k, v in asdict(kpi_sql.totals(db)).items() if k != "p95_transition_seconds"}


def k(s: dict[str, Any], key: str) -> str:
    """``key`` of the story's request ``r-NAME`` (``"r-old:answer:1"``) as its agent (``s["old"]``) keys it."""
    return scoped(s[key.split(":")[0].removeprefix("r-")].id, key)


def test_in_flight_is_every_phase_but_the_resting_ones() -> None:
    assert set(IN_FLIGHT) == {p.value for p in Phase} - {p.value for p in RESTING}


@pytest.fixture
def story(client: Client, db: Database, slack: FakeSlack) -> Callable[[], dict[str, Any]]:
    """A finished request (r-old: a job run, a message sent), one in flight (r-live: a message sent, a job
    pending), a dead letter (r-dead's agent done), all aged 40 days; and one finished 20 days ago (r-recent)."""

    def make() -> dict[str, Any]:
        calls: list[str] = []
        old, live, dead, recent = (client.create_agent(n) for n in ("old", "live", "dead", "recent"))
        s = {"old": old, "live": live, "dead": dead, "recent": recent}
        for agent, request in ((old, "r-old"), (live, "r-live"), (dead, "r-dead"), (recent, "r-recent")):
            client.submit(agent.id, request, {"q": request}, operation="answer")
        emit(db, old.id, MessageSpec("slack", "C1", "note", {"text": "hi"}))
        emit(db, live.id, MessageSpec("slack", "C2", "note", {"text": "hi"}))
        emit(db, dead.id, MessageSpec("slack", "C3", "note", {"text": "hi"}))
        emit(db, recent.id, MessageSpec("slack", "C4", "note", {"text": "hi"}))
        sql(db, "UPDATE outbox SET status = 'dead', last_error = 'gave up' WHERE key = %s", k(s, "r-dead:slack:note"))
        drain(relay(db, slack))
        for key in ("r-old:answer:1", "r-dead:answer:1", "r-recent:answer:1"):
            assert runner(db, calls).run(k(s, key)).status == "succeeded"
        age_everything(db, 20)
        sql(db, "UPDATE jobs SET finished_at = finished_at - interval '20 days' WHERE request_id <> 'r-recent'")
        sql(db, "UPDATE outbox SET sent_at = sent_at - interval '20 days' WHERE request_id <> 'r-recent'")
        sql(
            db,
            "UPDATE requests SET submitted_at = now() - interval '40 days' WHERE request_id <> 'r-recent'",
            triggers=False,
        )
        return {**s, "calls": calls}

    return make


def test_prune_removes_old_finished_work_and_nothing_live(client: Client, db: Database, story: Any) -> None:
    s = story()
    before = counters(db)
    assert prune(db, KEEP_30, dry_run=True) == prune(db, KEEP_30, dry_run=True)  # a dry run changes nothing
    would = prune(db, KEEP_30, dry_run=True)
    assert (would.jobs, would.messages, would.confirmations, would.requests) == (2, 1, 1, 2)
    done = prune(db, KEEP_30)
    assert (done.jobs, done.messages, done.confirmations, done.requests) == (2, 1, 1, 2)
    assert prune(db, KEEP_30).total == 0  # nothing left to prune: a second run finds nothing

    assert job_row(db, k(s, "r-old:answer:1")) is None and job_row(db, k(s, "r-dead:answer:1")) is None
    assert job_row(db, k(s, "r-live:answer:1"))["status"] == "pending"  # type: ignore[index]  # in flight
    assert job_row(db, k(s, "r-recent:answer:1"))["status"] == "succeeded"  # type: ignore[index]  # 20 days: kept
    assert message_row(db, k(s, "r-old:slack:note")) is None
    assert message_row(db, k(s, "r-live:slack:note"))["status"] == "sent"  # type: ignore[index]  # its request in flight
    assert message_row(db, k(s, "r-dead:slack:note"))["status"] == "dead"  # type: ignore[index]  # an operator may retry
    assert message_row(db, k(s, "r-recent:slack:note"))["status"] == "sent"  # type: ignore[index]
    logged = {r["key"] for r in sql(db, "SELECT key FROM delivery_log")}
    assert logged == {k(s, "r-live:slack:note"), k(s, "r-recent:slack:note")}
    rows = {r["request_id"]: r for r in sql(db, "SELECT * FROM requests")}
    assert rows["r-old"]["input"] is None and rows["r-old"]["pruned_at"] is not None
    assert (
        rows["r-old"]["input_sha256"]
        == sql(
            db, "SELECT encode(sha256(convert_to(%s::jsonb::text, 'UTF8')), 'hex') AS h", json.dumps({"q": "r-old"})
        )[0]["h"]
    )
    assert rows["r-old"]["agent_id"] == s["old"].id  # the request id stays its agent's
    assert rows["r-live"]["input"] == {"q": "r-live"} and rows["r-recent"]["pruned_at"] is None
    assert {r["key"] for r in sql(db, "SELECT key FROM pruned_keys")} == {
        k(s, "r-old:answer:1"),
        k(s, "r-dead:answer:1"),
        k(s, "r-old:slack:note"),
    }
    assert counters(db) == before, "a prune moved a KPI counter"
    # The journal is not pruned: the finished request's story is all there.
    assert [e.event for e in client.journal(agent_id=s["old"].id) if e.kind == "transition"][-1] == "finish"


def test_outbox_stats_still_count_what_retention_removed(db: Database, slack: FakeSlack, story: Any) -> None:
    """The delivery log goes with its pruned message; the outbox's figures (delivered, reconciled) are counters, not
    counts of what is left."""
    # r-old's message is applied by Slack and its answer lost: the relay reconciles it instead of sending again.
    old_note = "~r-old:slack:note"  # its key: old's id, then the request's (only old has a request r-old)
    slack.faults = lambda dest, key, attempt: "apply_then_drop" if key.endswith(old_note) and attempt == 1 else None
    s = story()
    assert sql(db, "SELECT how FROM delivery_log WHERE key = %s", k(s, "r-old:slack:note")) == [{"how": "reconciled"}]
    before = stats(db)
    assert (before["reconciled"], before["delivered_keys"]) == (1, 3)
    assert prune(db, KEEP_30).confirmations == 1
    assert sql(db, "SELECT count(*) AS n FROM delivery_log WHERE how = 'reconciled'") == [{"n": 0}]
    assert stats(db) == before


def test_a_late_duplicate_of_a_pruned_key_is_suppressed_never_run_or_sent_again(
    client: Client, db: Database, slack: FakeSlack, story: Any
) -> None:
    s = story()
    prune(db, KEEP_30)
    before = counters(db)["suppressed_duplicates"]
    # A redelivered (or replayed) broker message of the pruned job: suppressed, journaled, counted; not run.
    late = runner(db, s["calls"]).run(k(s, "r-old:answer:1"))
    ran = [k(s, "r-old:answer:1"), k(s, "r-dead:answer:1"), k(s, "r-recent:answer:1")]
    assert late.status == "suppressed" and s["calls"] == ran
    last = client.journal(agent_id=s["old"].id)[-1]
    assert (last.kind, last.decision, last.details["status"]) == ("suppressed", "duplicate_delivery", "pruned")
    # The same job key scheduled again, and the same message emitted again: existing keys, suppressed.
    with psycopg.connect(db.libpq_url) as conn, conn.cursor() as cur:
        job = NewJob(k(s, "r-old:answer:1"), s["old"].id, "r-old", "answer", "1", {}, "pending", "keel.jobs", 5, now())
        assert insert_jobs_txn(cur, [job], now()) == ([], [k(s, "r-old:answer:1")])
        note = NewMessage(k(s, "r-old:slack:note"), s["old"].id, "r-old", "slack", "C1", {"text": "hi"})
        assert insert_messages_txn(cur, [note]) == ([], [k(s, "r-old:slack:note")])
    assert job_row(db, k(s, "r-old:answer:1")) is None and message_row(db, k(s, "r-old:slack:note")) is None
    # Through a transition: no code path puts an agent back on a finished request, so the test does it behind the
    # guards' back, to show the database refuses the pruned key to any emitter (counted as a suppressed duplicate).
    sql(db, "UPDATE agents SET phase = 'executing' WHERE id = %s", s["old"].id, triggers=False)
    emit(db, s["old"].id, MessageSpec("slack", "C1", "note", {"text": "hi"}))
    assert client.journal(agent_id=s["old"].id)[-1].details["messages_suppressed"] == [k(s, "r-old:slack:note")]
    drain(relay(db, slack))
    assert slack.delivered_keys()[k(s, "r-old:slack:note")] == 1
    after = counters(db)["suppressed_duplicates"]
    assert after["job_delivery"] == before["job_delivery"] + 1
    assert after["message_insert"] == before["message_insert"] + 1


def test_a_pruned_request_still_belongs_to_its_agent_and_answers_a_repeated_submit(
    client: Client, db: Database, story: Any
) -> None:
    s = story()
    prune(db, KEEP_30)
    again = client.submit(s["old"].id, "r-old", {"q": "r-old"}, operation="answer")
    assert again.phase == "done" and again.request_id == "r-old"  # the current state, nothing started
    assert job_row(db, k(s, "r-old:answer:1")) is None
    with pytest.raises(RequestConflict) as differs:
        client.submit(s["old"].id, "r-old", {"q": "something else"}, operation="answer")
    assert differs.value.differs == ("input",)
    # Request ids are each agent's own: another agent submitting r-old starts a fresh request of its own, and
    # leaves old's (pruned) request as it was.
    fresh = client.submit(s["recent"].id, "r-old", {"q": "r-old"}, operation="answer")
    assert fresh.phase == "planning" and fresh.request_id == "r-old"
    assert job_row(db, k(s, "r-recent:answer:1"))["status"] == "succeeded"  # type: ignore[index]  # its own, untouched
    assert job_row(db, scoped(s["recent"].id, "r-old:answer:1"))["status"] == "pending"  # type: ignore[index]
    assert client.get_request(s["recent"].id, "r-old").input == {"q": "r-old"}
    assert client.get_request(s["old"].id, "r-old").input is None and job_row(db, k(s, "r-old:answer:1")) is None
    still = client.get_state(s["old"].id)
    assert (still.phase, still.request_id, still.revision) == ("done", "r-old", again.revision)
    # The request moved on from: its agent on a new request, the old id submitted again is still the old agent's.
    client.submit(s["old"].id, "r-next", None, operation="answer")
    with pytest.raises(RequestConflict):
        client.submit(s["old"].id, "r-old", {"q": "something else"}, operation="answer")
    assert client.get_request(s["old"].id, "r-old").input is None  # the input is what was pruned


def test_a_retry_is_compared_alike_before_and_after_its_input_is_pruned(client: Client, db: Database) -> None:
    """Before the prune the request's input is there, after it only its digest: a retry gets the same answer either
    way (jsonb's text decides: key order and spacing do not count; 1, 1.0 and true are three inputs)."""
    agent = client.create_agent("retried")
    client.submit(agent.id, "r-1", {"x": 1, "y": [1, 2]}, operation="answer")
    retries = {
        "same, keys reordered": {"y": [1, 2], "x": 1},
        "1.0": {"x": 1.0, "y": [1, 2]},
        "true": {"x": True, "y": [1, 2]},
    }

    def answers() -> dict[str, bool]:
        found = {}
        for what, given in retries.items():
            try:
                client.submit(agent.id, "r-1", given, operation="answer")
                found[what] = True
            except RequestConflict as exc:
                assert exc.differs == ("input",)
                found[what] = False
        return found

    before = answers()
    assert before == {"same, keys reordered": True, "1.0": False, "true": False}
    client.cancel(agent.id, actor="test")
    age_everything(db, 40)
    assert prune(db, KEEP_30).requests == 1
    assert client.get_request(agent.id, "r-1").input is None
    assert answers() == before


def test_batches_walk_past_the_kept_jobs_of_a_request_in_flight(client: Client, db: Database) -> None:
    """Old finished jobs of a request still in flight are kept; those of finished requests around them, all finished
    at the same instant, go in batches that each start after the last one's last job (finished_at, key): every one
    once, whatever the ties."""
    agent = client.create_agent("long-runner")
    client.submit(agent.id, "r-live", None, operation="answer")  # planning: r-live is in flight
    sql(
        db,
        "INSERT INTO jobs (key, agent_id, request_id, operation, target, status, queue, run_at, finished_at)"
        " SELECT r || ':answer:old-' || g, %s, r, 'answer', 'old-' || g, 'succeeded', 'keel.jobs', now(),"
        "  timestamptz '2020-01-01 00:00:00+00'"
        " FROM generate_series(1, 6) g, unnest(ARRAY['r-live', 'r-done']) r",
        agent.id,
        triggers=False,
    )
    done = prune(db, Retention(jobs_days=30, messages_days=0, requests_days=0, batch=4))
    assert done.jobs == 6
    left = sql(
        db, "SELECT request_id, count(*) AS n FROM jobs WHERE finished_at < now() - interval '1 year' GROUP BY 1"
    )
    assert left == [{"request_id": "r-live", "n": 6}]
    assert len(sql(db, "SELECT key FROM pruned_keys WHERE key LIKE 'r-done:%%'")) == 6


def test_two_pruners_at_once_take_different_rows(client: Client, db: Database) -> None:
    """Two beats, or a beat and `keel db prune`: every row pruned once, neither fails, every key kept."""
    agent = client.create_agent("bulk")
    sql(
        db,
        "INSERT INTO jobs (key, agent_id, request_id, operation, target, status, queue, run_at, finished_at)"
        " SELECT 'r-bulk:answer:' || g, %s, 'r-bulk', 'answer', g::text, 'succeeded', 'keel.jobs', now(),"
        " now() - interval '40 days' FROM generate_series(1, 400) g",
        agent.id,
    )
    results: list[int] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(prune(db, Retention(30, 30, 30, batch=7)).jobs)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and sum(results) == 400
    assert sql(db, "SELECT count(*) AS n FROM pruned_keys WHERE key LIKE 'r-bulk:%%'")[0]["n"] == 400
    assert sql(db, "SELECT count(*) AS n FROM jobs WHERE request_id = 'r-bulk'")[0]["n"] == 0


def test_retention_zero_keeps_that_kind_for_ever(db: Database, story: Any) -> None:
    s = story()
    kept = prune(db, Retention(jobs_days=0, messages_days=30, requests_days=0))
    assert (kept.jobs, kept.messages, kept.requests) == (0, 1, 0)
    assert job_row(db, k(s, "r-old:answer:1")) is not None


def test_the_database_refuses_to_prune_live_work_or_rewrite_a_request(db: Database, story: Any) -> None:
    """The guards hold for any writer, the application's role and a superuser alike (triggers fire for both)."""
    s = story()
    old = f"agent_id = '{s['old'].id}' AND request_id = 'r-old'"
    refused = [
        f"DELETE FROM jobs WHERE key = '{k(s, 'r-live:answer:1')}'",  # pending
        f"DELETE FROM outbox WHERE key = '{k(s, 'r-dead:slack:note')}'",  # a dead letter
        f"DELETE FROM delivery_log WHERE key = '{k(s, 'r-old:slack:note')}'",  # its message is still there
        "UPDATE delivery_log SET external_id = 'x'",
        f"UPDATE requests SET agent_id = '{s['live'].id}' WHERE {old}",
        f"UPDATE requests SET input = '{{}}' WHERE {old}",
    ]
    for statement in refused:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            sql(db, statement)
    prune(db, KEEP_30)
    with pytest.raises(psycopg.errors.InsufficientPrivilege):  # pruned once, for good
        sql(db, f"UPDATE requests SET pruned_at = now() WHERE {old}")


def test_the_leading_beat_prunes_once_per_interval_whichever_beat_asks(db_url: str, db: Database, story: Any) -> None:
    """The chore is due on the database's clock (``beat_chores``): of two beats asking, one prunes."""
    from models.settings import Settings
    from tasks.leader import LeaderDuties

    s = story()
    settings = Settings(database_url=db_url, jobs_retention_days=30, outbox_retention_days=30)
    first, second = LeaderDuties(db, settings, "beat-1"), LeaderDuties(db, settings, "beat-2")
    first._prune()
    second._prune()
    assert first._pruning is not None and second._pruning is None
    first._pruning.join(30)
    assert job_row(db, k(s, "r-old:answer:1")) is None
    kept = Settings(database_url=db_url, jobs_retention_days=0, outbox_retention_days=0, requests_retention_days=0)
    idle = LeaderDuties(db, kept, "beat-3")
    sql(db, "DELETE FROM beat_chores")
    idle._prune()
    assert idle._pruning is None  # retention 0 everywhere: nothing to do, no thread


def test_keel_db_prune_prints_what_it_removed(db_url: str, story: Any) -> None:
    import subprocess

    from tests.support.audit import clean_env

    story()
    env = {**clean_env(), "KEEL_DATABASE_URL": db_url, "KEEL_REQUESTS_RETENTION_DAYS": "0"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return run_keel(["db", "prune", *args], env)

    dry = run("--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines() == [
        "would prune 2 finished jobs, 1 sent outbox messages with 1 delivery log rows, 0 request inputs",
        "kept for ever (retention 0 days): requests",
    ]
    done = json.loads(run("--json").stdout)
    assert (done["jobs"], done["messages"], done["delivery_log"], done["dry_run"]) == (2, 1, 1, False)
    assert json.loads(run("--json").stdout)["jobs"] == 0


def test_the_application_role_prunes_without_delete_on_the_delivery_log(roles_db: Any) -> None:
    """Least privilege: a confirmation goes with its message by the foreign key's cascade (run as the owner); the
    application role itself may not delete one."""
    from tests.support.audit import TEST_KEYS

    app = Database(roles_db.app_url, pool_size=2, audit_keys=TEST_KEYS)
    try:
        client = Client(app)
        agent = client.create_agent("ledger")
        client.submit(agent.id, "r-1", None, operation="answer")
        emit(app, agent.id, MessageSpec("slack", "C1", "note", {"text": "hi"}))
        with psycopg.connect(libpq_url(roles_db.url), autocommit=True) as su:
            su.execute("UPDATE outbox SET status = 'sent', external_id = '1.2', sent_at = now() - interval '40 days'")
            su.execute(
                "INSERT INTO delivery_log (key, external_id, attempt, how, confirmed_at)"
                " VALUES (%s, '1.2', 1, 'sent', now())",
                (scoped(agent.id, "r-1:slack:note"),),
            )
        client.cancel(agent.id, actor="alice", reason="done with it")  # at rest: not in flight
        with psycopg.connect(libpq_url(roles_db.app_url), autocommit=True) as conn:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("DELETE FROM delivery_log")
        pruned = prune(app, Retention(30, 30, 30))
        assert (pruned.messages, pruned.confirmations) == (1, 1)
        with psycopg.connect(libpq_url(roles_db.url)) as su:
            assert su.execute("SELECT count(*) FROM delivery_log").fetchone() == (0,)
            assert su.execute("SELECT kind, key FROM pruned_keys").fetchall() == [
                ("message", scoped(agent.id, "r-1:slack:note"))
            ]
    finally:
        app.dispose()
