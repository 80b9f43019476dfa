"""The alert rules and the dashboard hold up: promtool accepts the rules and the Prometheus config and proves the
rules fire and resolve; every metric the dashboard's and the rules' PromQL names is one Keel exports, with the labels
it groups by; the dashboard shows the seed's KPIs first and every exported metric somewhere.

promtool is Debian's ``prometheus`` package (.ci/run installs it). In CI (``CI=true``) a missing promtool fails;
elsewhere the promtool tests fall back to reading the YAML and say so in the test output."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from agents.core import observe as obs
from agents.observability.metrics import MetricsObserver, sample_names
from agents.observability.names import ALERTS, ALL, DOMAIN, PROCESS_LOCAL, MetricName
from models.settings import Settings
from tests.support.metrics import contract_problems, one_of_each_kind

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "keel.json"
#: The seed's KPIs, first on the dashboard (its first row), in this order; then suppress count and retry cost.
SEED_KPIS = [
    "Side-effect duplicate rate",
    "Failure rate",
    "Mean processing time",
    "p95 phase-transition latency",
    "Recovery rate after first failure",
    "Suppressed duplicates",
    "Retry-caused cost",
]
#: PromQL words that look like names but are not metrics.
_METRIC = re.compile(r"\bkeel_[a-z0-9_]+\b")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_MATCHER = re.compile(r"\{([^}]*)\}")


@pytest.fixture
def promtool(request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]) -> str | None:
    """promtool's path; None (said in the test output, past pytest's capture) outside CI when it is missing."""
    found = shutil.which("promtool")
    if found is None and os.environ.get("CI") == "true":
        pytest.fail("promtool is missing (Debian's prometheus package; .ci/run installs it): CI must run it")
    if found is None:
        with capsys.disabled():
            print(
                f"\n{request.node.name}: promtool not found: checked the YAML only, not with promtool"
                " (install Debian's prometheus package for the full check)"
            )
    return found


def run(tool: str, *args: str) -> str:
    done = subprocess.run([tool, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def rules() -> list[dict[str, Any]]:
    data = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    return [rule for group in data["groups"] for rule in group["rules"]]


def test_promtool_accepts_the_rules_and_the_config(promtool: str | None) -> None:
    tool = promtool
    if tool is not None:
        assert "SUCCESS: 9 rules found" in run(tool, "check", "rules", "alerts.yml")
        run(tool, "check", "config", "prometheus.yml")  # also checks the rule files it loads
        return
    names = [rule["alert"] for rule in rules()]
    assert len(names) == len(set(names)) == 9
    for rule in rules():
        assert rule["expr"].strip() and rule["labels"]["severity"] in ("critical", "warning")
        assert rule["annotations"]["runbook"].startswith("docs/runbook.md#")
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert all((PROMETHEUS / name).exists() for name in config["rule_files"])


def test_the_rules_fire_and_resolve_on_recorded_series(promtool: str | None) -> None:
    """alerts_test.yml: duplicates, dead letters, a lost beat leader and queue lag fire, then resolve (while an API
    and a beat export the same domain values)."""
    tool = promtool
    if tool is not None:
        assert "SUCCESS" in run(tool, "test", "rules", "alerts_test.yml")
        return
    tested = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())
    alerts = {case["alertname"] for test in tested["tests"] for case in test["alert_rule_test"]}
    assert {"KeelSideEffectDuplicates", "KeelDeadLetters"} <= alerts <= {rule["alert"] for rule in rules()}


def test_every_alert_has_a_runbook_section() -> None:
    runbook = (ROOT / "docs" / "runbook.md").read_text()
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in runbook.splitlines()
        if line.startswith("#")
    }
    for rule in rules():
        anchor = rule["annotations"]["runbook"].split("#", 1)[1]
        assert anchor == rule["alert"].lower() and anchor in anchors, f"docs/runbook.md has no section {anchor}"


class Contract:
    """Every domain and alert metric, as the contract names them (their collectors are the KPI and alerts helpers')."""

    def collect(self) -> Iterator[Metric]:
        for metric in (*DOMAIN, *ALERTS):
            family = GaugeMetricFamily(metric.family, metric.help or metric.name, labels=metric.labels)
            family.type = metric.type
            for sample in sorted(metric.samples()):
                labels = dict.fromkeys(metric.labels, "x")
                family.add_sample(sample, {**labels, **({"le": "+Inf"} if sample.endswith("_bucket") else {})}, 0)
            yield family


@pytest.fixture
def exported() -> Iterator[dict[str, set[str]]]:
    """Series name -> its label names, as scraped: the process-local histograms from a real observer that saw one
    unit of work of each kind, the domain and alert series as the contract names them."""
    observer = MetricsObserver()
    obs.register(observer)
    try:
        one_of_each_kind()
    finally:
        obs.unregister(observer)
    registry = CollectorRegistry()
    registry.register(observer)
    registry.register(Contract())
    found: dict[str, set[str]] = {}
    for family in registry.collect():
        for sample in family.samples:
            found.setdefault(sample.name, set()).update(sample.labels)
    assert {f"{m.name}_bucket" for m in PROCESS_LOCAL.values()} <= sample_names(registry)
    yield found


def queries() -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every query in the dashboard and the rules (and the series the rule tests feed in)."""
    for rule in rules():
        yield f"alerts.yml {rule['alert']}", rule["expr"]
    tested = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())
    for test in tested["tests"]:
        for series in test["input_series"]:
            yield "alerts_test.yml", series["series"]
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            yield f"keel.json {panel['title']!r}", target["expr"]


def test_every_metric_the_dashboard_and_the_rules_query_is_exported_with_its_labels(
    exported: dict[str, set[str]],
) -> None:
    checked = 0
    for where, query in queries():
        names = set(_METRIC.findall(query))
        assert names, f"{where}: queries no Keel metric: {query}"
        unknown = names - set(exported)
        assert not unknown, f"{where}: {sorted(unknown)} not exported (known: agents/observability/names.py)"
        labels = set().union(*(exported[name] for name in names)) | {"le", "job", "instance"}
        used = {label.strip() for group in _GROUPING.findall(query) for label in group.split(",") if label.strip()}
        used |= {m.split("=")[0].rstrip("!~").strip() for group in _MATCHER.findall(query) for m in group.split(",")}
        assert used <= labels, f"{where}: groups or matches by {sorted(used - labels)}, which {sorted(names)} lack"
        checked += 1
    assert checked > 40


def test_the_dashboard_shows_the_seed_kpis_first_and_every_exported_metric() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert panels[0]["type"] == "row"
    first_row = [p["title"] for p in panels[1 : panels.index(next(p for p in panels[1:] if p["type"] == "row"))]]
    assert first_row[: len(SEED_KPIS)] == SEED_KPIS
    shown: set[str] = set()
    for panel in panels:
        for target in panel.get("targets", []):
            shown |= set(_METRIC.findall(target["expr"]))
    for metric in ALL:
        assert metric.samples() & shown, f"the dashboard never shows {metric.name}"
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert [r.split(" ")[0] for r in rows[1:]] == ["Queue", "Outbox", "Errors", "Spend", "Processes"]
    # Its data source is the one compose's Grafana provisions.
    provisioned = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = provisioned["datasources"]
    assert dashboard["templating"]["list"][0]["current"]["value"] == source["uid"]
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels if p["type"] != "row")


def test_a_collector_is_held_to_the_contract() -> None:
    """How the KPI helper's DomainCollector is checked: names, types, labels and help as in
    agents/observability/names.py."""
    assert contract_problems(Contract()) == []

    class Drifted:
        def collect(self) -> Iterator[Metric]:
            yield GaugeMetricFamily("keel_outbox_backlog", "Backlog", value=3)  # its help and channel label drifted
            yield GaugeMetricFamily("keel_backlog_total", "", value=1)

    assert contract_problems(Drifted()) == [
        "keel_outbox_backlog: help 'Backlog', the contract says 'Outbox messages pending or sending'",
        "keel_outbox_backlog: labels [], the contract says ['channel']",
        "keel_backlog_total: not in the contract",
    ]


# --- aggregation: max collapses the exporters only -------------------------------------------------------------------

_MAX = re.compile(r"\bmax\s*(?:by\s*\(([^)]*)\)\s*)?\(")
_SELECTOR = re.compile(r"\b(keel_[a-z0-9_]+)\b(?:\{([^}]*)\})?")
_SAMPLES = {sample: metric for metric in ALL for sample in metric.samples()}


def _closing(query: str, opening: int) -> int:
    depth = 0
    for i in range(opening, len(query)):
        depth += {"(": 1, ")": -1}.get(query[i], 0)
        if depth == 0:
            return i
    raise AssertionError(f"unbalanced parentheses: {query}")


def aggregation_problems(query: str) -> list[str]:
    """What a ``max`` in ``query`` collapses beyond the exporters: a domain series is exported once per API process and
    beat with the same value, so ``max`` may drop only what tells them apart (job, instance) and must keep every label
    of the metric (or fix it with a matcher) — anything more is a sum to take afterwards, not a max. A process-local
    series is each process's own: never a max."""
    problems = []
    for found in _MAX.finditer(query):
        kept = {label.strip() for label in (found[1] or "").split(",") if label.strip()}
        start = found.end() - 1
        inside = query[start + 1 : _closing(query, start)]
        for nested in list(_MAX.finditer(inside))[::-1]:  # a max inside is checked on its own
            inside = inside[: nested.start()] + inside[_closing(inside, nested.end() - 1) + 1 :]
        for name, matchers in _SELECTOR.findall(inside):
            metric: MetricName | None = _SAMPLES.get(name)
            if metric is None:
                continue
            if metric in PROCESS_LOCAL.values():
                problems.append(f"max over {name}, a process-local series: take the sum")
                continue
            fixed = {m.split("=")[0].strip() for m in matchers.split(",") if re.search(r"[^!=~]=[^~]", m + " ")}
            must_keep = set(metric.labels) | ({"le"} if name.endswith("_bucket") else set())
            lost = must_keep - fixed - kept
            if lost:
                problems.append(f"max by ({', '.join(sorted(kept))}) over {name} collapses {sorted(lost)}")
    return problems


def test_a_max_collapses_only_the_exporters_never_a_label_of_the_metric() -> None:
    """Every API process and beat exports the domain series with the same values: ``max`` takes one of them. A
    ``max by (status)`` over ``keel_jobs_finished_total{operation,status}`` would also take one operation's rate for
    all of them; it must be ``sum by (status) (max by (operation, status) (...))``."""
    found = [f"{where}: {problem}" for where, query in queries() for problem in aggregation_problems(query)]
    assert found == []
    # The check itself catches what it is for.
    assert aggregation_problems("max by (status) (rate(keel_jobs_finished_total[5m]))") == [
        "max by (status) over keel_jobs_finished_total collapses ['operation']"
    ]
    assert aggregation_problems('max(increase(keel_requests_finished_total{outcome="failed"}[1h]))') == []
    assert aggregation_problems("sum(max by (channel) (keel_dead_letters))") == []
    assert aggregation_problems("max(rate(keel_job_run_seconds_count[5m]))") == [
        "max over keel_job_run_seconds_count, a process-local series: take the sum"
    ]


def panel_query(title: str) -> str:
    """The dashboard's query of panel ``title`` (its first), with Grafana's range variables as 5m and 1h."""
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        if panel["title"] == title:
            expr: str = panel["targets"][0]["expr"]
            return expr.replace("$__rate_interval", "5m").replace("$__range", "1h")
    raise AssertionError(f"the dashboard has no panel {title!r}")


def test_dashboard_queries_count_each_exporter_once_and_every_label_value(promtool: str | None, tmp_path: Path) -> None:
    """Two exporters (an API and a beat) with the same values, two operations: jobs finished by status adds the
    operations and counts the exporters once; the duplicate rate is deliveries per key - 1 (ARCHITECTURE.md)."""
    if promtool is None:
        return  # the aggregation check above still ran
    exporters = ('job="api",instance="api:8000"', 'job="beat",instance="beat-1:9809"')
    series = [
        f'keel_jobs_finished_total{{{who},operation="{op}",status="succeeded"}}'
        for who in exporters
        for op in ("plan", "tool")
    ]
    # Two keys confirmed a minute, one of them twice: 3 confirmations, 1 duplicate, a rate of 1 / 2.
    series_values = {name: "0+60x90" for name in series}
    for who in exporters:
        series_values[f'keel_side_effect_confirmations_total{{{who},channel="slack"}}'] = "0+3x90"
        series_values[f'keel_side_effect_duplicates_total{{{who},channel="slack"}}'] = "0+1x90"
    (tmp_path / "none.yml").write_text("groups: []\n")
    test = {
        "rule_files": ["none.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": name, "values": values} for name, values in series_values.items()],
                "promql_expr_test": [
                    {
                        "expr": panel_query("Jobs finished by status"),
                        "eval_time": "80m",
                        "exp_samples": [{"labels": '{status="succeeded"}', "value": 2}],
                    },
                    {
                        "expr": panel_query("Side-effect duplicate rate"),
                        "eval_time": "80m",
                        "exp_samples": [{"labels": "{}", "value": 0.5}],
                    },
                ],
            }
        ],
    }
    (tmp_path / "dashboard_test.yml").write_text(yaml.safe_dump(test))
    done = subprocess.run(
        [promtool, "test", "rules", "dashboard_test.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"


# --- thresholds: the rules and Keel's own alerts say the same -----------------------------------------------------

#: Each Prometheus rule's comparisons, and the setting whose default each must equal.
RULE_THRESHOLDS: dict[str, dict[str, str]] = {
    "KeelSideEffectDuplicates": {">": "alert_side_effect_duplicates_max"},
    "KeelDeadLetters": {">": "alert_dead_letters_max"},
    "KeelTransitionLatencyHigh": {">": "alert_transition_p95_max_seconds"},
    "KeelRecoveryRateLow": {"<": "alert_recovery_rate_min", ">=": "alert_recovery_min_failures"},
    "KeelRetryCostShareHigh": {">": "alert_retry_cost_share_max"},
    "KeelQueueLag": {">": "alert_oldest_due_job_max_seconds"},
    "KeelNoBeatLeader": {">": "alert_beat_leader_gap_max_seconds"},
    "KeelAuditVerifyStale": {">": "alert_audit_verify_stale_max_seconds"},
}
#: Rules Keel's own alerts have no setting for.
RULES_WITHOUT_A_SETTING = {"KeelKpisUnavailable"}
_COMPARISON = re.compile(r"(>=|<=|==|!=|>|<)\s*(-?[0-9]+(?:\.[0-9]+)?)")


def test_the_rules_thresholds_are_the_settings_defaults() -> None:
    """deploy/prometheus/alerts.yml and KEEL_ALERT_* (models/settings.py) alert at the same bounds by default."""
    by_alert = {rule["alert"]: rule for rule in rules()}
    assert set(by_alert) == set(RULE_THRESHOLDS) | RULES_WITHOUT_A_SETTING, "a new rule: say which setting it mirrors"
    for alert, settings in RULE_THRESHOLDS.items():
        found = {op: float(number) for op, number in _COMPARISON.findall(by_alert[alert]["expr"])}
        expected = {op: float(Settings.model_fields[name].default) for op, name in settings.items()}
        assert found == expected, f"{alert}: alerts.yml compares {found}, the settings' defaults are {expected}"
