"""The KPI arithmetic: quantiles from histogram buckets, rates, durations people type, the report's table."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

from agents.observability.kpis import parse_duration, report_lines
from models.kpi_sql import histogram, kpis_of, quantile


def test_quantile_interpolates_inside_its_bucket_like_histogram_quantile() -> None:
    # 10 observations: 2 up to 0.1 s, 6 more up to 0.5 s, 2 more up to 1 s.
    buckets = [(0.1, 2.0), (0.5, 8.0), (1.0, 10.0), (math.inf, 10.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (5 - 2) / 6)
    assert quantile(0.95, buckets) == pytest.approx(0.5 + 0.5 * (9.5 - 8) / 2)
    assert quantile(0.1, buckets) == pytest.approx(0.05)  # the first bucket starts at 0
    # Beyond the highest finite bound all that can be said is that bound.
    assert quantile(0.99, [(0.1, 1.0), (math.inf, 10.0)]) == 0.1
    assert quantile(0.95, [(0.1, 0.0), (math.inf, 0.0)]) is None


def test_histogram_sums_per_bucket_counts_into_cumulative_ones_with_every_bound() -> None:
    stored = {
        ("t_bucket", "event=plan,le=0.1"): 2.0,
        ("t_bucket", "event=finish,le=0.1"): 1.0,
        ("t_bucket", "event=plan,le=+Inf"): 1.0,
        ("t_count", "event=plan"): 3.0,
    }
    assert histogram(stored, "t", (0.1, 0.5)) == [(0.1, 3.0), (0.5, 3.0), (math.inf, 4.0)]
    assert histogram(stored, "t", (0.1, 0.5), event="plan") == [(0.1, 2.0), (0.5, 2.0), (math.inf, 3.0)]


def test_rates_are_none_until_there_is_something_to_measure() -> None:
    empty = kpis_of({}, None)
    assert (empty.failure_rate, empty.recovery_rate, empty.duplicate_rate, empty.p95_request_seconds) == (None,) * 4
    k = kpis_of(
        {
            ("requests_finished", "outcome=done"): 2.0,
            ("requests_finished", "outcome=failed"): 1.0,
            ("jobs_first_failures", ""): 6.0,  # two of them still waiting for their retry: in neither term below
            ("jobs_finished_after_failure", ""): 4.0,
            ("jobs_recovered", ""): 3.0,
            ("spent_cost", ""): 0.3,
            ("retry_cost", ""): 0.1,
            ("deadline_stops", "kind=hard"): 1.0,
            ("deadline_stops", "kind=soft"): 2.0,
        },
        timedelta(hours=24),
    )
    assert (k.failure_rate, k.recovery_rate, k.retry_cost_share) == (0.333333, 0.75, 0.333333)
    assert (k.deadline_stops, k.deadline_demotions, k.since) == (1, 2, timedelta(hours=24))


@pytest.mark.parametrize(
    ("text", "expected"),
    [("24h", timedelta(hours=24)), ("90m", timedelta(minutes=90)), ("7d", timedelta(days=7)), ("2w", timedelta(14))],
)
def test_durations_people_type(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["", "24", "h", "1.5h", "-1h", "0m", "24 hours", "99999999999999d"])
def test_a_duration_that_is_not_one_is_refused_naming_the_rule(text: str) -> None:
    with pytest.raises(ValueError, match=r"duration"):
        parse_duration(text)


def test_the_report_reads_as_a_table_for_people() -> None:
    k = kpis_of(
        {
            ("suppressed_duplicates", "kind=submit"): 3.0,
            ("suppressed_duplicates", "kind=job_delivery"): 1234.0,
            ("side_effect_confirmations", "channel=slack"): 10.0,
            ("retry_tokens", ""): 12345.0,
            ("retry_cost", ""): 0.0025,
            ("spent_cost", ""): 0.01,
        },
        None,
    )
    rows = dict(report_lines(k))
    assert rows["suppressed duplicates"] == "1,237 (submit 3, job_delivery 1,234)"
    assert (
        rows["side-effect duplicates"] == "0 of 10 confirmed deliveries (duplicate rate 0.0%: deliveries per key - 1)"
    )
    assert rows["retry-caused cost"] == "12,345 tokens, $0.0025 (25.0% of spend)"
    assert rows["failure rate"] == rows["p95 phase-transition latency"] == "-"
