"""``keel demo`` and ``keel up``: the main job, and the whole stack (worker, beat, Flower) run here until stopped."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from agents.cli.common import friendly, settings_or_exit

if TYPE_CHECKING:
    from agents.cli.supervisor import Child
    from models.settings import Settings

#: Where ``keel up`` serves the API's, the worker's and the beat's /metrics unless told otherwise.
WORKER_METRICS_PORT = 9808
BEAT_METRICS_PORT = 9809
API_METRICS_PORT = 9810
MIGRATE_HELP = (
    "Migrate a configured database (KEEL_DATABASE_URL) that is behind this code. Without it such a database is"
    " refused; the embedded one is always migrated."
)


@click.command("demo")
@click.option("--migrate", is_flag=True, help=MIGRATE_HELP)
@friendly
def demo(migrate: bool) -> None:
    """The main job: scripted agents with a worker killed midway; exits 0 only if nothing ran twice.

    On the embedded servers it migrates the database first (one line says so, nothing when it is at this code's
    revision already). A configured database (KEEL_DATABASE_URL) must be at this code's revision: run
    'keel db upgrade', or pass --migrate."""
    from agents.demo.run import run_demo

    sys.exit(run_demo(settings_or_exit(), migrate=migrate))


@click.command("up")
@click.option("--api-port", type=click.IntRange(1, 65535), help="The HTTP API's port (default KEEL_API_PORT, 8000).")
@click.option("--no-api", is_flag=True, help="Do not run the HTTP API.")
@click.option("--flower-port", default=5555, show_default=True, type=click.IntRange(1, 65535))
@click.option("--no-flower", is_flag=True, help="Do not run Flower.")
@click.option(
    "--api-metrics-port",
    type=click.IntRange(1, 65535),
    help=f"The API's /metrics port (default KEEL_API_METRICS_PORT, else {API_METRICS_PORT}).",
)
@click.option(
    "--worker-metrics-port",
    type=click.IntRange(1, 65535),
    help=f"The worker's /metrics port (default KEEL_WORKER_METRICS_PORT, else {WORKER_METRICS_PORT}).",
)
@click.option(
    "--beat-metrics-port",
    type=click.IntRange(1, 65535),
    help=f"The beat's /metrics port (default KEEL_BEAT_METRICS_PORT, else {BEAT_METRICS_PORT}).",
)
@click.option("--no-metrics", is_flag=True, help="Serve no /metrics (the API's, the worker's and the beat's).")
@click.option(
    "--concurrency",
    type=click.IntRange(1, 5000),
    help="Jobs in flight in the worker (default KEEL_WORKER_CONCURRENCY: 200 threads).",
)
@click.option("--migrate", is_flag=True, help=MIGRATE_HELP)
@click.option(
    "--give-up-after",
    default=60,
    show_default=True,
    type=click.IntRange(1, 30 * 86400),
    metavar="SECONDS",
    help="Stop everything when PostgreSQL or Redis has not answered for this long.",
)
@click.option(
    "--stop-timeout",
    default=20,
    show_default=True,
    type=click.IntRange(0, 3600),
    metavar="SECONDS",
    help="How long to wait for the processes to stop before killing them.",
)
@friendly
def up(
    api_port: int | None,
    no_api: bool,
    flower_port: int,
    no_flower: bool,
    api_metrics_port: int | None,
    worker_metrics_port: int | None,
    beat_metrics_port: int | None,
    no_metrics: bool,
    concurrency: int | None,
    migrate: bool,
    give_up_after: int,
    stop_timeout: int,
) -> None:
    """Run the whole stack here — worker, beat, the HTTP API (keel serve) and Flower — on the configured or
    embedded servers. It says they are running once the API answers /readyz and Flower its port, and where the API,
    the worker and the beat serve their Prometheus metrics.

    The embedded database is migrated first; a configured one (KEEL_DATABASE_URL) not at this code's revision is
    refused, as `keel worker` refuses it: run 'keel db upgrade', or pass --migrate.

    Ctrl-C, SIGTERM, SIGHUP and SIGQUIT stop everything (SIGQUIT is Celery's cold shutdown: 10 s for running jobs
    first); a second signal kills at once. It says when PostgreSQL or Redis stops answering and when it is back, and
    stops everything with exit status 1 when one stays unreachable for --give-up-after seconds."""
    import functools
    import os
    import signal

    from agents.cli.supervisor import (
        Child,
        ServerHealth,
        ServerWatch,
        StartFailed,
        Supervisor,
        api_ready,
        local_url,
        say,
    )
    from agents.outbox.credentials import missing_senders
    from models import migrations
    from models.embedded import broker_url_for, database_url_for, migration_url_for, port_is_free
    from models.roles import RoleNames

    settings = settings_or_exit(imports=True)
    api_port = api_port or settings.api_port
    api_url = local_url(settings.api_host, api_port)
    # (An IPv6 address is left to uvicorn: port_is_free tries IPv4; a lost race is one line too, see _port_taken.)
    if not no_api and ":" not in settings.api_host and not port_is_free(api_port, settings.api_host or "127.0.0.1"):
        raise click.ClickException(_PORT_TAKEN.format(port=api_port, option="--api-port", without="--no-api"))
    if not no_flower and not port_is_free(flower_port):
        raise click.ClickException(_PORT_TAKEN.format(port=flower_port, option="--flower-port", without="--no-flower"))
    env = dict(os.environ)
    wanted = {"worker": worker_metrics_port, "beat": beat_metrics_port}
    if not no_api:
        wanted = {"api": api_metrics_port, **wanted}
    exporters = {} if no_metrics else _metrics_ports(settings, wanted, taken=set() if no_api else {api_port})
    env["KEEL_API_METRICS_PORT"] = str(exporters.get("api", 0))
    env["KEEL_WORKER_METRICS_PORT"] = str(exporters.get("worker", 0))
    env["KEEL_BEAT_METRICS_PORT"] = str(exporters.get("beat", 0))
    env["KEEL_DATABASE_URL"] = database_url = database_url_for(settings)
    env["KEEL_BROKER_URL"] = broker_url = broker_url_for(settings)
    if settings.otlp_endpoint:  # from .env too: every process exports its spans to the same collector
        env["KEEL_OTLP_ENDPOINT"] = settings.otlp_endpoint
    # The children write to a pipe, not a terminal: readable lines for the person watching, unless asked otherwise.
    env["KEEL_LOG_FORMAT"] = settings.log_format or "console"
    embedded = settings.database_url is None
    migrated = migrations.prepare(
        migration_url_for(settings), migrate=migrate or embedded, roles=RoleNames.of(settings)
    )
    if migrated is not None:
        say(migrated)
    keel = [sys.executable, "-m", "agents"]
    worker_args = ["-c", str(concurrency)] if concurrency is not None else []  # else KEEL_WORKER_CONCURRENCY's
    children = [
        Child("worker", [*keel, "worker", *worker_args], ready_line=lambda line: " ready." in line, replaceable=True),
        Child("beat", [*keel, "beat"], ready_line=lambda line: "beat: Starting" in line),
    ]
    if not no_api:
        # SIGQUIT is Celery's cold shutdown; uvicorn's own stop (bounded: keel serve) is SIGTERM.
        api_args = ["serve", "--host", settings.api_host, "--port", str(api_port)]
        probe = functools.partial(api_ready, api_url)
        children.append(Child("api", [*keel, *api_args], ready_line=None, probe=probe, quit_as=signal.SIGTERM))
    if not no_flower:
        flower_args = ["flower", "--port", str(flower_port), "--address=127.0.0.1"]
        # After the worker is ready: Flower asks the workers about themselves once as it starts, and one still
        # starting would leave it with an empty list (and a warning per question nobody answered).
        answers = functools.partial(_answers, flower_port)
        children.append(Child("flower", [*keel, *flower_args], ready_line=None, probe=answers, after="worker"))
    names = ", ".join(child.name for child in children)
    supervisor = Supervisor(children, env, stop_timeout=stop_timeout)
    servers = [
        (ServerHealth("PostgreSQL", database_url, give_up_after), lambda: _postgres_problem(database_url)),
        (ServerHealth("Redis", broker_url, give_up_after), lambda: _redis_problem(broker_url)),
    ]
    failure: str | None = None
    culprit: Child | None = None  # the child whose exit stopped the stack
    with supervisor.signals_handled():
        try:
            supervisor.start()
            if supervisor.wait_ready(timeout=120):
                urls = [] if no_api else [f"API: {api_url}, docs at {api_url}/docs"]
                urls += [] if no_flower else [f"Flower: http://127.0.0.1:{flower_port}"]
                shown = f" ({'; '.join(urls)})" if urls else ""
                say(f"keel up: {names} running{shown}; Ctrl-C stops them")
                host = settings.metrics_host
                scraped = [f"{local_url(host, port)}/metrics ({name})" for name, port in exporters.items()]
                if scraped:
                    say(f"keel up: metrics at {', '.join(scraped)}")
                for warning in missing_senders(settings):
                    say(f"keel up: {warning}")
                with ServerWatch(servers, every=1.0, wake=supervisor.wake) as watch:
                    while supervisor.received is None:
                        if (culprit := supervisor.first_exited()) is not None:
                            if supervisor.replaced(culprit):
                                continue
                            failure = f"{culprit.why_exited()}; stopped the rest"
                            break
                        if (down := watch.given_up) is not None:
                            failure = (
                                f"{down.name} at {down.where} has not answered for {give_up_after}s "
                                f"(--give-up-after); stopped {names}"
                            )
                            break
                        supervisor.wake.wait(0.5)
        except StartFailed as exc:
            failure, culprit = f"{exc}; stopped the rest", exc.exited
        finally:
            if supervisor.received is not None:
                say(f"keel up: {supervisor.received.name} received; stopping {names}")
            supervisor.stop()
    if failure is not None:
        raise click.ClickException(_port_taken(culprit, api_port, flower_port) or failure)
    say("keel up: stopped")


_PORT_TAKEN = "port {port} is taken by another process: pick another with {option}, or use {without}"


def _metrics_ports(settings: Settings, given: dict[str, int | None], *, taken: set[int]) -> dict[str, int]:
    """The metrics ports of the processes named in ``given`` (api, worker, beat: the port an option gave, or None);
    one that is taken (or in ``taken``) is left out, with a line saying so (metrics are not worth refusing to start
    the stack for)."""
    from agents.cli.supervisor import say
    from models.embedded import port_is_free

    defaults = {
        "api": settings.api_metrics_port or API_METRICS_PORT,
        "worker": settings.worker_metrics_port or WORKER_METRICS_PORT,
        "beat": settings.beat_metrics_port or BEAT_METRICS_PORT,
    }
    ports: dict[str, int] = {}
    for name, port_given in given.items():
        port, option = port_given or defaults[name], f"--{name}-metrics-port"
        if port in taken or port in ports.values() or not port_is_free(port, settings.metrics_host):
            say(f"keel up: port {port} is taken: the {name} serves no metrics (pick another with {option})")
        else:
            ports[name] = port
    return ports


def _answers(port: int) -> bool:
    """Whether Flower answers its health check on 127.0.0.1:``port`` (it has bound the port: not another server
    that took it since ``keel up`` found it free)."""
    import httpx

    try:
        answer = httpx.get(f"http://127.0.0.1:{port}/healthcheck", timeout=2)
    except httpx.HTTPError:
        return False
    return answer.status_code == 200 and answer.text == "OK"


def _postgres_problem(url: str) -> str | None:
    import psycopg

    from models.urls import libpq_url

    try:
        with psycopg.connect(libpq_url(url), connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return None


def _redis_problem(url: str) -> str | None:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
    try:
        client.ping()
    except redis.RedisError as exc:
        return str(exc) or type(exc).__name__
    finally:
        client.close()
    return None


def _port_taken(exited: Child | None, api_port: int, flower_port: int) -> str | None:
    """If the API or Flower exited because it lost the race for its port (taken after our check), the line that
    says so, instead of quoting its last line (uvicorn's is about its shutdown, after the error)."""
    if exited is None or not any("address already in use" in line.lower() for line in exited.last_lines):
        return None
    if exited.name == "api":
        return _PORT_TAKEN.format(port=api_port, option="--api-port", without="--no-api")
    if exited.name == "flower":
        return _PORT_TAKEN.format(port=flower_port, option="--flower-port", without="--no-flower")
    return None


COMMANDS = (demo, up)
