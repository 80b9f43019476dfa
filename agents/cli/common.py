"""What every ``keel`` command shares: the settings check, the client, one-line errors, output and options. Commands
import what they need inside themselves, so ``keel --help`` stays fast."""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Callable, Sequence
from datetime import date, datetime, timedelta
from decimal import Decimal
from enum import Enum
from functools import wraps
from typing import Any, ParamSpec, TypeVar
from uuid import UUID

import click
from pydantic import BaseModel

from agents.core.errors import InvalidInput, KeelError
from agents.core.json_input import parse_json
from agents.core.redaction import register_settings
from agents.observability.otlp import CLI, traces_endpoint
from models.clock import rfc3339

P = ParamSpec("P")
R = TypeVar("R")


def settings_or_exit(*, imports: bool = False, **overrides: Any) -> Any:
    """The settings, or one line ``bad configuration: KEEL_X: rule`` and exit 1. ``imports``: also import
    ``KEEL_IMPORTS`` now (commands that start a worker). ``overrides``: what the command's options say instead of
    the environment (checked by the same rules)."""
    from models.settings import BadConfiguration, check_imports, load_settings

    try:
        settings = load_settings(**overrides)
        if imports:
            check_imports(settings)
    except BadConfiguration as exc:
        raise click.ClickException(str(exc)) from None
    register_settings(settings)
    return settings


def open_client(*, writes: bool = True) -> Any:
    """A :class:`~agents.client.Client` (a context manager) on the checked settings, once the schema is known to be
    this code's. A command that ``writes`` is refused in production as a role that could rewrite the journal
    (models/roles.py); a read may run as any role."""
    from agents.client import Client, submit_publisher
    from models.db import Database
    from models.migrations import SchemaMismatch, check_schema
    from models.roles import refuse_privileged

    settings = settings_or_exit()
    trace_command(settings)
    database = Database.from_settings(settings, pool_size=settings.db_pool_size_cli)
    client = Client(database, settings, publisher=submit_publisher(settings) if writes else None)
    try:
        try:
            check_schema(client.db.engine)
        except SchemaMismatch as exc:
            if settings.database_url is None and "has no Keel schema" in str(exc):
                # Most often a command run outside the directory where `keel up` runs: another ./.keel/, empty.
                raise SchemaMismatch(
                    f"the embedded database under {settings.home} has no Keel schema: run keel in the directory"
                    " where your stack runs (`keel up`, `keel dev start`: its .keel/), set KEEL_HOME to that"
                    " directory's .keel, or run 'keel db upgrade' to start a new, empty one here"
                ) from None
            raise
        if writes:
            refuse_privileged(client.db.engine, settings)
    except BaseException:
        client.close()
        raise
    return client


def trace_command(settings: Any) -> None:
    """Trace this command's transitions (``service.name`` ``keel-cli``, exported at exit) when an OTLP endpoint is
    configured; without one OpenTelemetry is not even imported."""
    if traces_endpoint(settings) is None:
        return
    from agents.observability.tracing import configure_tracing, installed

    if installed() is None:
        configure_tracing(settings, CLI)


def friendly(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn Keel's errors into one line on stderr and exit status 1."""

    @wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        from agents.core.transition import store_errors

        try:
            with store_errors():
                return fn(*args, **kwargs)
        except KeelError as exc:
            said = str(exc)
            more = exc.errors[1:] if isinstance(exc, InvalidInput) else []
            suffix = f" (and {len(more)} more)"
            if more and said.endswith(suffix):  # every problem, not a count: the telling one may be among them
                said = said.removesuffix(suffix) + "".join(f"; {p['path']}: {p['message']}" for p in more)
            raise click.ClickException(said) from None
        except (FileNotFoundError, RuntimeError) as exc:  # alembic's CommandError, embedded server failures
            raise click.ClickException(f"{type(exc).__name__}: {exc}") from None

    return wrapper


def json_value(option: str, text: str) -> Any:
    """The JSON an option (``--input``, ``--arguments``, ``--script``) was given, by the one rule every door uses
    (:func:`~agents.core.json_input.parse_json`); anything else is a usage error naming the option and the rule."""
    try:
        return parse_json(option, text)
    except InvalidInput as exc:
        raise click.BadParameter(str(exc).removeprefix(f"{option}: "), param_hint=option) from None


# One output format for every command (docs/how-to/command-line.md#output, docs/explanation/clients.md#output).


def timestamp(at: datetime) -> str:
    """``at`` in the one format every ``keel`` output uses: RFC 3339, UTC, microseconds, ``Z``."""
    return rfc3339(at)  # the journal's and the error texts' format too: one implementation


def decimal_text(value: Decimal) -> str:
    """An exact decimal without trailing zeros or exponent: ``Decimal("0.002000")`` -> ``0.002``."""
    text = format(value.normalize(), "f")
    return "0" if text in ("-0", "") else text


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON data in Keel's output format: times RFC 3339, decimals and ids as strings."""
    if isinstance(value, BaseModel):
        return jsonable(value.model_dump())
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v) for v in value]
    if isinstance(value, datetime):
        return timestamp(value)
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return decimal_text(value)
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, Enum):
        return jsonable(value.value)
    if isinstance(value, UUID):
        return str(value)
    return value


def to_json(value: Any, *, indent: int | None = 2) -> str:
    return json.dumps(jsonable(value), indent=indent, ensure_ascii=False, allow_nan=False)


def text_value(value: Any, *, none: str = "-") -> str:
    """One value as text mode prints it: payloads as compact JSON, times and decimals in the one format, booleans as
    JSON spells them; ``none`` for no value."""
    if value is None:
        return none
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict | list | tuple):
        return json.dumps(jsonable(value), ensure_ascii=False, separators=(", ", ": "))
    if isinstance(value, float):
        return f"{value:.6g}"
    result = jsonable(value)
    return result if isinstance(result, str) else str(result)


def count(value: int) -> str:
    """A count for people, with thousands separators: ``1641`` -> ``1,641``."""
    return f"{value:,}"


def percent(rate: float) -> str:
    """A rate in [0, 1] as a percentage with one decimal: ``0.6667`` -> ``66.7%``."""
    return f"{rate * 100:.1f}%"


def seconds(value: float) -> str:
    """A duration for people: ``0.0421`` -> ``42 ms``, ``2.7197275`` -> ``2.72 s``."""
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:,.2f} s"


def rounded(value: float | None) -> float | None:
    """A measured float for ``--json``: seconds to the microsecond, rates to the millionth, without float noise
    (``0.4759479999999999`` -> ``0.475948``)."""
    return None if value is None else round(float(value), 6)


def command_line(*words: str) -> str:
    """A command a person can paste into a shell: ``keel wait ops-bot F1``, quoting what needs it."""
    return shlex.join(words)


def emit(value: Any, as_json: bool, text: str) -> None:
    """Print ``value`` as one JSON object with ``--json``, else ``text``."""
    if as_json:
        assert not isinstance(value, list | tuple), "--json prints one object: wrap a list in a named field"
        click.echo(to_json(value))
    else:
        click.echo(text)


def fields_text(row: dict[str, Any], skip: Sequence[str] = ()) -> str:
    """A row as ``name  value`` lines, values as :func:`text_value` prints them (no value: ``null``, as in JSON)."""
    width = max((len(k) for k in row), default=0) + 1
    return "\n".join(f"{k:<{width}} {text_value(v, none='null')}" for k, v in row.items() if k not in skip)


#: The longest ``--timeout`` a wait takes: 30 days (no ``--timeout`` waits for as long as it takes).
MAX_WAIT_SECONDS = 30 * 24 * 3600


class Seconds(click.FloatRange):
    """A positive number of seconds up to ``max``; ``nan``, which passes any range check, is refused too."""

    name = "seconds"

    def __init__(self, max: float) -> None:
        super().__init__(min=0, min_open=True, max=max)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        result = super().convert(value, param, ctx)
        if math.isnan(result):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        return result


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
actor_option = click.option("--actor", default="cli", show_default=True, help="Who is doing this (journaled).")
