"""What every ``keel`` command shares: the settings check, the client, one-line errors, output and options.

Imports of what a command needs happen inside the command, so ``keel --help`` stays fast.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from functools import wraps
from typing import Any, ParamSpec, TypeVar

import click
from pydantic import BaseModel

from agents.core.errors import KeelError
from agents.core.redaction import register_settings

P = ParamSpec("P")
R = TypeVar("R")


def settings_or_exit(*, imports: bool = False) -> Any:
    """The settings, or one line ``bad configuration: KEEL_X: rule`` and exit 1. ``imports``: also import
    ``KEEL_IMPORTS`` now (commands that start a worker)."""
    from models.settings import BadConfiguration, check_imports, load_settings

    try:
        settings = load_settings()
        if imports:
            check_imports(settings)
    except BadConfiguration as exc:
        raise click.ClickException(str(exc)) from None
    register_settings(settings)
    return settings


def open_client() -> Any:
    """A :class:`~agents.client.Client` on the checked settings (use it as a context manager), once the database's
    schema is known to be this code's (else one line: where the database is, where the code is, what to run)."""
    from agents.client import Client
    from models.migrations import check_schema

    client = Client.from_settings(settings_or_exit())
    try:
        check_schema(client.db.engine)
    except BaseException:
        client.close()
        raise
    return client


def friendly(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn Keel's errors into one line on stderr and exit status 1."""

    @wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        from agents.core.transition import store_errors

        try:
            with store_errors():
                return fn(*args, **kwargs)
        except KeelError as exc:
            raise click.ClickException(str(exc)) from None
        except (FileNotFoundError, RuntimeError) as exc:  # alembic's CommandError, embedded server failures
            raise click.ClickException(f"{type(exc).__name__}: {exc}") from None

    return wrapper


def emit(value: BaseModel | Sequence[BaseModel] | dict[str, Any], as_json: bool, text: str) -> None:
    """Print ``value`` as JSON with ``--json``, else ``text``."""
    if as_json:
        if isinstance(value, BaseModel):
            data: Any = value.model_dump(mode="json")
        elif isinstance(value, dict):
            data = value
        else:
            data = [v.model_dump(mode="json") for v in value]
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        click.echo(text)


def plain(row: dict[str, Any]) -> dict[str, Any]:
    """A row with every value JSON can not hold as it is (times, decimals, ids) as text."""
    return {
        k: (v if isinstance(v, int | float | str | bool | dict | list | type(None)) else str(v)) for k, v in row.items()
    }


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
actor_option = click.option("--actor", default="cli", show_default=True, help="Who is doing this (journaled).")
