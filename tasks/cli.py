"""`keel worker`, `keel beat` and `keel flower`: the Celery side of the CLI (plugged in through entry points)."""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import signal
import sys
import time
from types import FrameType
from typing import Any

import click

from agents.cli.common import settings_or_exit as _settings
from agents.core.queues import JOBS_QUEUE, LOW_QUEUE
from agents.core.redaction import install_log_redaction, register_settings
from models.settings import BadConfiguration, Settings

ALL_QUEUES = ",".join([JOBS_QUEUE, LOW_QUEUE, "keel.outbox"])


def _redact_logs(settings: Settings) -> None:
    """Mask the configured secrets and credential shapes in every line this process logs (Celery sets up its
    handlers later, in the worker or beat; each one gets the filter as it is made)."""
    from celery.signals import after_setup_logger, after_setup_task_logger

    register_settings(settings)
    after_setup_logger.connect(_filter_handlers, weak=False)
    after_setup_task_logger.connect(_filter_handlers, weak=False)


def _structured_logs(settings: Settings, role: str) -> None:
    """Keel's log lines (JSON or readable, with the job's context) on the handlers Celery sets up."""
    from tasks.logs import structured_logs

    structured_logs(role, None if settings.log_format is None else settings.log_format == "json")


def _json_from_the_start(settings: Settings, role: str) -> list[str]:
    """With JSON lines (``KEEL_LOG_FORMAT``, or stderr not a terminal), keep everything Celery writes JSON: warnings
    go to a Keel handler until Celery sets up its own, and the banner stays off. Returns Celery's global options."""
    from agents.observability.logs import choose_json, configure_logging

    if not choose_json(settings.log_format):
        return []
    configure_logging(role, json=True)
    logging.captureWarnings(True)
    return ["--quiet"]


def _filter_handlers(logger: logging.Logger | None = None, **_: Any) -> None:
    install_log_redaction([logging.getLogger(), multiprocessing.util.get_logger(), *([logger] if logger else [])])


def _metrics_port_or_exit(settings: Settings, port: int, variable: str) -> None:
    """Refuse to start, in one line, when this process's metrics port is taken (0: no exporter, nothing to check)."""
    from models.embedded import port_is_free

    if port and not port_is_free(port, settings.metrics_host):
        raise click.ClickException(
            f"{variable}={port}: the port is taken on {settings.metrics_host}; give every API, worker and beat on"
            " this host its own port, or 0 for no metrics exporter"
        )


def _embedded_or_exit(settings: Settings, *, database: bool = True) -> None:
    """Refuse to start, in one line, when a server is left to the embedded default and ``keel[embedded]`` is not
    installed (Celery would meet it later, with a traceback)."""
    from models.embedded import EmbeddedServersMissing, require_installed

    try:
        require_installed(settings, database=database)
    except EmbeddedServersMissing as exc:
        raise click.ClickException(str(exc)) from None


def _schema_or_exit(settings: Settings) -> None:
    """Refuse to start, in one line, on a database whose schema is not this code's, and in production as a role that
    could rewrite the journal (models/roles.py) or on a route where the statement timeout would not hold
    (models/db.py ``check_route``). An unreachable database is waited for here in production only."""
    import sqlalchemy

    from models.db import Database, check_route
    from models.migrations import SchemaMismatch, check_schema
    from models.roles import PrivilegedRole, refuse_privileged

    db = Database.from_settings(settings)
    said = False
    pause = 1.0
    try:
        while True:
            try:
                check_schema(db.engine)
                refuse_privileged(db.engine, settings)
                check_route(db, production=settings.environment == "production")
                return
            except (SchemaMismatch, PrivilegedRole, BadConfiguration) as exc:
                raise click.ClickException(str(exc)) from None
            except sqlalchemy.exc.OperationalError as exc:
                if settings.environment != "production":
                    return
                if not said:
                    reason = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else type(exc).__name__
                    click.echo(
                        f"keel: database unreachable ({reason}); waiting for it: in production the database role is"
                        " checked before anything starts",
                        err=True,
                    )
                    said = True
                time.sleep(pause)
                pause = min(pause * 2, 30.0)
    finally:
        db.dispose()


@click.command()
@click.option(
    "-c",
    "--concurrency",
    type=click.IntRange(min=1),
    help="Jobs in flight: threads, or prefork processes (default KEEL_WORKER_CONCURRENCY: 200 threads, a process per"
    " CPU).",
)
@click.option("-Q", "--queues", default=ALL_QUEUES, show_default=True, help="Queues to consume, comma-separated.")
@click.option("-n", "--name", default="keel@%h", show_default=True, help="Node name (unique per host).")
@click.option("-l", "--loglevel", default="info", show_default=True)
@click.option(
    "-P",
    "--pool",
    type=click.Choice(["threads", "prefork", "solo"]),
    help="threads (one process, steps that wait), prefork (a process per job, CPU-heavy handlers) or solo (default"
    " KEEL_WORKER_POOL: threads).",
)
def worker(concurrency: int | None, queues: str, name: str, loglevel: str, pool: str | None) -> None:
    """Run a Celery worker that executes Keel jobs."""
    # The options stand for their variables: the job runner of this process reads the pool it runs in from them.
    given = {"worker_pool": pool, "worker_concurrency": concurrency}
    settings = _settings(imports=True, **{field: value for field, value in given.items() if value is not None})
    os.environ["KEEL_WORKER_POOL"] = settings.worker_pool
    _embedded_or_exit(settings)
    _schema_or_exit(settings)
    _metrics_port_or_exit(settings, settings.worker_metrics_port, "KEEL_WORKER_METRICS_PORT")
    _redact_logs(settings)
    _structured_logs(settings, "worker")
    quiet = _json_from_the_start(settings, "worker")
    from tasks.app import app, worker_exit_code

    slots = str(settings.worker_slots)
    # Gossip (worker-to-worker events) is not needed: revokes travel as broadcasts, Flower reads task events. And
    # Celery's gossip step logs a traceback at every lost broker connection (it cleans up a connection it closed).
    without = ["--without-mingle", "--without-gossip"]
    events = ["-E"] if settings.worker_task_events else []  # else Flower turns them on while it runs
    argv = ["worker", "-c", slots, "-Q", queues, "-n", name, "-l", loglevel, "-P", settings.worker_pool]
    app.start([*quiet, *argv, *events, *without])
    sys.exit(worker_exit_code())  # Celery's own status, which Celery.start drops


@click.command()
@click.option("-l", "--loglevel", default="info", show_default=True)
def beat(loglevel: str) -> None:
    """Run beat: the dispatcher (due jobs, expired leases, schedules) and the periodic tasks. Run one or more;
    a lease row in PostgreSQL (renewed every tick, fenced by its term) makes one of them the leader."""
    settings = _settings()
    _embedded_or_exit(settings)
    _schema_or_exit(settings)
    _metrics_port_or_exit(settings, settings.beat_metrics_port, "KEEL_BEAT_METRICS_PORT")
    _redact_logs(settings)
    _structured_logs(settings, "beat")
    quiet = _json_from_the_start(settings, "beat")
    from tasks.app import app

    app.start([*quiet, "beat", "-S", "tasks.dispatcher:KeelScheduler", "-l", loglevel])


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--port", default=5555, show_default=True, type=click.IntRange(1, 65535))
@click.argument("flower_args", nargs=-1, type=click.UNPROCESSED)
def flower(port: int, flower_args: tuple[str, ...]) -> None:
    """Run Flower on the Keel broker (extra arguments go to Flower, e.g. --basic-auth=user:pass)."""
    settings = _settings()
    _embedded_or_exit(settings, database=False)
    _redact_logs(settings)
    logging.getLogger("flower.inspector").addFilter(_NoWorkerAnsweredYet(time.monotonic()))
    from tasks.app import app

    app.start(["flower", f"--port={port}", *flower_args])


#: What Flower logs when no worker answers one of its inspect calls within --inspect_timeout (a broker failure
#: is another message, with the error, and stays).
_NO_REPLY = "Inspect method %s failed"


#: How long after Flower starts an unanswered question is taken for workers not up yet, not for workers gone.
_START_SECONDS = 30.0


class _NoWorkerAnsweredYet(logging.Filter):
    """Flower asks the workers about themselves as it starts and calls each unanswered question a failure: a warning
    per question whenever it starts before any worker (as in compose, where nothing orders the two). Nothing failed
    then; later, the same warning (every worker dead or hung) is kept."""

    def __init__(self, started: float) -> None:
        super().__init__()
        self.started = started

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != _NO_REPLY or time.monotonic() - self.started > _START_SECONDS


def _stopped(sig: int, frame: FrameType | None) -> None:
    sys.exit(0)


@click.command()
@click.option("--host", help="Address to listen on (default KEEL_API_HOST, 127.0.0.1).")
@click.option("--port", type=click.IntRange(1, 65535), help="Port (default KEEL_API_PORT, 8000).")
@click.option("--workers", type=click.IntRange(1, 64), help="Processes (default KEEL_API_WORKERS, 1).")
@click.option("-l", "--loglevel", default="info", show_default=True)
def serve(host: str | None, port: int | None, workers: int | None, loglevel: str) -> None:
    """Run the HTTP API (docs at /docs, OpenAPI at /openapi.json) under uvicorn."""
    # The options go through the settings' checks like the variables they stand for (several processes need a shared
    # session key; the metrics port is not the API's).
    given = {"api_host": host, "api_port": port, "api_workers": workers}
    settings = _settings(imports=True, **{name: value for name, value in given.items() if value is not None})
    _schema_or_exit(settings)
    _metrics_port_or_exit(settings, settings.api_metrics_port, "KEEL_API_METRICS_PORT")
    register_settings(settings)
    import uvicorn

    from agents.observability.logs import choose_json
    from agents.observability.metrics import multiprocess_dir, prepare_multiprocess
    from models.embedded import broker_url_for, database_url_for
    from tasks.api import log_config
    from tasks.metrics import serve_api_metrics

    # Start the embedded servers (if they are the default) once, here, rather than in every worker process.
    database_url_for(settings)
    broker_url_for(settings)
    processes = settings.api_workers
    if processes > 1 or multiprocess_dir() is not None:
        # This process's exporter (and each worker's token-guarded /metrics) answers for all of them: they share one
        # multiprocess directory.
        prepare_multiprocess("api")
    serve_api_metrics(settings)
    # uvicorn handles SIGTERM itself (a graceful shutdown), then raises it again once it has stopped: a stop that was
    # asked for and went well ends with status 0, not as killed by the signal.
    signal.signal(signal.SIGTERM, _stopped)
    uvicorn.run(
        "tasks.api:create",
        factory=True,
        host=settings.api_host,
        port=settings.api_port,
        workers=processes,
        # Keel's lines and uvicorn's (access lines too) with timestamps, every one redacted, in each worker process.
        log_config=log_config(loglevel, json=choose_json(settings.log_format)),
        log_level=loglevel,
        # X-Forwarded-For / -Proto only from the proxies KEEL_API_FORWARDED_ALLOW_IPS names (none by default): the
        # client address the console's sign-in limit counts by must not be whatever a client claims.
        proxy_headers=bool(settings.api_forwarded_allow_ips),
        forwarded_allow_ips=settings.api_forwarded_allow_ips or None,
        server_header=False,
        # Live event streams end as the shutdown begins (the app's lifespan sees the signal; clients resume with
        # Last-Event-ID); requests in flight get this long to finish.
        timeout_graceful_shutdown=settings.api_shutdown_seconds,
    )
