"""The alert rules (measures + thresholds -> firing or not, with the value), the episode steps that keep a flapping
condition to one episode, the keys, the daily report's day, and the alert settings' checks."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import pytest

from agents.core.keys import split_key
from agents.observability import alerts, report
from agents.observability.alerts import Keep, Measures, Open, Resolve, Thresholds, evaluate, next_step
from models.settings import ALERT_NAMES, BadConfiguration, load_settings
from models.tables import CHANNELS

T = Thresholds()


def verdict(name: str, m: Measures, t: Thresholds = T) -> alerts.Verdict:
    return {v.name: v for v in evaluate(m, t)}[name]


def test_every_alert_has_a_rule_and_none_is_named_like_a_channel() -> None:
    assert tuple(alerts.RULES) == ALERT_NAMES
    assert not set(ALERT_NAMES) & set(CHANNELS)


def test_quiet_measures_fire_nothing() -> None:
    assert [v.name for v in evaluate(Measures(), T) if v.firing] == []


@pytest.mark.parametrize(
    ("name", "measures", "value"),
    [
        ("side_effect_duplicates", Measures(side_effect_duplicates=1), 1),
        ("dead_letters", Measures(dead_letters=3), 3),
        ("transition_p95", Measures(p95_transition_seconds=1.5), 1.5),
        ("recovery_rate", Measures(jobs_finished_after_failure=10, recovery_rate=0.2), 0.2),
        ("retry_cost_share", Measures(retry_cost_share=0.4), 0.4),
        ("oldest_due_job", Measures(oldest_due_job_age_seconds=301), 301),
        ("beat_leader_gap", Measures(beat_leader_gap_seconds=180), 180),
        ("audit_verify", Measures(audit_verify_ok=False, audit_verify_breaks=2), 2),
        ("journal_partitions", Measures(journal_months_ahead=1), 1),
        ("audit_ship_lag", Measures(audit_ship_lag_seconds=3601), 3601),
    ],
)
def test_each_rule_fires_past_its_threshold_with_the_value(name: str, measures: Measures, value: float) -> None:
    fired = verdict(name, measures)
    assert fired.firing and fired.value == value
    assert [v.name for v in evaluate(measures, T) if v.firing] == [name]


@pytest.mark.parametrize(
    ("name", "measures"),
    [
        ("dead_letters", Measures(dead_letters=0)),
        ("transition_p95", Measures(p95_transition_seconds=0.5)),  # at the bound is not over it
        ("transition_p95", Measures(p95_transition_seconds=None)),  # nothing measured
        ("recovery_rate", Measures(jobs_finished_after_failure=10, recovery_rate=0.5)),
        ("recovery_rate", Measures(jobs_finished_after_failure=4, recovery_rate=0.0)),  # too few to judge
        ("retry_cost_share", Measures(retry_cost_share=None)),
        ("beat_leader_gap", Measures(beat_leader_gap_seconds=None)),
        ("audit_verify", Measures(audit_verify_ok=None)),  # never ran
        ("audit_verify", Measures(audit_verify_ok=True, audit_verify_breaks=0)),
        ("journal_partitions", Measures(journal_months_ahead=2)),  # two months ahead is enough
        ("journal_partitions", Measures(journal_months_ahead=None)),  # not measured
        ("audit_ship_lag", Measures(audit_ship_lag_seconds=None)),  # not shipped: nothing to lag behind
        ("audit_ship_lag", Measures(audit_ship_lag_seconds=3600)),
    ],
)
def test_a_rule_within_bounds_does_not_fire(name: str, measures: Measures) -> None:
    assert not verdict(name, measures).firing


def test_a_verify_that_could_not_check_every_link_fires_and_says_so() -> None:
    """Events linked with a key the verifier's ring lacks are not intact: the alert fires, without calling them
    broken."""
    fired = verdict("audit_verify", Measures(audit_verify_ok=False, audit_verify_breaks=0, audit_verify_unchecked=12))
    assert fired.firing
    assert fired.summary == (
        "the latest keel audit verify could not check 12 events: their audit key is not in its KEEL_AUDIT_KEYS"
    )


def test_thresholds_come_from_the_settings_and_disabled_alerts_never_fire() -> None:
    settings = load_settings(alert_dead_letters_max=5, alert_disabled=["oldest_due_job"])
    t = Thresholds.from_settings(settings)
    assert not verdict("dead_letters", Measures(dead_letters=5), t).firing
    assert verdict("dead_letters", Measures(dead_letters=6), t).firing
    off = {v.name: v for v in evaluate(Measures(oldest_due_job_age_seconds=9999), t, settings.alert_disabled)}
    assert not off["oldest_due_job"].firing and "disabled" in off["oldest_due_job"].summary


NOW = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
HOLD = timedelta(minutes=5)


def test_steps_open_keep_and_resolve_only_after_the_hold() -> None:
    assert next_step(True, None, False, NOW, HOLD) == Open()
    assert next_step(False, None, False, NOW, HOLD) is None
    assert next_step(True, None, True, NOW, HOLD) == Keep(None)
    assert next_step(False, None, True, NOW, HOLD) == Keep(NOW)  # clear from now on
    assert next_step(False, NOW, True, NOW + timedelta(minutes=4), HOLD) == Keep(NOW)
    assert next_step(True, NOW, True, NOW + timedelta(minutes=4), HOLD) == Keep(None)  # flapped back: count over
    assert next_step(False, NOW, True, NOW + HOLD, HOLD) == Resolve(NOW)
    assert next_step(False, None, True, NOW, timedelta(0)) == Resolve(NOW)


def test_alert_keys_read_alert_name_start_and_fit_the_key_scheme() -> None:
    started = datetime(2026, 12, 1, 10, 15, 0, 123456, tzinfo=UTC)
    key = alerts.episode_key("dead_letters", started, "firing")
    assert key == "alert:dead_letters:2026-12-01T10:15:00.123456Z:firing"
    assert split_key(key) == ("alert", "dead_letters", "2026-12-01T10:15:00.123456Z:firing")
    assert alerts.episode_key("dead_letters", started, "resolved").endswith(":resolved")


def test_the_report_is_due_from_its_time_of_day_on() -> None:
    # A day's report is due from its HH:MM until the next day's: before 08:00, yesterday's is the one due.
    assert report.due_day(datetime(2026, 12, 1, 7, 59, tzinfo=UTC), "08:00") == date(2026, 11, 30)
    assert report.due_day(datetime(2026, 12, 1, 8, 0, tzinfo=UTC), "08:00") == date(2026, 12, 1)
    assert report.due_day(datetime(2026, 12, 1, 23, 0, tzinfo=UTC), "off") is None


def test_a_late_report_time_is_not_skipped_when_the_evaluation_drifts_past_midnight() -> None:
    """Evaluations ~60 s apart: one at 23:58:59, the next at 00:00:00.6 — neither at or after 23:59 on Dec 1. The
    second still finds Dec 1's report due (and the one after it too, until Dec 2's 23:59)."""
    before = datetime(2026, 12, 1, 23, 58, 59, 500000, tzinfo=UTC)
    after = datetime(2026, 12, 2, 0, 0, 0, 600000, tzinfo=UTC)
    assert report.due_day(before, "23:59") == date(2026, 11, 30)
    assert report.due_day(after, "23:59") == date(2026, 12, 1)
    assert report.due_day(datetime(2026, 12, 2, 23, 58, tzinfo=UTC), "23:59") == date(2026, 12, 1)
    assert report.due_day(datetime(2026, 12, 2, 23, 59, tzinfo=UTC), "23:59") == date(2026, 12, 2)
    assert report.due_day(datetime(2026, 12, 2, 0, 0, tzinfo=UTC), "00:00") == date(2026, 12, 2)
    assert report.report_key(date(2026, 12, 1)) == "kpi:daily-report:2026-12-01"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"alert_slack_channel": "#ops"}, "KEEL_ALERT_SLACK_CHANNEL: must be a Slack conversation id"),
        ({"alert_disabled": ["dead_letter"]}, "KEEL_ALERT_DISABLED: unknown alerts ['dead_letter']"),
        ({"kpi_report_at": "25:00"}, "KEEL_KPI_REPORT_AT: must be a UTC time of day as HH:MM"),
        ({"alert_interval_seconds": 0}, "KEEL_ALERT_INTERVAL_SECONDS"),
        ({"alert_recovery_rate_min": 1.5}, "KEEL_ALERT_RECOVERY_RATE_MIN"),
        ({"alert_window_seconds": 30}, "KEEL_ALERT_WINDOW_SECONDS"),  # the counters are kept per minute
    ],
)
def test_bad_alert_settings_are_refused_naming_the_variable(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(BadConfiguration, match=r"^bad configuration: ") as caught:
        load_settings(**overrides)
    assert message in str(caught.value)


def test_alert_defaults() -> None:
    settings = load_settings(alert_slack_channel="", kpi_report_at=" OFF ")
    assert settings.alert_slack_channel is None  # compose's empty value means none
    assert settings.kpi_report_at == "off"
    assert settings.alert_interval_seconds == 60
    assert settings.audit_verify_interval_seconds == 3600


def test_a_forged_verification_record_fires_whatever_it_says() -> None:
    fired = verdict("audit_verify", Measures(audit_verify_ok=True, audit_verify_breaks=0, audit_verify_forged="x"))
    assert fired.firing and fired.summary.startswith("the latest recorded keel audit verify cannot be believed: x")
