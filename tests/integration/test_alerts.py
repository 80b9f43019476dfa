"""Alerts against a real database: an episode opens and resolves once, each with exactly one outbox message, whoever
evaluates and however often; the daily KPI report goes out once a day; `keel alerts` lists the episodes."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from agents.audit.ship import ship_configured
from agents.audit.verify import verify_and_record
from agents.client import Client
from agents.core.commands import Command, MessageSpec
from agents.core.phases import Event
from agents.core.transition import transition
from agents.jobs.handlers import registry
from agents.observability import alerts, report
from agents.outbox.relay import Backoff, Relay, retry_dead
from agents.outbox.senders import SlackSender
from models import alerts_sql
from models.clock import rfc3339
from models.db import Database
from models.settings import Settings
from tests.support.audit import TEST_KEYS
from tests.support.cli import keel
from tests.support.fakes import FakeSlack
from tests.support.keys import scoped

pytestmark = pytest.mark.integration

for _operation in ("noop",):
    registry.declare(_operation)

SLACK_TOKEN = "xoxb-alerts-test-slack-token"
ALERTS = "CALERTS"
REFUSED = "CREFUSED"


@pytest.fixture
def slack() -> Iterator[FakeSlack]:
    fake = FakeSlack(token=SLACK_TOKEN)
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture
def relay(db: Database, slack: FakeSlack) -> Iterator[Relay]:
    made = Relay(
        db,
        {"slack": SlackSender(SLACK_TOKEN, f"{slack.url}/api/", timeout=2.0)},
        lease=timedelta(seconds=10),
        concurrency=4,
        backoff=Backoff(0.05, 0.2, 3),
        pass_seconds=10,
    )
    yield made
    made.close()


def settings(db_url: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "database_url": db_url,
        "alert_slack_channel": ALERTS,
        "alert_resolve_after_seconds": 0,
        "alert_window_seconds": 60,
    }
    return Settings(**{**values, **overrides})


def drain(r: Relay) -> None:
    for _ in range(50):
        r.run_pass()
        with psycopg.connect(r.db.libpq_url) as conn:
            row = conn.execute("SELECT count(*) FROM outbox WHERE status IN ('pending', 'sending')").fetchone()
        if row == (0,):
            return
        time.sleep(0.05)
    raise AssertionError("the outbox did not drain")


def dead_letter(client: Client, relay: Relay, slack: FakeSlack) -> str:
    """An agent's Slack message the receiver refuses for good: one dead letter. Returns its key."""
    slack.refusing.add(REFUSED)
    agent = client.create_agent("notifier")
    client.submit(agent.id, "req-1", None, operation="noop")
    spec = MessageSpec("slack", REFUSED, "m1", {"text": "hello"})
    transition(client.db, Command(agent.id, Event.PROGRESS, "worker", messages=(spec,)))
    drain(relay)
    return scoped(agent.id, "req-1:slack:m1")


def scraped(db: Database, series: str) -> float | None:
    """The value of ``series`` in a Prometheus scrape of :class:`AlertsCollector` (what the API and beats export)."""
    registry = CollectorRegistry()
    registry.register(alerts.AlertsCollector(db, cache_seconds=0))
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(series + " "):
            return float(line.split(" ")[1])
    return None


def alert_rows(raw: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return raw.execute(
        "SELECT key, agent_id, request_id, destination, status FROM outbox WHERE request_id = 'alert' ORDER BY seq"
    ).fetchall()


def test_an_episode_posts_firing_once_and_resolved_once(
    client: Client, db: Database, db_url: str, relay: Relay, slack: FakeSlack, raw: psycopg.Connection[Any]
) -> None:
    config = settings(db_url)
    key = dead_letter(client, relay, slack)

    opened = alerts.evaluate_and_record(db, config)
    assert [(c.name, c.what) for c in opened] == [("dead_letters", "opened")]
    episode = opened[0].episode
    firing_key = f"alert:dead_letters:{rfc3339(episode.started_at)}:firing"
    for _ in range(3):  # evaluated again and again while it fires: nothing new
        assert alerts.evaluate_and_record(db, config) == []
    assert alert_rows(raw) == [(firing_key, None, "alert", ALERTS, "pending")]
    assert [e.name for e in alerts_sql.open_episodes(db)] == ["dead_letters"]
    assert alerts.firing(db)["dead_letters"] == 1
    assert scraped(db, 'keel_alerts_firing{alert="dead_letters"}') == 1.0

    drain(relay)
    assert slack.delivered_keys()[firing_key] == 1
    posted = slack.channels[ALERTS][0]["text"]
    assert "dead_letters" in posted and "firing" in posted

    slack.refusing.clear()
    retry_dead(db, key, actor="ops")  # the operator's fix: the letter is delivered, none is dead
    drain(relay)
    resolved = alerts.evaluate_and_record(db, config)
    assert [(c.name, c.what) for c in resolved] == [("dead_letters", "resolved")]
    assert alerts.evaluate_and_record(db, config) == []
    drain(relay)
    resolved_key = firing_key.removesuffix(":firing") + ":resolved"
    assert [r[0] for r in alert_rows(raw)] == [firing_key, resolved_key]
    assert {k: n for k, n in slack.delivered_keys().items() if k.startswith("alert:")} == {
        firing_key: 1,
        resolved_key: 1,
    }
    assert alerts_sql.open_episodes(db) == []
    assert alerts.firing(db)["dead_letters"] == 0
    assert scraped(db, 'keel_alerts_firing{alert="dead_letters"}') == 0.0


def test_no_channel_records_and_lists_episodes_but_posts_nothing(
    client: Client, db: Database, db_url: str, relay: Relay, slack: FakeSlack, raw: psycopg.Connection[Any]
) -> None:
    dead_letter(client, relay, slack)
    changes = alerts.evaluate_and_record(db, settings(db_url, alert_slack_channel=None))
    assert [(c.name, c.what) for c in changes] == [("dead_letters", "opened")]
    assert alert_rows(raw) == []
    listed = keel(db_url, "alerts")
    assert "dead_letters" in listed.stdout and "firing" in listed.stdout
    # The channel is set meanwhile: the episode's end is not announced where its start never was.
    resolved = alerts.record(
        db,
        [alerts.Verdict("dead_letters", False, 0, 0, "none dead")],
        channel=ALERTS,
        hold=timedelta(0),
    )
    assert [c.what for c in resolved] == ["resolved"]
    assert alert_rows(raw) == []


def test_a_flapping_condition_keeps_one_episode_until_clear_for_the_hold(db: Database) -> None:
    fire = [alerts.Verdict("oldest_due_job", True, 400, 300, "old")]
    calm = [alerts.Verdict("oldest_due_job", False, 10, 300, "fine")]
    hold = timedelta(seconds=1.5)
    assert [c.what for c in alerts.record(db, fire, channel=ALERTS, hold=hold)] == ["opened"]
    for verdicts in (calm, fire, calm, fire, calm):  # each clear spell shorter than the hold
        assert alerts.record(db, verdicts, channel=ALERTS, hold=hold) == []
    time.sleep(1.6)
    assert [c.what for c in alerts.record(db, calm, channel=ALERTS, hold=hold)] == ["resolved"]
    episodes = alerts_sql.list_episodes(db, include_resolved=True, limit=10)
    assert len(episodes) == 1
    assert [c.what for c in alerts.record(db, fire, channel=ALERTS, hold=hold)] == ["opened"]
    assert len(alerts_sql.list_episodes(db, include_resolved=True, limit=10)) == 2


def test_evaluators_racing_open_and_resolve_one_episode_with_one_message_each(
    db: Database, raw: psycopg.Connection[Any]
) -> None:
    def race(firing: bool) -> list[list[alerts.Change]]:
        verdicts = [alerts.Verdict("side_effect_duplicates", firing, 1 if firing else 0, 0, "dup")]
        start = threading.Barrier(8)
        results: list[list[alerts.Change]] = []

        def evaluate() -> None:
            start.wait()
            results.append(alerts.record(db, verdicts, channel=ALERTS, hold=timedelta(0)))

        threads = [threading.Thread(target=evaluate) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    opened = race(True)
    assert sum(len(r) for r in opened) == 1
    resolved = race(False)
    assert sum(len(r) for r in resolved) == 1
    keys = [r[0] for r in alert_rows(raw)]
    assert len(keys) == 2 and keys[0].endswith(":firing") and keys[1].endswith(":resolved")
    assert raw.execute("SELECT count(*) FROM alert_episodes").fetchone() == (1,)


def test_a_chore_runs_once_per_interval_on_the_database_clock(db: Database) -> None:
    every = timedelta(seconds=30)
    results: list[object] = []
    start = threading.Barrier(6)

    def claim() -> None:
        start.wait()
        results.append(alerts_sql.claim_chore(db, "alerts", every))

    threads = [threading.Thread(target=claim) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r is not None for r in results) == 1
    assert alerts_sql.claim_chore(db, "alerts", every) is None
    assert alerts_sql.claim_chore(db, "alerts", timedelta(0)) is not None


def test_a_leaderless_gap_fires_the_beat_alert(db: Database, db_url: str, raw: psycopg.Connection[Any]) -> None:
    assert scraped(db, "keel_beat_leader_last_tick_age_seconds") is None  # no beat ever led: absent
    first = alerts_sql.start_term(db, "beat-a:1")
    assert first.gap_seconds is None
    alerts_sql.heartbeat(db, first.id)
    age = scraped(db, "keel_beat_leader_last_tick_age_seconds")
    assert age is not None and 0 <= age < 60
    time.sleep(1.2)  # nobody leads
    second = alerts_sql.start_term(db, "beat-b:2")
    assert second.gap_seconds is not None and second.gap_seconds >= 1.0
    config = settings(db_url, alert_beat_leader_gap_max_seconds=1.0, alert_slack_channel=None)
    changes = alerts.evaluate_and_record(db, config)
    assert [(c.name, c.what) for c in changes] == [("beat_leader_gap", "opened")]
    # Leading again for longer than the window (the terms began 2 minutes ago, the window is 1): the gap is history.
    raw.execute("UPDATE beat_terms SET started_at = started_at - interval '2 minutes'")
    changes = alerts.evaluate_and_record(db, config)
    assert [(c.name, c.what) for c in changes] == [("beat_leader_gap", "resolved")]


def test_the_leader_tick_age_is_measured_by_the_database(db: Database, raw: psycopg.Connection[Any]) -> None:
    """Exported as an age the database computes from its own stamp (one clock): Prometheus compares it with a bound,
    never with its own time(), so a host whose clock is minutes off changes nothing."""
    term = alerts_sql.start_term(db, "beat-a:1")
    alerts_sql.heartbeat(db, term.id)
    raw.execute("UPDATE beat_terms SET last_tick_at = clock_timestamp() - interval '10 minutes'")
    age = scraped(db, "keel_beat_leader_last_tick_age_seconds")
    assert age is not None and 600 <= age < 660
    assert alerts.leader_tick_age(db) == pytest.approx(age, abs=60)
    assert scraped(db, "keel_beat_leader_last_tick_timestamp_seconds") is None  # the clock-dependent one is gone


def test_a_failed_audit_verify_fires_until_one_passes(
    client: Client, db: Database, db_url: str, raw: psycopg.Connection[Any]
) -> None:
    config = settings(db_url, alert_slack_channel=None)
    agent = client.create_agent("audited")
    assert verify_and_record(db, "beat").ok
    assert alerts.evaluate_and_record(db, config) == []
    row = raw.execute("SELECT actor FROM audit.journal WHERE agent_id = %s AND seq = 1", (agent.id,)).fetchone()
    assert row is not None
    raw.execute("ALTER TABLE audit.journal DISABLE TRIGGER USER")
    raw.execute("UPDATE audit.journal SET actor = 'mallory' WHERE agent_id = %s AND seq = 1", (agent.id,))
    raw.execute("ALTER TABLE audit.journal ENABLE TRIGGER USER")
    # Event 1 is below the checkpoint the verify above left: only a full pass sees it (docs/how-to/audit.md).
    result = keel(db_url, "audit", "verify", "--full", check=False)  # the command's outcome is recorded too
    assert result.returncode == 1
    changes = alerts.evaluate_and_record(db, config)
    assert [(c.name, c.what, c.episode.value) for c in changes] == [("audit_verify", "opened", 1.0)]
    raw.execute("ALTER TABLE audit.journal DISABLE TRIGGER USER")
    raw.execute("UPDATE audit.journal SET actor = %s WHERE agent_id = %s AND seq = 1", (row[0], agent.id))
    raw.execute("ALTER TABLE audit.journal ENABLE TRIGGER USER")
    # Put back, but the full pass marked the chain's checkpoint: the beat's passes fail until the owner clears it.
    assert not verify_and_record(db, "beat").ok
    raw.execute("DELETE FROM audit_verified_chains WHERE agent_id = %s", (agent.id,))
    assert verify_and_record(db, "beat").ok
    assert [(c.name, c.what) for c in alerts.evaluate_and_record(db, config)] == [("audit_verify", "resolved")]


def test_the_daily_report_is_posted_once_a_day(
    db: Database, db_url: str, relay: Relay, slack: FakeSlack, raw: psycopg.Connection[Any]
) -> None:
    config = settings(db_url, kpi_report_at="00:00")
    keys: list[str | None] = []
    start = threading.Barrier(4)

    def post() -> None:
        start.wait()
        keys.append(report.post_daily_report(db, config))

    threads = [threading.Thread(target=post) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    posted = [k for k in keys if k is not None]
    assert len(posted) == 1 and posted[0].startswith("kpi:daily-report:")
    assert report.post_daily_report(db, config) is None
    drain(relay)
    assert slack.delivered_keys()[posted[0]] == 1
    text = slack.channels[ALERTS][0]["text"]
    assert "Keel KPIs for" in text and "side-effect duplicates" in text
    assert report.post_daily_report(db, settings(db_url, kpi_report_at="off")) is None


def test_keel_alerts_lists_firing_and_past_episodes(db: Database, db_url: str) -> None:
    assert keel(db_url, "alerts").stdout.strip() == "no alert is firing"
    alerts.record(db, [alerts.Verdict("dead_letters", True, 2, 0, "2 dead")], channel=None, hold=timedelta(0))
    alerts.record(db, [alerts.Verdict("dead_letters", False, 0, 0, "none")], channel=None, hold=timedelta(0))
    alerts.record(db, [alerts.Verdict("oldest_due_job", True, 400, 300, "old")], channel=None, hold=timedelta(0))
    now = keel(db_url, "alerts").stdout
    assert "oldest_due_job" in now and "dead_letters" not in now
    past = json.loads(keel(db_url, "alerts", "--all", "--json").stdout)["episodes"]
    assert [(e["name"], e["state"]) for e in past] == [("oldest_due_job", "firing"), ("dead_letters", "resolved")]
    assert past[1]["value"] == 2 and past[1]["resolved_at"] is not None


def test_the_api_shows_keel_own_messages_to_tokens_that_see_every_agent_only(api: Any, db: Database) -> None:
    changes = alerts.record(
        db, [alerts.Verdict("dead_letters", True, 1, 0, "1 dead")], channel=ALERTS, hold=timedelta(0)
    )
    key = alerts.episode_key("dead_letters", changes[0].episode.started_at, "firing")
    with api.http(api.token("operator")) as http:
        listed = http.get("/v1/outbox").json()["messages"]
        assert [(m["key"], m["agent_id"], m["request_id"]) for m in listed] == [(key, None, "alert")]
        assert http.get(f"/v1/outbox/{key}").json()["agent_id"] is None
    with api.http(api.token("operator", prefix="acme-")) as http:
        assert http.get("/v1/outbox").json()["messages"] == []
        assert http.get(f"/v1/outbox/{key}").status_code == 404


def test_a_dead_alert_message_can_be_retried_though_it_has_no_agent(
    db: Database, relay: Relay, slack: FakeSlack, raw: psycopg.Connection[Any]
) -> None:
    slack.refusing.add(REFUSED)
    alerts.record(db, [alerts.Verdict("dead_letters", True, 1, 0, "1 dead")], channel=REFUSED, hold=timedelta(0))
    drain(relay)
    [(key, _, _, _, status)] = alert_rows(raw)
    assert status == "dead"
    slack.refusing.clear()
    retry_dead(db, key, actor="ops")
    drain(relay)
    assert alert_rows(raw)[0][4] == "sent" and slack.delivered_keys()[key] == 1
    assert raw.execute("SELECT count(*) FROM audit.journal").fetchone() == (0,)  # no agent's chain to journal on


def test_a_forward_dated_verification_row_does_not_hide_a_later_failed_verify(db: Database) -> None:
    """The latest verification is the last one written (by id), not the one whose own `at` says latest: a row the
    application role inserted with a far-future time must not stand in front of every later failed verify."""
    with db.autocommit() as cur:
        cur.execute(
            "INSERT INTO audit_verifications (at, source, ok, agents, events, breaks, details, key_id, seal)"
            " VALUES ('9999-01-01T00:00:00Z', 'beat', true, 0, 0, 0, '{}', 'test-1', 'not-a-seal')"
        )
    alerts_sql.record_verification(db, source="beat", ok=False, agents=1, events=3, breaks=1, details={})
    latest = alerts_sql.last_verification(db)
    assert latest is not None and latest.ok is False and latest.breaks == 1


def test_shipping_lag_is_exported_and_alerted_while_a_ship_url_is_set(
    client: Client, db: Database, db_url: str, raw: psycopg.Connection[Any], tmp_path: Any
) -> None:
    """While KEEL_AUDIT_SHIP_URL is set: how many journal events are not shipped yet and how old the oldest is
    (database clock), as gauges; audit_ship_lag fires once that age passes its threshold, and clears once shipped.
    A forged shipment row (no valid seal) does not count as shipped."""
    url = f"file://{tmp_path}/store"
    config = settings(db_url, audit_ship_url=url, alert_audit_ship_lag_max_seconds=60, alert_slack_channel=None)
    destination = alerts.ship_destination(config)
    assert destination == url
    agent = client.create_agent("lagging")
    client.submit(agent.id, "r-lag", None, operation="noop")
    raw.execute("SET session_replication_role = replica")  # the events look two minutes old
    raw.execute("UPDATE audit.journal SET at = at - interval '2 minutes'")
    raw.execute("RESET session_replication_role")
    events = raw.execute("SELECT count(*) FROM audit.journal").fetchone()
    assert events is not None and events[0] > 0

    def scrape(series: str) -> float | None:
        registry = CollectorRegistry()
        registry.register(alerts.AlertsCollector(db, cache_seconds=0, ship_to=destination))
        for line in generate_latest(registry).decode().splitlines():
            if line.startswith(series + " "):
                return float(line.split(" ")[1])
        return None

    assert scraped(db, "keel_audit_unshipped_events") is None  # not shipping: not exported
    assert scrape("keel_audit_unshipped_events") == events[0]
    age = scrape("keel_audit_oldest_unshipped_age_seconds")
    assert age is not None and 120 <= age < 300
    raw.execute(
        "INSERT INTO audit_shipments (destination, first_id, last_id, events, segment, manifest_sha256, key_id, seal)"
        " SELECT %s, min(id), max(id), count(*), 'journal/x.jsonl', 'f', 'test-1', 'forged' FROM audit.journal",
        (url,),
    )
    changes = alerts.evaluate_and_record(db, config)
    assert [(c.name, c.what) for c in changes] == [("audit_ship_lag", "opened")]
    assert "age of the oldest journal event not shipped yet (s) is" in changes[0].episode.details["summary"]
    ship_configured(db, config, flush=True)
    assert scrape("keel_audit_unshipped_events") == 0
    assert scrape("keel_audit_oldest_unshipped_age_seconds") == 0
    assert [(c.name, c.what) for c in alerts.evaluate_and_record(db, config)] == [("audit_ship_lag", "resolved")]


def test_a_verify_that_stopped_passing_is_stale(db: Database, raw: psycopg.Connection[Any]) -> None:
    """keel_audit_verify_last_success_age_seconds: since the latest passing verify whose seal holds (absent: none); a
    failing one does not reset it, nor does a passing row forged without the key. Past the bound audit_verify fires."""
    assert scraped(db, "keel_audit_verify_last_success_age_seconds") is None
    alerts_sql.record_verification(db, source="beat", ok=True, agents=1, events=3, breaks=0, details={})
    time.sleep(1.2)
    alerts_sql.record_verification(db, source="beat", ok=False, agents=1, events=3, breaks=1, details={})
    raw.execute(
        "INSERT INTO audit_verifications (source, ok, agents, events, breaks, details, key_id, seal)"
        " VALUES ('beat', true, 1, 3, 0, '{}', %s, %s)",
        (TEST_KEYS.current, "0" * 64),
    )
    age = scraped(db, "keel_audit_verify_last_success_age_seconds")
    assert age is not None and 1.0 <= age < 60
    alerts_sql.record_verification(db, source="cli", ok=True, agents=1, events=3, breaks=0, details={})
    measures = alerts.measure(db, timedelta(minutes=15))
    assert measures.audit_verify_success_age_seconds is not None and measures.audit_verify_success_age_seconds < 1.0
    assert not alerts.audit_verify(measures, alerts.Thresholds()).firing
    stale = alerts.audit_verify(measures, alerts.Thresholds(audit_verify_stale_max_seconds=1e-6))
    assert stale.firing and stale.summary.startswith("no keel audit verify has passed for")
