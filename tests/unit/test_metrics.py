"""Process-local metrics: every observed unit of work lands in its histogram under bounded labels; a role's registry
exports what it was given; a family of processes (prefork, uvicorn workers) is one scrape; the API's /metrics."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from agents.core import observe as obs
from agents.core.observe import observe
from agents.observability import metrics as metrics_module
from agents.observability.metrics import (
    LABEL_LIMIT,
    MULTIPROC_ENV,
    OTHER,
    MetricsObserver,
    install_metrics,
    sample_names,
)
from agents.observability.names import PROCESS_LOCAL
from tests.support.metrics import one_of_each_kind

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _observers_restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test's observers (and the process's metrics observer) are gone after it."""
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    before = obs.observers()
    monkeypatch.setattr(metrics_module, "_observer", None)
    yield
    for observer in obs.observers():
        if observer not in before:
            obs.unregister(observer)


def count(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(f"{name}_count", labels) or 0.0


def test_each_kind_of_work_is_recorded_in_its_histogram_under_its_labels() -> None:
    registry = install_metrics("worker").registry
    one_of_each_kind()
    with pytest.raises(KeyError), observe("transition", "approve"):
        raise KeyError("boom")
    assert count(registry, "keel_transition_latency_seconds", event="submit", outcome="applied") == 1
    assert count(registry, "keel_transition_latency_seconds", event="approve", outcome="KeyError") == 1
    assert count(registry, "keel_job_run_seconds", operation="plan", outcome="succeeded") == 1
    assert count(registry, "keel_model_call_seconds", provider="ScriptedProvider", outcome="ok") == 1
    assert count(registry, "keel_tool_call_seconds", tool="github_comment", outcome="timeout") == 1
    assert count(registry, "keel_outbox_send_seconds", channel="slack", outcome="sent") == 1
    labels = {"method": "POST", "route": "/v1/agents/{agent}/requests", "status": "201"}
    assert count(registry, "keel_http_request_seconds", **labels) == 1
    assert {m.name for m in PROCESS_LOCAL.values()} <= {n.removesuffix("_count") for n in sample_names(registry)}


def test_labels_stay_bounded_whatever_the_work_is_called() -> None:
    observer = MetricsObserver()
    obs.register(observer)
    registry = CollectorRegistry()
    registry.register(observer)
    with observe("http", "BREW") as op:  # no such method; no route matched: the path is never a label
        op.add(route="unmatched", status=404)
        op.outcome = "404"
    with observe("http", "GET") as op:
        op.add(route="/v1/agents/{agent} OR 1=1", status="2000")
    assert count(registry, "keel_http_request_seconds", method=OTHER, route=OTHER, status="404") == 1
    assert count(registry, "keel_http_request_seconds", method="GET", route=OTHER, status=OTHER) == 1
    with observe("transition", "made_up_event"):
        pass
    assert count(registry, "keel_transition_latency_seconds", event=OTHER, outcome="ok") == 1
    for i in range(LABEL_LIMIT + 10):
        with observe("tool_call", f"tool_{i}"):
            pass
    tools = {
        s.labels["tool"]
        for family in registry.collect()
        for s in family.samples
        if s.name == "keel_tool_call_seconds_count"
    }
    assert len(tools) == LABEL_LIMIT + 1 and OTHER in tools
    assert count(registry, "keel_tool_call_seconds", tool=OTHER, outcome="ok") == 10


class Stub:
    """Stands for the domain KPIs' collector (the same names, from PostgreSQL)."""

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("keel_kpi_up", "1 if the database answered this scrape", value=1)


def test_a_role_exports_the_collectors_it_is_given() -> None:
    api = install_metrics("api", collectors=[Stub()])
    body, content_type = api.exposition()
    assert "keel_kpi_up 1.0" in body.decode()
    assert content_type.startswith("text/plain")
    body, content_type = api.exposition("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text") and body.decode().endswith("# EOF\n")
    assert "keel_kpi_up" not in install_metrics("worker").exposition()[0].decode()
    with pytest.raises(ValueError, match="unknown metrics role 'relay'; known: api, worker, beat"):
        install_metrics("relay")  # type: ignore[arg-type]


FAMILY = textwrap.dedent(
    """
    import multiprocessing, os, sys
    from agents.core.observe import observe
    from agents.observability.metrics import install_metrics, prepare_multiprocess, process_exited

    def child(n):
        for _ in range(n):
            with observe("job", "plan") as op:
                op.outcome = "succeeded"

    if __name__ == "__main__":
        prepare_multiprocess("worker")
        metrics = install_metrics("worker", collectors=[])
        fork = multiprocessing.get_context("fork")
        procs = [fork.Process(target=child, args=(n,)) for n in (2, 3)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            process_exited(p.pid)
        print(sorted(f.name for f in __import__("pathlib").Path(os.environ["PROMETHEUS_MULTIPROC_DIR"]).iterdir()))
        sys.stdout.write(metrics.exposition()[0].decode())
    """
)


def test_a_family_of_processes_is_one_scrape_and_a_stale_directory_is_wiped(tmp_path: Path) -> None:
    """The worker's prefork children (forked after the parent prepared the directory): the parent's scrape sums both
    children's observations, after they exited too; a directory given with PROMETHEUS_MULTIPROC_DIR starts empty."""
    shared = tmp_path / "metrics"
    shared.mkdir()
    (shared / "histogram_999999.db").write_bytes(b"left by an earlier run")
    env = {**os.environ, MULTIPROC_ENV: str(shared), "PYTHONPATH": str(ROOT)}
    script = tmp_path / "family.py"
    script.write_text(FAMILY)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    files, scrape = done.stdout.split("\n", 1)
    assert "histogram_999999.db" not in files and files.count("histogram_") == 2, files
    assert 'keel_job_run_seconds_count{operation="plan",outcome="succeeded"} 5.0' in scrape
    assert "process_cpu_seconds_total" not in scrape, "one process's own figures are not the family's"


def test_without_a_directory_a_private_one_is_made_and_removed(tmp_path: Path) -> None:
    script = tmp_path / "private.py"
    script.write_text(
        "import os\n"
        "from agents.observability.metrics import prepare_multiprocess\n"
        "print(prepare_multiprocess('api'), os.environ['PROMETHEUS_MULTIPROC_DIR'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != MULTIPROC_ENV}
    done = subprocess.run(
        [sys.executable, str(script)], env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    made, exported = done.stdout.split()
    assert made == exported and "keel-api-metrics-" in made
    assert not Path(made).exists(), "the private directory outlived its process"


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_a_private_directory_left_by_a_killed_parent_is_swept_by_the_next_one(tmp_path: Path) -> None:
    """SIGKILL runs no exit handler: the worker's directory stays behind. The next Keel process that makes one removes
    it (its maker's pid, in its name, is dead)."""
    env = {k: v for k, v in os.environ.items() if k != MULTIPROC_ENV}
    env.update(TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT))
    script = (
        "import sys, time\n"
        "from agents.observability.metrics import prepare_multiprocess\n"
        "print(prepare_multiprocess('worker'), flush=True)\n"
        "time.sleep(600) if sys.argv[1] == 'stay' else None\n"
    )
    killed = subprocess.Popen(
        [sys.executable, "-c", script, "stay"], env=env, stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    assert killed.stdout is not None
    left = Path(killed.stdout.readline().strip())
    killed.kill()
    killed.wait(60)
    killed.stdout.close()
    assert left.is_dir() and left.parent == tmp_path and f"-{killed.pid}-" in left.name
    done = subprocess.run(
        [sys.executable, "-c", script, "go"], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert not left.exists(), "the killed worker's directory outlived the next start"
    assert not Path(done.stdout.strip()).exists()
    assert list(tmp_path.iterdir()) == []


def test_the_sweep_removes_only_keels_own_directories_of_dead_makers(tmp_path: Path) -> None:
    from agents.observability.metrics import sweep_orphaned_dirs

    dead, alive = dead_pid(), os.getpid()
    orphan = tmp_path / f"keel-api-metrics-{dead}-x1y2"
    kept = [
        tmp_path / f"keel-worker-metrics-{alive}-a1b2",  # its maker lives
        tmp_path / f"other-metrics-{dead}-c3d4",  # not Keel's name
        tmp_path / "keel-worker-metrics-e5f6g7",  # no pid in it (an older Keel's): cannot tell
        tmp_path / f"keel-beat-metrics-{dead}",  # not the whole pattern
    ]
    for path in (orphan, *kept):
        path.mkdir()
        (path / "histogram_1.db").write_bytes(b"x")
    target = tmp_path / "target"
    target.mkdir()
    link = tmp_path / f"keel-worker-metrics-{dead}-link"
    link.symlink_to(target)  # a link, even named like one, is not a directory Keel made
    plain = tmp_path / f"keel-worker-metrics-{dead}-file"
    plain.write_text("not a directory")
    others = tmp_path / f"keel-worker-metrics-{dead}-theirs"
    others.mkdir()
    if os.getuid() == 0:  # as root, a directory of another user's can be made: it stays
        os.chown(others, 65534, 65534)
        kept.append(others)
    else:
        others.rmdir()
    assert sweep_orphaned_dirs(tmp_path) == [orphan]
    assert not orphan.exists()
    assert all(path.is_dir() for path in kept) and link.is_symlink() and target.is_dir() and plain.is_file()


class Api:
    """The app ``tasks.api.create`` builds, called in-process (no lifespan: /metrics needs no database or broker)."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    def get(self, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
        async def call() -> httpx.Response:
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://keel") as client:
                return await client.get(path, headers=headers)

        return asyncio.run(call())


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Callable[[], Api]:
    from tasks.api import create

    monkeypatch.setenv("KEEL_DATABASE_URL", "postgresql://keel@127.0.0.1:1/none")
    monkeypatch.setenv("KEEL_BROKER_URL", "redis://127.0.0.1:1/0")
    return lambda: Api(create())


def test_the_api_port_serves_no_metrics_without_a_token_of_their_own(api: Callable[[], Api]) -> None:
    """Every tenant's spend and alerts are in them: by default they are served on a listener of their own
    (``KEEL_API_METRICS_PORT``, loopback), never to whoever reaches the public API."""
    client = api()
    for headers in ({}, {"Authorization": "Bearer keel_" + "x" * 43}):
        refused = client.get("/metrics", headers=headers)
        assert refused.status_code == 404 and "keel_" not in refused.text
    assert "/metrics" not in client.get("/openapi.json").text


def test_a_metrics_token_is_required_once_set_and_never_echoed(
    api: Callable[[], Api], monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "scrape-secret-0123456789"
    monkeypatch.setenv("KEEL_API_METRICS_TOKEN", secret)
    client = api()
    for headers in ({}, {"Authorization": "Bearer wrong-secret-0123456789"}, {"Authorization": f"Basic {secret}"}):
        refused = client.get("/metrics", headers=headers)
        assert refused.status_code == 401
        assert refused.headers["content-type"] == "application/problem+json"
        assert refused.json()["type"] == "/problems/unauthorized"
        assert secret not in refused.text
    allowed = client.get("/metrics", headers={"Authorization": f"Bearer {secret}"})
    assert allowed.status_code == 200 and allowed.headers["content-type"].startswith("text/plain")
    # The refused scrapes were observed requests too, under their route template.
    assert 'keel_http_request_seconds_count{method="GET",route="/metrics",status="401"} 3.0' in allowed.text


def test_a_short_metrics_token_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from models.settings import BadConfiguration, load_settings

    monkeypatch.setenv("KEEL_API_METRICS_TOKEN", "short")
    with pytest.raises(BadConfiguration, match="KEEL_API_METRICS_TOKEN: must be at least 16 characters"):
        load_settings()
