"""compose.yaml stays consistent with the code and safe to run: every command it runs exists, every setting it sets is
real, no password is written in it, every long-running service is health-checked and stopped gracefully, and its
variables come from the committed .env.example (a missing FLOWER_BASIC_AUTH stops only Flower).

There is no Docker engine here: the file is parsed, interpolated as compose does (``${VAR}``, ``${VAR:-default}``,
``${VAR:?error}``, ``$$``), and the health checks and Flower's guard are run as commands on this machine."""

from __future__ import annotations

import http.server
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from dotenv import dotenv_values

from agents.cli import cli
from models.settings import Settings
from tasks.leadership import BEAT

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
#: Services that run until stopped (everything but the one-shot migrate).
LONG_RUNNING = {"postgres", "redis", "api", "worker", "relay", "beat", "flower", "prometheus", "grafana"}
#: The `observability` profile's services; every other service runs without a profile.
OBSERVABILITY = {"prometheus", "grafana"}
#: What a filled-in .env adds to .env.example: the secrets it leaves empty.
SECRETS = {
    "POSTGRES_PASSWORD": "s3cret-for-tests",
    "KEEL_DB_APP_PASSWORD": "app-s3cret-for-tests",
    "FLOWER_BASIC_AUTH": "admin:s3cret-for-tests",
    "GRAFANA_ADMIN_PASSWORD": "s3cret-for-tests",
    "KEEL_AUDIT_KEYS": '{"compose-1": "s3cret-for-tests-s3cret-for-tests-s3cret"}',
}

_VARIABLE = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<name>\w+)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}|(?P<bare>\w+))")


class Unset(Exception):
    """A ``${VAR:?message}`` whose variable is unset or empty: compose stops with the message."""


def _interpolate(value: Any, env: dict[str, str]) -> Any:
    """``value`` (parsed YAML) with its variables replaced as compose replaces them."""
    if isinstance(value, dict):
        return {key: _interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [_interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def replace(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["name"] or match["bare"]
        op, arg = match["op"], match["arg"] or ""
        current = env.get(name)
        missing = current is None or (op is not None and op.startswith(":") and current == "")
        if op in ("-", ":-"):
            return arg if missing else str(current)
        if op in ("?", ":?"):
            if missing:
                raise Unset(f"{name}: {arg}")
            return str(current)
        if op in ("+", ":+"):
            return "" if missing else arg
        return current or ""

    return _VARIABLE.sub(replace, value)


def _variables(value: Any) -> set[str]:
    """The names of the variables ``value`` (parsed YAML) refers to (``$$NAME`` is not one: it reaches the shell)."""
    if isinstance(value, dict):
        return set().union(*(_variables(item) for item in value.values()), set())
    if isinstance(value, list):
        return set().union(*(_variables(item) for item in value), set())
    if not isinstance(value, str):
        return set()
    return {m["name"] or m["bare"] for m in _VARIABLE.finditer(value) if not m["escaped"]}


def _raw() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "compose.yaml").read_text())
    assert isinstance(data, dict)
    return data


def _example() -> dict[str, str]:
    return {k: v or "" for k, v in dotenv_values(ROOT / ".env.example").items()}


def _compose(**env: str) -> dict[str, Any]:
    """compose.yaml as `docker compose` sees it with .env copied from .env.example and its secrets filled in."""
    data = _interpolate(_raw(), {**_example(), **SECRETS, **env})
    assert isinstance(data, dict)
    return data


def _command(service: dict[str, Any], key: str = "command") -> list[str]:
    command = service.get(key, [])
    return command.split() if isinstance(command, str) else list(command)


def _serve() -> click.Command | None:
    return cli.get_command(click.Context(cli), "serve")


def test_compose_has_the_stack_with_health_checks() -> None:
    services = _compose()["services"]
    assert {"postgres", "redis", "migrate", "api", "worker", "relay", "beat", "flower"} <= set(services)
    assert "keel.outbox" in _command(services["relay"])
    for name in ("api", "worker", "relay", "beat"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert _command(services["flower"])[:2] == ["keel", "flower"]
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert _command(services["migrate"]) == ["keel", "db", "upgrade"], "the installed package migrates, not alembic"
    assert _command(services["roles"]) == ["keel", "db", "roles"]
    assert services["roles"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["migrate"]["depends_on"]["roles"]["condition"] == "service_completed_successfully"
    assert services["beat"]["deploy"]["replicas"] == 2


def test_every_keel_service_command_exists() -> None:
    """(The api's `keel serve` is checked, options and all, by the test after this one.)"""
    for name, service in _compose()["services"].items():
        if "build" not in service or name == "api":
            continue
        argv = _command(service)
        assert argv, f"service {name} runs no command"
        for program in (argv[0], *_command(service, "entrypoint")[:1]):
            assert (BIN / program).exists() or shutil.which(program), f"{name}: {program} is not installed"
        if argv[0] == "keel":
            ctx = click.Context(cli)
            group: click.Command = cli
            for word in argv[1:]:
                if word.startswith("-"):
                    break
                assert isinstance(group, click.Group), f"{name}: {' '.join(argv)} goes past a leaf command"
                sub = group.get_command(ctx, word)
                assert sub is not None, f"{name}: `keel` has no subcommand {word!r}"
                group = sub
    assert (ROOT / "Dockerfile").exists()


def test_the_api_service_runs_keel_serve_on_the_port_it_publishes() -> None:
    api = _compose()["services"]["api"]
    argv = _command(api)
    assert argv[:2] == ["keel", "serve"]
    serve = _serve()
    assert serve is not None, "`keel` has no subcommand 'serve'"
    options = {opt for param in serve.params for opt in getattr(param, "opts", [])}
    given = {word for word in argv[2:] if word.startswith("-")}
    assert given <= options, f"keel serve has no option {sorted(given - options)}"
    assert argv[argv.index("--host") + 1] == "0.0.0.0", "inside a container it must listen beyond loopback"
    port = argv[argv.index("--port") + 1]
    assert api["ports"] == [f"8000:{port}"]


def test_the_api_is_published_and_checked_on_readyz() -> None:
    api = _compose()["services"]["api"]
    assert _command(api)[:2] == ["keel", "serve"]
    assert _compose(KEEL_API_PORT="18000")["services"]["api"]["ports"] == ["18000:8000"]
    assert api["ports"] == ["8000:8000"], "KEEL_API_PORT defaults to 8000"
    check = " ".join(api["healthcheck"]["test"])
    assert "http://127.0.0.1:8000/readyz" in check


class _Ready(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path in ("/readyz", "/healthcheck") else 404)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def ready_server() -> Iterator[tuple[int, type[_Ready]]]:
    handler = type("Handler", (_Ready,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], handler
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("service", "port"), [("api", 8000), ("flower", 5555)])
def test_http_health_checks_pass_on_200_and_fail_otherwise(
    ready_server: tuple[int, type[_Ready]], service: str, port: int
) -> None:
    """The checks run in the image, which has Python but no curl: run them here against a server that answers 200,
    then 503 (not ready: the database is behind, the broker is away)."""
    listening, handler = ready_server
    test = _compose()["services"][service]["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "python", "a python check (the image has no curl)"
    argv = [sys.executable, *[part.replace(f"127.0.0.1:{port}/", f"127.0.0.1:{listening}/") for part in test[2:]]]
    assert subprocess.run(argv, capture_output=True, timeout=30).returncode == 0
    handler.status = 503
    assert subprocess.run(argv, capture_output=True, timeout=30).returncode != 0


def test_every_long_running_service_has_a_health_check_and_a_stop_grace_period() -> None:
    services = _compose()["services"]
    assert {name for name, s in services.items() if s.get("restart") != "no"} == LONG_RUNNING
    for name in LONG_RUNNING:
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no health check"
        assert re.fullmatch(r"\d+s", services[name].get("stop_grace_period", "")), f"{name}: no stop_grace_period"


def test_worker_health_checks_ping_the_worker_they_belong_to() -> None:
    """`celery inspect ping -d NAME` must name the node its own `keel worker --name` starts (%h: the hostname)."""
    for name in ("worker", "relay"):
        service = _compose()["services"][name]
        argv = _command(service)
        node = argv[argv.index("--name") + 1]
        check = service["healthcheck"]["test"]
        assert check[0] == "CMD-SHELL"
        assert check[1].startswith("celery -A tasks.app inspect ping ")
        assert check[1].endswith(f"-d {node.replace('%h', '$HOSTNAME')}"), check[1]


def test_the_beat_health_check_asks_for_the_leader_lease_beat_takes() -> None:
    check = _compose()["services"]["beat"]["healthcheck"]["test"]
    assert check[:3] == ["CMD", "python", "-c"]
    assert f"FROM beat_leadership WHERE name = '{BEAT}'" in check[3]
    assert "lease_until > clock_timestamp()" in check[3]


def test_no_password_is_written_in_compose() -> None:
    raw = _raw()
    text = (ROOT / "compose.yaml").read_text()
    for password in re.findall(r"://[^:/@\s]+:([^@\s]+)@", text):
        assert password.startswith(("${POSTGRES_PASSWORD", "${KEEL_DB_APP_PASSWORD")), (
            f"a password is written: {password}"
        )
    for name, service in raw["services"].items():
        environment = service.get("environment", {})
        if isinstance(environment, dict):
            for key, value in environment.items():
                if re.search("PASSWORD|SECRET|TOKEN|AUTH", key) and isinstance(value, str):
                    assert value.startswith("${"), f"{name}: {key} is written in compose.yaml, not taken from .env"
    # The example leaves the secrets empty: nobody runs on a password that is in the repository.
    example = _example()
    assert example["POSTGRES_PASSWORD"] == "" and example["FLOWER_BASIC_AUTH"] == ""
    assert example["GRAFANA_ADMIN_PASSWORD"] == "" and example["KEEL_AUDIT_KEYS"] == ""
    assert example["KEEL_DB_APP_PASSWORD"] == "" and example["KEEL_DB_AUDITOR_PASSWORD"] == ""
    assert SECRETS["KEEL_DB_APP_PASSWORD"] in _compose()["x-keel-env"]["KEEL_DATABASE_URL"]
    assert SECRETS["POSTGRES_PASSWORD"] in _compose()["x-keel-migrate-env"]["KEEL_MIGRATION_DATABASE_URL"]
    assert _compose()["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"] == SECRETS["POSTGRES_PASSWORD"]


def test_compose_takes_its_variables_from_env_example() -> None:
    example = _example()
    assert _variables(_raw()) <= set(example), f"not in .env.example: {sorted(_variables(_raw()) - set(example))}"
    _compose()  # .env.example with the secrets filled in interpolates cleanly
    with pytest.raises(Unset, match=r"^(\w+_PASSWORD): set \1 in \.env \(cp \.env\.example \.env\)"):
        _interpolate(_raw(), example)  # the example as committed: compose refuses, naming what to set
    assert ".env" in (ROOT / ".gitignore").read_text().split(), ".env holds the secrets: git must ignore it"


def test_a_missing_flower_basic_auth_stops_only_flower() -> None:
    """Every compose command still works without it (no `${FLOWER_BASIC_AUTH:?}` interpolation); only Flower's own
    entrypoint refuses, with a line that says what to set."""
    services = _compose(FLOWER_BASIC_AUTH="")["services"]
    for name, service in _raw()["services"].items():
        if name != "flower":
            assert "FLOWER_BASIC_AUTH" not in _variables(service), f"{name} depends on FLOWER_BASIC_AUTH"
        if name != "grafana":
            assert "GRAFANA_ADMIN_PASSWORD" not in _variables(service), f"{name} depends on GRAFANA_ADMIN_PASSWORD"
    flower = services["flower"]
    entrypoint = _command(flower, "entrypoint")
    refused = subprocess.run(
        [*entrypoint, "true"], env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=30
    )
    assert refused.returncode == 1
    assert refused.stderr == (
        "flower: set FLOWER_BASIC_AUTH=user:password in .env (see .env.example); not starting without it\n"
    )
    started = subprocess.run(
        [*entrypoint, "echo", *_command(flower)],
        env={"PATH": "/usr/bin:/bin", "FLOWER_BASIC_AUTH": SECRETS["FLOWER_BASIC_AUTH"]},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert started.returncode == 0, started.stderr
    assert started.stdout == "keel flower --port 5555\n"
    assert flower["environment"]["FLOWER_BASIC_AUTH"] == ""


def test_every_keel_variable_in_compose_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KEEL_AUDIT_KEYS", "KEEL_AUDIT_KEY_ID"):  # the test suite's own key ring stays out of this one
        monkeypatch.delenv(name)
    fields = {f"KEEL_{name.upper()}" for name in Settings.model_fields}
    compose = _compose()
    for name, service in compose["services"].items():
        for variable in service.get("environment", {}) or {}:
            if variable.startswith("KEEL_") and variable != "<<":
                assert variable in fields, f"{name}: {variable} is not a Keel setting"
    env = {k[5:].lower(): v for k, v in compose["x-keel-env"].items() if v != ""}
    env["imports"] = yaml.safe_load(env["imports"])
    env["audit_keys"] = yaml.safe_load(env["audit_keys"])
    production = Settings(**env)
    assert production.environment == "production"
    assert production.database_url is not None and production.database_url.startswith("postgresql+psycopg://")
    assert production.broker_url == "redis://redis:6379/0"
    assert production.current_audit_key_id == "compose-1"


def _port_of(service: dict[str, Any], name: str, variables: dict[str, str]) -> int:
    """The port ``service`` serves /metrics on: its KEEL_*_METRICS_PORT, which is never the API's own port."""
    variable = {
        "serve": "KEEL_API_METRICS_PORT",
        "beat": "KEEL_BEAT_METRICS_PORT",
        "worker": "KEEL_WORKER_METRICS_PORT",
    }
    port = int(variables[variable[_command(service)[1]]])
    if name == "api":
        argv = _command(service)
        assert port != int(argv[argv.index("--port") + 1]), "the API's metrics are not on its published port"
        assert all(not published.endswith(f":{port}") for published in service["ports"])
    return port


def test_the_observability_profile_runs_prometheus_and_grafana_on_files_that_exist() -> None:
    services = _compose()["services"]
    for name, service in services.items():
        assert service.get("profiles", []) == (["observability"] if name in OBSERVABILITY else []), name
    for name in OBSERVABILITY:
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which does not exist"
        assert all(port.startswith("127.0.0.1:") for port in services[name]["ports"]), "published on loopback only"
    prometheus = services["prometheus"]
    mounts = dict(v.split(":")[:2] for v in prometheus["volumes"] if v.startswith("./"))
    config_path = next(arg.split("=", 1)[1] for arg in prometheus["command"] if arg.startswith("--config.file="))
    config_source = next(src for src, dst in mounts.items() if dst == config_path)
    config = yaml.safe_load((ROOT / config_source).read_text())
    for rule_file in config["rule_files"]:  # resolved next to the config, in the container as here
        inside = str(Path(config_path).parent / rule_file)
        assert inside in mounts.values(), f"{rule_file} is not mounted next to the config"
        assert Path(next(src for src, dst in mounts.items() if dst == inside)).name == rule_file
    # Grafana loads the dashboard from where its provisioning says, and the data source the dashboard names.
    grafana = services["grafana"]
    mounted = dict(v.split(":")[:2] for v in grafana["volumes"] if v.startswith("./"))
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/keel.yml").read_text())
    folder = provider["providers"][0]["options"]["path"]
    assert mounted["./deploy/grafana/keel.json"] == f"{folder}/keel.json"
    assert mounted["./deploy/grafana/provisioning/datasources"] == "/etc/grafana/provisioning/datasources"
    assert mounted["./deploy/grafana/provisioning/dashboards"] == "/etc/grafana/provisioning/dashboards"


def test_prometheus_scrapes_every_keel_process_where_it_serves_metrics() -> None:
    compose = _compose()
    services = compose["services"]
    variables = compose["x-keel-env"]
    assert variables["KEEL_METRICS_HOST"] == "0.0.0.0", "inside a container the exporters listen beyond loopback"
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    scraped = {}
    for job in config["scrape_configs"]:
        (sd,) = job["dns_sd_configs"]
        (name,) = sd["names"]
        assert job["job_name"] == name and sd["type"] == "A"
        scraped[name] = sd["port"]
    assert set(scraped) == {"api", "worker", "relay", "beat"}, "every API, worker, relay and beat is scraped"
    for name, port in scraped.items():
        service = services[name]
        shared = {k: v for k, v in service["environment"].items() if k not in SHIPPING}  # the beat ships too
        assert shared == variables, f"{name} runs with the shared settings"
        assert _port_of(service, name, variables) == port, f"{name} serves metrics on another port than {port}"
        assert service["expose"] == [str(port)], f"{name} does not expose {port}"


def test_grafana_refuses_to_start_without_its_admin_password() -> None:
    grafana = _compose(GRAFANA_ADMIN_PASSWORD="")["services"]["grafana"]
    entrypoint = _command(grafana, "entrypoint")
    refused = subprocess.run(
        [*entrypoint, "true"], env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=30
    )
    assert refused.returncode == 1
    assert refused.stderr == "grafana: set GRAFANA_ADMIN_PASSWORD in .env (see .env.example); not starting without it\n"
    started = subprocess.run(
        [*entrypoint, "echo", *_command(grafana)],
        env={"PATH": "/usr/bin:/bin", "GF_SECURITY_ADMIN_PASSWORD": SECRETS["GRAFANA_ADMIN_PASSWORD"]},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert started.returncode == 0 and started.stdout == "/run.sh\n", started.stderr


def test_keel_runs_as_the_application_role_and_only_migrations_as_the_superuser() -> None:
    """The superuser `keel` (POSTGRES_USER) is in the one-shot roles and migrate services' KEEL_MIGRATION_DATABASE_URL
    only; every long-running Keel process logs in as the default application role, in production (where it refuses
    to run as anything more privileged), and the roles it names are Keel's defaults."""
    compose = _compose()
    services = compose["services"]
    defaults = Settings(_env_file=None)  # type: ignore[call-arg]
    superuser = services["postgres"]["environment"]["POSTGRES_USER"]
    for name, service in services.items():
        if "build" not in service:
            continue
        environment = service["environment"]
        assert environment["KEEL_ENVIRONMENT"] == "production", name
        assert environment["KEEL_DATABASE_URL"].startswith(f"postgresql://{defaults.db_app_role}:"), name
        if name in ("roles", "migrate"):
            assert environment["KEEL_MIGRATION_DATABASE_URL"].startswith(f"postgresql://{superuser}:"), name
            assert environment["KEEL_DB_APP_PASSWORD"] == SECRETS["KEEL_DB_APP_PASSWORD"]
        else:
            assert "KEEL_MIGRATION_DATABASE_URL" not in environment, f"{name} must not hold the superuser's password"
    assert defaults.db_app_password is None, "the password comes from .env, not a default"


#: What only the shipper needs: the store's credentials, its address and the manifests' signing key.
SHIPPING = {
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_DEFAULT_REGION",
    "KEEL_AUDIT_SHIP_URL",
    "KEEL_AUDIT_S3_ENDPOINT_URL",
    "KEEL_AUDIT_OBJECT_LOCK_DAYS",
    "KEEL_AUDIT_SIGNING_KEY",
}


def test_only_the_beat_holds_the_stores_credentials_and_every_appender_the_audit_keys() -> None:
    """The beat ships (and is where `keel audit ship` runs): a leaked API, worker, relay or Flower environment gives
    no way to write to (or, without Object Lock, delete from) the separate store. Every process that appends to the
    journal links with the audit key ring, and so holds it."""
    services = _compose(AWS_ACCESS_KEY_ID="AKIA-for-tests", AWS_SECRET_ACCESS_KEY="aws-s3cret-for-tests")["services"]
    holding = {name for name, service in services.items() if SHIPPING & set(service.get("environment") or {})}
    assert holding == {"beat"}
    beat = services["beat"]["environment"]
    assert beat["AWS_SECRET_ACCESS_KEY"] == "aws-s3cret-for-tests"
    for name in ("api", "worker", "relay", "beat", "migrate"):
        assert services[name]["environment"]["KEEL_AUDIT_KEYS"] == SECRETS["KEEL_AUDIT_KEYS"], name
