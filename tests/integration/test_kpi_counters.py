"""The KPI counters: moved by the transactions that cause them (and by nothing else), with the values the scenario
implies. Folding them is test_kpi_folding.py; exporting and scraping them, test_kpi_export.py."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from agents.client import Client
from agents.core.commands import Command, JobSpec, MessageSpec, Usage
from agents.core.phases import Event
from agents.core.transition import now, transition
from agents.jobs import deadlines
from agents.jobs.handlers import JobContext, JobResult, Registry, registry
from agents.jobs.runner import Runner
from agents.observability import alerts
from agents.observability.alerts import Thresholds
from agents.observability.kpis import report_lines
from agents.outbox.relay import Backoff, Relay
from agents.outbox.senders import SlackSender
from models import outbox_sql
from models.db import Database
from models.jobs_sql import ClaimedJob, checkpoint, claim, extend_lease
from models.kpi_sql import REQUEST_SECONDS_BUCKETS, TRANSITION_SECONDS_BUCKETS, fold, totals, window
from tests.support.db import expire_lease
from tests.support.fakes import FakeSlack
from tests.support.keys import scoped
from tests.support.kpis import deltas, exported
from tests.support.runs import FAST_RULES, run_all

pytestmark = pytest.mark.integration

registry.declare("slow")  # run by a runner of its own below

SLACK_TOKEN = "xoxb-test-kpi-slack-token"
DEAD_CHANNEL = "C0DEAD"


@pytest.fixture
def slack() -> Iterator[FakeSlack]:
    # Every send to DEAD_CHANNEL fails; with one attempt allowed, its message is a dead letter.
    fake = FakeSlack(
        token=SLACK_TOKEN, faults=lambda destination, key, attempt: "500" if destination == DEAD_CHANNEL else None
    )
    fake.start()
    yield fake
    fake.stop()


def post(channel: str, text: str = "hello") -> dict[str, Any]:
    return {"name": "slack_post", "arguments": {"channel": channel, "text": text}}


def script(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"prompt": "Summarise open incidents", "script": list(entries)}


def relay_pass(db: Database, slack: FakeSlack) -> None:
    relay = Relay(
        db,
        {"slack": SlackSender(SLACK_TOKEN, f"{slack.url}/api/", timeout=2.0)},
        lease=timedelta(seconds=10),
        concurrency=4,
        backoff=Backoff(0.05, 0.2, 1),
        pass_seconds=10,
        secrets=(SLACK_TOKEN,),
    )
    try:
        for _ in range(40):
            relay.run_pass()
            with psycopg.connect(db.libpq_url) as conn:
                if conn.execute("SELECT count(*) FROM outbox WHERE status IN ('pending', 'sending')").fetchone() == (
                    0,
                ):
                    return
            time.sleep(0.1)
    finally:
        relay.close()
    raise AssertionError("the outbox did not drain")


def taken_over(client: Client, db: Database) -> None:
    """A worker that looks dead loses its job to another, which finishes it; the first one's outcome is fenced off."""
    agent = client.create_agent("slowpoke")
    client.submit(agent.id, "r-slow", None, operation="slow")
    started, release = threading.Event(), threading.Event()

    def slow(ctx: JobContext) -> JobResult:
        started.set()
        release.wait(10)
        return JobResult(event=Event.FINISH)

    def runner(handler: Any, worker: str) -> Runner:
        own = Registry()
        own.register("slow", handler)
        return Runner(db, own, worker=worker, lease=timedelta(seconds=30), rules=dict(FAST_RULES))

    results: list[Any] = []
    key = scoped(agent.id, "r-slow:slow:1")
    first = threading.Thread(target=lambda: results.append(runner(slow, "first").run(key)))
    first.start()
    assert started.wait(10)
    expire_lease(db, key)
    assert runner(lambda ctx: JobResult(event=Event.FINISH), "second").run(key).status == "succeeded"
    release.set()
    first.join(10)
    assert results[0].status == "fenced"


def test_every_exported_kpi_has_the_value_the_scenario_implies(client: Client, db: Database, slack: FakeSlack) -> None:
    # steady: posts to Slack, then answers; its producer retries the submit (a suppressed duplicate).
    steady = client.create_agent("steady")
    request = script({"tool_calls": [post("C0KPI")], "tokens": 100, "cost": "0.01"}, {"content": "done", "tokens": 50})
    client.submit(steady.id, "r-steady", request)
    client.submit(steady.id, "r-steady", request)
    # flaky: the model fails once (transient; the attempt's 40 tokens are spent anyway), then answers.
    flaky = client.create_agent("flaky")
    client.submit(flaky.id, "r-flaky", script({"content": "ok", "error": "transient", "tokens": 40, "cost": "0.004"}))
    # spender: its first reply spends more than its budget: the tool call after it is not started.
    spender = client.create_agent("spender", budget_tokens=100)
    client.submit(spender.id, "r-spender", script({"tool_calls": [post("C0KPI")], "tokens": 150}, {"content": "x"}))
    # mailer: posts where every send fails: a dead letter.
    mailer = client.create_agent("mailer")
    client.submit(mailer.id, "r-mailer", script({"tool_calls": [post(DEAD_CHANNEL)], "tokens": 10}, {"content": "ok"}))
    # waiting: the model is rate limited for an hour: a first failure, the job waits for its retry (not finished).
    waiting = client.create_agent("waiting")
    client.submit(
        waiting.id,
        "r-waiting",
        script({"content": "ok", "error": "rate_limited", "retry_after": 3600, "tokens": 0, "cost": "0"}),
    )
    # echo: a transition names a job key and an outbox key that are there already (both suppressed).
    echo = client.create_agent("echo")
    client.submit(echo.id, "r-echo", script({"content": "ok", "tokens": 5}))
    note = MessageSpec("slack", "C0KPI", "note", {"text": "note"})
    transition(db, Command(echo.id, Event.PROGRESS, "test", jobs=(JobSpec("plan", "1"),), messages=(note,)))
    transition(db, Command(echo.id, Event.PROGRESS, "test", messages=(note,)))
    run_all(db)
    # A late second delivery of a finished step: suppressed by the claim.
    again = Runner(db, registry, worker="late", lease=timedelta(seconds=30), rules=dict(FAST_RULES))
    assert again.run(scoped(steady.id, "r-steady:plan:1")).status == "suppressed"
    relay_pass(db, slack)
    taken_over(client, db)
    # late: demoted at its soft deadline, stopped at its hard one (its plan step never ran: cancelled).
    late = client.create_agent("late")
    client.submit(
        late.id,
        "r-late",
        script({"content": "ok"}),
        soft_deadline=timedelta(seconds=30),
        hard_deadline=timedelta(seconds=60),
    )
    assert deadlines.enforce(db, now() + timedelta(seconds=31)).demoted == [late.id]
    assert deadlines.enforce(db, now() + timedelta(seconds=61)).stopped == [late.id]

    phases = {
        a: client.get_state(a).phase
        for a in ("steady", "flaky", "spender", "mailer", "waiting", "echo", "slowpoke", "late")
    }
    assert phases == {
        "steady": "done",
        "flaky": "done",
        "spender": "failed",
        "mailer": "done",
        "waiting": "planning",
        "echo": "done",
        "slowpoke": "done",
        "late": "failed",
    }
    metrics = exported(db)
    assert fold(db) > 0
    assert exported(db) == metrics, "folding changes no figure"
    histograms = {k: v for k, v in metrics.items() if k.startswith(("keel_phase_transition", "keel_request_duration"))}
    assert {k: v for k, v in metrics.items() if k not in histograms} == pytest.approx(
        {
            'keel_suppressed_duplicates_total{kind="submit"}': 1,  # steady's retried submit
            'keel_suppressed_duplicates_total{kind="job_delivery"}': 1,  # the late delivery
            'keel_suppressed_duplicates_total{kind="job_insert"}': 1,  # echo
            'keel_suppressed_duplicates_total{kind="message_insert"}': 1,  # echo
            'keel_side_effect_confirmations_total{channel="slack"}': 2,  # steady's post, echo's note
            'keel_side_effect_confirmations_total{channel="github"}': 0,
            'keel_side_effect_duplicates_total{channel="slack"}': 0,
            'keel_side_effect_duplicates_total{channel="github"}': 0,
            'keel_requests_finished_total{outcome="done"}': 5,
            'keel_requests_finished_total{outcome="failed"}': 2,  # spender, late
            # steady 2 replies, flaky 1, spender 1, mailer 2, echo 1; late's never ran
            'keel_jobs_finished_total{operation="plan",status="succeeded"}': 7,
            'keel_jobs_finished_total{operation="plan",status="cancelled"}': 1,
            'keel_jobs_finished_total{operation="tool",status="succeeded"}': 2,  # steady's and mailer's posts
            'keel_jobs_finished_total{operation="tool",status="failed"}': 1,  # spender's: not started
            'keel_jobs_finished_total{operation="slow",status="succeeded"}': 1,
            'keel_job_attempt_failures_total{error_class="transient"}': 1,  # flaky
            'keel_job_attempt_failures_total{error_class="unknown"}': 1,  # slowpoke's first worker, taken over
            'keel_job_attempt_failures_total{error_class="rate_limited"}': 1,  # waiting
            'keel_job_attempt_failures_total{error_class="invalid"}': 0,
            'keel_job_attempt_failures_total{error_class="budget"}': 0,
            "keel_jobs_first_failures_total": 3,  # flaky, slowpoke, waiting
            # flaky and slowpoke finished after their failure (and recovered); waiting's retry is still to come
            "keel_jobs_finished_after_failure_total": 2,
            "keel_jobs_recovered_total": 2,
            # steady 100 + 50, flaky 40 + 40, spender 150, mailer 10 + 100, echo 5
            "keel_spent_tokens_total": 495,
            "keel_spent_cost_total": 0.023,
            "keel_retry_tokens_total": 40,
            "keel_retry_cost_total": 0.004,
            "keel_fenced_outcomes_total": 1,
            "keel_lease_takeovers_total": 1,
            "keel_budget_stops_total": 1,
            'keel_deadline_stops_total{kind="hard"}': 1,
            'keel_deadline_stops_total{kind="soft"}': 1,
            'keel_jobs{status="pending"}': 1,  # waiting's retry
            'keel_jobs{status="enqueued"}': 0,
            'keel_jobs{status="running"}': 0,
            "keel_oldest_due_job_age_seconds": 0,
            'keel_outbox_backlog{channel="slack"}': 0,
            'keel_outbox_backlog{channel="github"}': 0,
            'keel_outbox_oldest_age_seconds{channel="slack"}': 0,
            'keel_outbox_oldest_age_seconds{channel="github"}': 0,
            'keel_dead_letters{channel="slack"}': 1,  # mailer's
            'keel_dead_letters{channel="github"}': 0,
            "keel_kpi_up": 1,
        }
    )
    # Every transition once, by event (the suppressed submit is none); each histogram's buckets add up.
    assert {k: v for k, v in histograms.items() if k.startswith("keel_phase_transition_seconds_count")} == {
        f'keel_phase_transition_seconds_count{{event="{event}"}}': n
        # progress: 4, and waiting's retry scheduled
        for event, n in {"submit": 8, "plan": 3, "observe": 2, "progress": 5, "finish": 5, "fail": 2}.items()
    }
    assert histograms["keel_request_duration_seconds_count"] == 7
    assert histograms['keel_request_duration_seconds_bucket{le="+Inf"}'] == 7
    assert histograms["keel_request_duration_seconds_sum"] > 0
    for event in ("submit", "plan", "observe", "progress", "finish", "fail"):
        bounds = [*(repr(float(b)) for b in TRANSITION_SECONDS_BUCKETS), "+Inf"]
        counts = [histograms[f'keel_phase_transition_seconds_bucket{{event="{event}",le="{b}"}}'] for b in bounds]
        assert (
            counts == sorted(counts)
            and counts[-1] == histograms[f'keel_phase_transition_seconds_count{{event="{event}"}}']
        )
    k = totals(db)
    assert (k.failure_rate, k.recovery_rate, k.duplicate_rate) == (pytest.approx(2 / 7), 1.0, 0.0)
    assert k.retry_cost_share == pytest.approx(0.004 / 0.023, abs=1e-6)
    assert k.p95_transition_seconds is not None and k.p95_request_seconds is not None
    assert k.mean_request_seconds == pytest.approx(histograms["keel_request_duration_seconds_sum"] / 7, abs=1e-6)


def test_a_rolled_back_transition_moves_no_counter(client: Client, db: Database, raw: psycopg.Connection[Any]) -> None:
    agent = client.create_agent("a")
    client.submit(agent.id, "r-1", script({"content": "ok"}))
    before = deltas(raw)
    note = MessageSpec("slack", "C0KPI", "note", {"text": "note"})

    def boom(cur: Any, before: Any, after: Any) -> None:
        raise RuntimeError("the effects failed")

    with pytest.raises(RuntimeError):
        transition(
            db, Command(agent.id, Event.FAIL, "test", jobs=(JobSpec("plan", "1"),), messages=(note,)), effects=boom
        )
    assert deltas(raw) == before
    assert (totals(db).requests_failed, totals(db).suppressed_duplicates["job_insert"]) == (0, 0)


def test_claims_enqueues_and_lease_renewals_write_no_counter(
    client: Client, db: Database, raw: psycopg.Connection[Any]
) -> None:
    agent = client.create_agent("a")
    client.submit(agent.id, "r-1", None, operation="slow")
    before = deltas(raw)
    key = scoped(agent.id, "r-1:slow:1")
    raw.execute("UPDATE jobs SET status = 'enqueued', enqueued_at = now() WHERE key = %s", (key,))
    claimed = claim(db, key, "w", timedelta(seconds=30))
    assert isinstance(claimed, ClaimedJob)
    token = claimed.fencing_token
    assert extend_lease(db, key, token, timedelta(seconds=30))
    assert checkpoint(db, key, token, {"reply": {"n": 1}})
    assert deltas(raw) == before


def test_the_trigger_buckets_are_the_exporters(raw: psycopg.Connection[Any]) -> None:
    (body,) = raw.execute("SELECT pg_get_functiondef('keel_kpi_journal'::regproc)").fetchone()  # type: ignore[misc]
    found = re.findall(r"keel_kpi_le\((\w+), '\{([^}]*)\}'\)", str(body))
    bounds = {name: tuple(float(b) for b in text.split(",")) for name, text in found}
    assert bounds == {
        "elapsed": tuple(float(b) for b in TRANSITION_SECONDS_BUCKETS),
        "took": tuple(float(b) for b in REQUEST_SECONDS_BUCKETS),
    }
    labels = [
        r[0] for r in raw.execute("SELECT keel_kpi_le(v, '{0.5,1,2.5}') FROM unnest('{0,0.5,0.6,2.5,3}'::float8[]) v")
    ]
    assert labels == ["0.5", "0.5", "1", "2.5", "+Inf"]


def test_the_spend_of_a_fenced_off_outcome_is_counted_as_retry_caused(client: Client, db: Database) -> None:
    agent = client.create_agent("a")
    client.submit(agent.id, "r-1", None, operation="slow")
    started, release = threading.Event(), threading.Event()

    def slow(ctx: JobContext) -> JobResult:
        started.set()
        release.wait(10)
        return JobResult(usage=Usage(250, Decimal("0.25")), event=Event.FINISH)

    own = Registry()
    own.register("slow", slow)
    results: list[Any] = []
    worker = Runner(db, own, worker="w", lease=timedelta(seconds=30), rules=dict(FAST_RULES))
    thread = threading.Thread(target=lambda: results.append(worker.run(scoped(agent.id, "r-1:slow:1"))))
    thread.start()
    assert started.wait(10)
    client.cancel(agent.id, actor="op")
    release.set()
    thread.join(10)
    assert results[0].status == "fenced"
    k = totals(db)
    assert (k.fenced_outcomes, k.spent_tokens, k.retry_tokens, k.spent_cost, k.retry_cost) == (1, 250, 250, 0.25, 0.25)
    assert (k.requests_failed, k.counters[("jobs_finished", "operation=slow,status=cancelled")]) == (1, 1)


def test_recovery_is_judged_when_a_job_that_failed_finishes(
    client: Client, db: Database, raw: psycopg.Connection[Any]
) -> None:
    """A burst of rate-limited jobs waiting for their retries is not a recovery rate of 0 (nor an alert): they count
    once they finish. A failed or dead job counts as not recovered; one cancelled meanwhile is not judged."""
    for i in range(5):
        agent = client.create_agent(f"limited-{i}")
        client.submit(agent.id, f"r-{i}", script({"content": "ok", "error": "rate_limited", "retry_after": 3600}))
    run_all(db)
    k = totals(db)
    assert (k.jobs_first_failures, k.jobs_finished_after_failure, k.jobs_recovered, k.recovery_rate) == (5, 0, 0, None)
    verdict = {v.name: v for v in alerts.evaluate(alerts.measure(db, timedelta(minutes=15)), Thresholds())}
    assert (verdict["recovery_rate"].firing, verdict["recovery_rate"].value) == (False, None)
    # Their retries come due and succeed.
    raw.execute("UPDATE jobs SET run_at = now() WHERE status = 'pending'")
    run_all(db)
    k = totals(db)
    assert (k.jobs_first_failures, k.jobs_finished_after_failure, k.jobs_recovered, k.recovery_rate) == (5, 5, 5, 1.0)
    # One refused as invalid (failed at its first attempt, never retried); one cancelled while it waits to retry.
    refused = client.create_agent("refused")
    client.submit(refused.id, "r-refused", script({"content": "x", "error": "invalid"}))
    gone = client.create_agent("gone")
    client.submit(gone.id, "r-gone", script({"content": "ok", "error": "rate_limited", "retry_after": 3600}))
    run_all(db)
    client.cancel(gone.id, actor="op")
    refused_plan, gone_plan = scoped(refused.id, "r-refused:plan:1"), scoped(gone.id, "r-gone:plan:1")
    statuses = dict(raw.execute("SELECT key, status FROM jobs WHERE key IN (%s, %s)", (refused_plan, gone_plan)))
    assert statuses == {refused_plan: "failed", gone_plan: "cancelled"}
    for k in (totals(db), window(db, timedelta(minutes=15))):
        assert (k.jobs_first_failures, k.jobs_finished_after_failure, k.jobs_recovered) == (7, 6, 5)
        assert k.recovery_rate == round(5 / 6, 6)
    rows = dict(report_lines(totals(db)))
    assert (
        rows["recovery rate after first failure"] == "83.3% of 6 jobs finished after a failure (7 failed a first time)"
    )


def test_the_duplicate_rate_is_deliveries_per_key_minus_one_everywhere(
    db: Database, raw: psycopg.Connection[Any]
) -> None:
    """ARCHITECTURE.md: deliveries per key - 1. One key confirmed three times, another once: 4 deliveries of 2 keys,
    2 per key, a rate of 1 (100%) — in `keel kpi`, in `keel outbox stats` and on the dashboard alike."""
    for key, times in (("kpi:dup:a", 3), ("kpi:dup:b", 1)):
        raw.execute(
            "INSERT INTO outbox (key, request_id, channel, destination, payload, status, external_id, next_attempt_at)"
            " VALUES (%s, 'kpi', 'slack', 'C0KPI', '{}', 'sent', 'ts', now())",
            (key,),
        )
        for attempt in range(1, times + 1):
            raw.execute(
                "INSERT INTO delivery_log (key, external_id, attempt, how, confirmed_at)"
                " VALUES (%s, 'ts', %s, 'sent', now())",
                (key, attempt),
            )
    k = totals(db)
    assert (k.confirmations, k.side_effect_duplicates, k.duplicate_rate) == (4, 2, 1.0)
    stats = outbox_sql.stats(db)
    assert (stats["delivered_keys"], stats["duplicate_deliveries"], stats["duplicate_rate"]) == (2, 2, 1.0)
    assert (stats["max_deliveries_per_key"], stats["keys_delivered_more_than_once"]) == (3, 1)
    assert dict(report_lines(k))["side-effect duplicates"] == (
        "2 of 4 confirmed deliveries (duplicate rate 100.0%: deliveries per key - 1)"
    )
