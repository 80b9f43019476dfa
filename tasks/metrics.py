"""Prometheus metrics in Keel's processes: the API's, the worker's and the beat's exporters (``keel serve``'s main
process; Celery's start signals), and the collectors of the domain KPIs the API and every beat export. A worker
runs in multiprocess mode, its main process serving every child's numbers on ``KEEL_WORKER_METRICS_PORT``; a beat is
one process (``KEEL_BEAT_METRICS_PORT``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from celery.signals import beat_init, celeryd_init, worker_process_shutdown
from prometheus_client.registry import Collector

from agents.observability.alerts import AlertsCollector, ship_destination
from agents.observability.kpis import DomainCollector
from agents.observability.metrics import Metrics, install_metrics, prepare_multiprocess, process_exited
from models.db import Database
from models.settings import Settings

log = logging.getLogger(__name__)


#: Seconds a scrape's collectors wait for a connection to the database (a partition must not hold a scrape for long:
#: their reads are cut short after agents.observability.scrape.READ_TIMEOUT, their connects after this).
SCRAPE_CONNECT_TIMEOUT_SECONDS = 5


@dataclass(frozen=True, slots=True)
class DomainCollectors:
    """The collectors of the domain KPIs (computed from PostgreSQL) that the API processes and the beats export, and
    the small pool of their own they read on (each collector reads on one connection at a time): :meth:`close` it
    when the process's app stops."""

    db: Database
    collectors: tuple[Collector, ...]

    def close(self) -> None:
        self.db.dispose()


def domain_collectors(settings: Settings) -> DomainCollectors:
    """The domain collectors on a pool of two connections, quick to give up on connecting."""
    db = Database.from_settings(settings, pool_size=2, connect_timeout_seconds=SCRAPE_CONNECT_TIMEOUT_SECONDS)
    return DomainCollectors(db, (DomainCollector(db), AlertsCollector(db, ship_to=ship_destination(settings))))


def serve_metrics(metrics: Metrics, settings: Settings, port: int, variable: str) -> None:
    """Serve ``metrics`` on ``port`` (nothing when 0); a port that is taken is logged, naming ``variable``, and the
    process runs on without an exporter (``keel worker`` and ``keel beat`` refuse to start on a taken port)."""
    if not port:
        return
    try:
        metrics.serve(port, settings.metrics_host)
    except OSError as exc:
        host, reason = settings.metrics_host, exc.strerror or exc
        log.error("metrics not served: %s:%d cannot be bound (%s); set %s", host, port, reason, variable)
        return
    log.info("metrics at http://%s:%d/metrics", settings.metrics_host, port)


def serve_api_metrics(settings: Settings) -> None:
    """In ``keel serve``'s main process, before uvicorn starts: serve ``/metrics`` for every API process it runs (the
    domain KPIs, and their histograms: in memory with one process, summed from the multiprocess directory with
    several) on ``KEEL_API_METRICS_PORT`` (0: not served)."""
    if settings.api_metrics_port:
        metrics = install_metrics("api", collectors=domain_collectors(settings).collectors)
        serve_metrics(metrics, settings, settings.api_metrics_port, "KEEL_API_METRICS_PORT")


@celeryd_init.connect(weak=False)  # type: ignore[untyped-decorator]
def _worker_starts(**_: Any) -> None:
    # In the worker's main process, before its pool starts: the children inherit the directory and the observer.
    settings = Settings()
    prepare_multiprocess("worker")
    serve_metrics(install_metrics("worker"), settings, settings.worker_metrics_port, "KEEL_WORKER_METRICS_PORT")


@worker_process_shutdown.connect(weak=False)  # type: ignore[untyped-decorator]
def _worker_process_exited(pid: int | None = None, **_: Any) -> None:
    # Sent in a pool child as it exits (a child killed outright sends nothing: it had no live-only values either).
    if pid is not None:
        process_exited(pid)


@beat_init.connect(weak=False)  # type: ignore[untyped-decorator]
def _beat_starts(**_: Any) -> None:
    settings = Settings()
    metrics = install_metrics("beat", collectors=domain_collectors(settings).collectors)
    serve_metrics(metrics, settings, settings.beat_metrics_port, "KEEL_BEAT_METRICS_PORT")
