"""compose.yaml stays consistent with the code: every command it runs exists, every setting it sets is real."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import click
import yaml

from agents.cli import cli
from models.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _compose() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "compose.yaml").read_text())
    assert isinstance(data, dict)
    return data


def _command(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return command.split() if isinstance(command, str) else list(command)


def test_compose_has_the_stack_with_health_checks() -> None:
    services = _compose()["services"]
    assert {"postgres", "redis", "migrate", "worker", "relay", "beat", "flower"} <= set(services)
    assert "keel.outbox" in _command(services["relay"])
    for name in ("worker", "beat"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert _command(services["flower"])[:2] == ["keel", "flower"]
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert _command(services["migrate"]) == ["alembic", "upgrade", "head"]


def test_every_keel_service_command_exists() -> None:
    for name, service in _compose()["services"].items():
        if "build" not in service:
            continue
        argv = _command(service)
        assert argv, f"service {name} runs no command"
        program = argv[0]
        assert (BIN / program).exists() or shutil.which(program), f"{name}: {program} is not installed"
        if program == "keel":
            ctx = click.Context(cli)
            group: click.Command = cli
            for word in argv[1:]:
                if word.startswith("-"):
                    break
                assert isinstance(group, click.Group), f"{name}: {' '.join(argv)} goes past a leaf command"
                sub = group.get_command(ctx, word)
                assert sub is not None, f"{name}: `keel` has no subcommand {word!r}"
                group = sub
        if program == "alembic":
            assert (ROOT / "alembic.ini").exists() and (ROOT / "alembic" / "env.py").exists()
    assert (ROOT / "Dockerfile").exists()


def test_every_keel_variable_in_compose_is_a_setting() -> None:
    fields = {f"KEEL_{name.upper()}" for name in Settings.model_fields}
    for name, service in _compose()["services"].items():
        for variable in service.get("environment", {}) or {}:
            if variable.startswith("KEEL_") and variable != "<<":
                assert variable in fields, f"{name}: {variable} is not a Keel setting"
    env = {k[5:].lower(): v for k, v in _compose()["x-keel-env"].items()}
    env["imports"] = yaml.safe_load(env["imports"])
    env = {k: v for k, v in env.items() if not (isinstance(v, str) and v.startswith("${"))}
    production = Settings(**env)
    assert production.environment == "production"
    assert production.database_url is not None and production.database_url.startswith("postgresql+psycopg://")
