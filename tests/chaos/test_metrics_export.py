"""/metrics from real processes: `keel serve --workers 2` exports both of its processes' numbers on its metrics port;
a prefork worker with two children exports both children's job runs in one scrape; a beat serves its own."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agents.client import Client
from models.db import Database
from tests.chaos.conftest import Stack, free_port, wait_until
from tests.support.api import running_api
from tests.support.broker import Broker
from tests.support.keys import scoped

pytestmark = pytest.mark.chaos


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every series at ``url`` (on a new connection each time): (name, labels) -> value."""
    answer = httpx.get(url, timeout=30, headers={"Connection": "close"})
    assert answer.status_code == 200, answer.text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(answer.text)
        for sample in family.samples
    }


def value(series: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return series.get((name, frozenset(labels.items())), 0.0)


def pids_with_histograms(directory: Path) -> set[str]:
    return {path.stem.rsplit("_", 1)[1] for path in directory.glob("histogram_*.db")}


def test_an_api_with_two_processes_answers_for_both(db: Database, db_url: str, broker: Broker, tmp_path: Path) -> None:
    """`keel serve` makes the processes' shared directory itself (under TMPDIR), serves their sum on
    KEEL_API_METRICS_PORT, and removes the directory when it stops."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    port = free_port()
    env = {"TMPDIR": str(temp), "KEEL_API_METRICS_PORT": str(port), "KEEL_CONSOLE_SESSION_KEY": "s" * 32}
    with running_api(db, db_url, broker, tmp_path, env=env, args=["--workers", "2"]) as api:
        (shared,) = temp.glob("keel-api-metrics-*")
        sent = 0

        def both_processes_answered() -> bool:
            nonlocal sent
            assert httpx.get(f"{api.url}/healthz", headers={"Connection": "close"}, timeout=30).status_code == 200
            sent += 1
            return len(pids_with_histograms(shared)) >= 2

        wait_until("requests answered by both API processes", both_processes_answered, 60, every=0.05)
        for _ in range(3):
            series = scrape(f"http://127.0.0.1:{port}/metrics")
            healthz = {"method": "GET", "route": "/healthz", "status": "200"}
            assert value(series, "keel_http_request_seconds_count", **healthz) == sent
            assert value(series, "keel_http_request_seconds_bucket", le="+Inf", **healthz) == sent
    assert not shared.exists(), "keel serve left its metrics directory behind"


def test_a_prefork_worker_exports_both_childrens_job_runs_in_one_scrape(stack: Stack, client: Client) -> None:
    worker_port, beat_port = free_port(), free_port()
    stack.worker("w1", concurrency=2, KEEL_WORKER_METRICS_PORT=str(worker_port), KEEL_WORKER_POOL="prefork")
    stack.beat(KEEL_BEAT_METRICS_PORT=str(beat_port))
    keys = []
    for i in range(2):
        agent = client.create_agent(f"metered-{i}")
        client.submit(agent.name, f"req-{i}", None, operation="block")
        keys.append(scoped(agent.id, f"req-{i}:block:1"))
    # Both jobs running at once: each in its own child of the pool.
    started = "SELECT count(DISTINCT pid) FROM executions WHERE phase = 'start'"
    wait_until("both jobs running in two processes", lambda: stack.query(started) == [(2,)], 60)
    for key in keys:
        stack.release(key)
    succeeded = "SELECT count(*) FROM jobs WHERE status = 'succeeded'"
    wait_until("both jobs to succeed", lambda: stack.query(succeeded) == [(2,)], 60)
    worker = f"http://127.0.0.1:{worker_port}/metrics"
    # The outcome is recorded before the run's observation ends: poll for it.
    block = {"operation": "block", "outcome": "succeeded"}
    wait_until("both runs in the scrape", lambda: value(scrape(worker), "keel_job_run_seconds_count", **block) == 2, 30)
    series = scrape(worker)
    assert value(series, "keel_transition_latency_seconds_count", event="finish", outcome="applied") == 2
    assert "process_cpu_seconds_total" not in {name for name, _ in series}, "a pool's sum, not one process's figures"
    beat = scrape(f"http://127.0.0.1:{beat_port}/metrics")
    assert value(beat, "process_cpu_seconds_total") > 0, "the beat serves its own process's metrics"
