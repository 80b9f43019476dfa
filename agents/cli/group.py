"""The ``keel`` command line. One function per subcommand; bad input exits non-zero with a one-line reason."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Sequence
from decimal import Decimal
from functools import wraps
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import click
from pydantic import BaseModel

from agents.core.errors import KeelError
from agents.core.redaction import install_log_redaction, register_settings

P = ParamSpec("P")
R = TypeVar("R")

DOCS_PHASES = Path("docs/phases.md")


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


def _client() -> Any:
    from agents.client import Client

    return Client.from_settings(settings_or_exit())


def _friendly(fn: Callable[P, R]) -> Callable[P, R]:
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


def _emit(value: BaseModel | Sequence[BaseModel] | dict[str, Any], as_json: bool, text: str) -> None:
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


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
actor_option = click.option("--actor", default="cli", show_default=True, help="Who is doing this (journaled).")


class _Keel(click.Group):
    """Adds the subcommands registered in the ``keel.commands`` entry point group, loaded only when used."""

    def _plugins(self) -> dict[str, Any]:
        from importlib.metadata import entry_points

        return {point.name: point for point in entry_points(group="keel.commands")}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self._plugins()})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is None and cmd_name in (plugins := self._plugins()):
            loaded = plugins[cmd_name].load()
            assert isinstance(loaded, click.Command)
            return loaded
        return command


@click.group(cls=_Keel, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Keel: a control plane for long-running AI agents.

    Configuration comes from KEEL_* environment variables (KEEL_DATABASE_URL, KEEL_BROKER_URL, ...). With none
    set, Keel starts an embedded PostgreSQL and Redis under ./.keel/ (see `keel dev status`).
    """


# --- db --------------------------------------------------------------------------------------------------------


@cli.group()
def db() -> None:
    """Database schema (Alembic migrations)."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True, help="Target migration.")
@_friendly
def db_upgrade(revision: str) -> None:
    """Apply migrations up to REVISION."""
    from models import migrations
    from models.embedded import database_url_for

    url = database_url_for(settings_or_exit())
    migrations.upgrade(url, revision)
    click.echo(f"database at {revision}")


@db.command("downgrade")
@click.argument("revision")
@_friendly
def db_downgrade(revision: str) -> None:
    """Revert migrations down to REVISION ('base' removes everything)."""
    from models import migrations
    from models.embedded import database_url_for

    migrations.downgrade(database_url_for(settings_or_exit()), revision)
    click.echo(f"database at {revision}")


# --- agents ----------------------------------------------------------------------------------------------------


def _state_text(state: Any) -> str:
    budget_tokens = "unlimited" if state.budget_tokens is None else state.budget_tokens
    budget_cost = "unlimited" if state.budget_cost is None else state.budget_cost
    return "\n".join(
        [
            f"agent      {state.name} ({state.id})",
            f"phase      {state.phase}",
            f"revision   {state.revision}",
            f"request    {state.request_id or '-'}",
            f"deadlines  soft {state.soft_deadline or '-'}  hard {state.hard_deadline or '-'}",
            f"tokens     {state.spent_tokens} spent of {budget_tokens}",
            f"cost       {state.spent_cost} spent of {budget_cost}",
            f"priority   {state.priority}",
            f"updated    {state.updated_at}",
            *(
                [
                    f"approval   {state.pending_approval['tool']} {json.dumps(state.pending_approval['arguments'])}"
                    f" (approve with --revision {state.revision})"
                ]
                if state.pending_approval
                else []
            ),
            f"jobs       {len(state.pending_jobs) or 'none'} pending",
            *(
                f"  {j.key:<48} {j.status:<9} {j.queue:<14} attempts {j.attempts}"
                + (f"  last error: {j.last_error[:60]}" if j.last_error else "")
                for j in state.pending_jobs
            ),
        ]
    )


@cli.group()
def agent() -> None:
    """Create and inspect agents."""


@agent.command("create")
@click.argument("name")
@click.option("--budget-tokens", type=click.IntRange(min=0), help="Token budget (default: unlimited).")
@click.option("--budget-cost", type=str, help="Cost budget, e.g. 2.50 (default: unlimited).")
@actor_option
@json_option
@_friendly
def agent_create(name: str, budget_tokens: int | None, budget_cost: str | None, actor: str, as_json: bool) -> None:
    """Create an idle agent called NAME."""
    cost = None
    if budget_cost is not None:
        try:
            cost = Decimal(budget_cost)
        except ArithmeticError:
            raise click.BadParameter(f"{budget_cost!r} is not a number", param_hint="--budget-cost") from None
    with _client() as client:
        state = client.create_agent(name, budget_tokens=budget_tokens, budget_cost=cost, actor=actor)
    _emit(state, as_json, _state_text(state))


@agent.command("show")
@click.argument("agent_ref", metavar="AGENT")
@json_option
@_friendly
def agent_show(agent_ref: str, as_json: bool) -> None:
    """Show AGENT (id or name)."""
    with _client() as client:
        state = client.get_state(agent_ref)
    _emit(state, as_json, _state_text(state))


@agent.command("list")
@json_option
@_friendly
def agent_list(as_json: bool) -> None:
    """List all agents."""
    with _client() as client:
        states = client.list_agents()
    lines = [f"{s.name:<24} {s.phase:<17} rev {s.revision:<6} {s.request_id or '-'}" for s in states]
    _emit(states, as_json, "\n".join(lines) or "no agents")


@cli.command("submit")
@click.argument("agent_ref", metavar="AGENT")
@click.argument("request_id")
@click.option("--input", "input_text", default="null", help="The request's input as JSON.")
@click.option("--revision", type=click.IntRange(min=0), help="Expected revision (rejected if stale).")
@actor_option
@json_option
@_friendly
def submit(agent_ref: str, request_id: str, input_text: str, revision: int | None, actor: str, as_json: bool) -> None:
    """Start request REQUEST_ID on AGENT (idempotent on REQUEST_ID)."""
    try:
        value = json.loads(input_text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--input") from None
    with _client() as client:
        state = client.submit(agent_ref, request_id, value, expected_revision=revision, actor=actor)
    _emit(state, as_json, _state_text(state))


@cli.command("run")
@click.argument("agent_ref", metavar="AGENT")
@click.argument("prompt")
@click.option("--request-id", help="Request id (default: a new one). Submitting the same id twice is a no-op.")
@click.option(
    "--script",
    "script_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSON list of scripted model replies (KEEL_LLM_PROVIDER=scripted).",
)
@actor_option
@json_option
@_friendly
def run(
    agent_ref: str, prompt: str, request_id: str | None, script_path: Path | None, actor: str, as_json: bool
) -> None:
    """Ask AGENT to work on PROMPT; workers and beat take it from there (see `keel state`)."""
    import uuid

    value: dict[str, Any] = {"prompt": prompt}
    if script_path is None and settings_or_exit().llm_provider == "scripted":
        raise click.UsageError("KEEL_LLM_PROVIDER is scripted: give the replies with --script, or use openai")
    if script_path is not None:
        try:
            value["script"] = json.loads(script_path.read_text())
        except json.JSONDecodeError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint="--script") from None
    with _client() as client:
        state = client.submit(agent_ref, request_id or f"run-{uuid.uuid4().hex[:12]}", value, actor=actor)
    _emit(state, as_json, _state_text(state))


@cli.command("state")
@click.argument("agent_ref", metavar="AGENT")
@json_option
@_friendly
def state_cmd(agent_ref: str, as_json: bool) -> None:
    """Show AGENT's state: phase, revision, pending jobs and any call waiting for approval."""
    with _client() as client:
        state = client.get_state(agent_ref)
    _emit(state, as_json, _state_text(state))


def _decision_command(name: str, help_text: str) -> None:
    @cli.command(name, help=help_text)
    @click.argument("agent_ref", metavar="AGENT")
    @click.option("--revision", type=click.IntRange(min=0), required=name != "cancel", help="Expected revision.")
    @click.option("--reason", help="Why (journaled).")
    @actor_option
    @json_option
    @_friendly
    def command(agent_ref: str, revision: int | None, reason: str | None, actor: str, as_json: bool) -> None:
        with _client() as client:
            if name == "approve":
                assert revision is not None
                state = client.approve(agent_ref, expected_revision=revision, actor=actor)
            elif name == "reject":
                assert revision is not None
                state = client.reject(agent_ref, expected_revision=revision, actor=actor, reason=reason)
            else:
                state = client.cancel(agent_ref, expected_revision=revision, actor=actor, reason=reason)
        _emit(state, as_json, _state_text(state))


_decision_command("approve", "Approve AGENT's pending tool call (needs --revision).")
_decision_command("reject", "Decline AGENT's pending tool call; it goes back to planning (needs --revision).")
_decision_command("cancel", "Stop AGENT's request in flight: it moves to failed.")


# --- jobs ------------------------------------------------------------------------------------------------------


@cli.command("job")
@click.argument("key")
@json_option
@_friendly
def job_show(key: str, as_json: bool) -> None:
    """Show one job by its key ({request_id}:{operation}:{target})."""
    from models.jobs_sql import job_row

    with _client() as client:
        row = job_row(client.db, key)
    if row is None:
        raise click.ClickException(f"no job has the key {key!r}")
    data = {
        k: (str(v) if not isinstance(v, (int, float, str, bool, dict, list, type(None))) else v) for k, v in row.items()
    }
    text = "\n".join(f"{k:<15} {v}" for k, v in data.items() if k != "payload")
    _emit(data, as_json, text)


# --- outbox ----------------------------------------------------------------------------------------------------


@cli.group()
def outbox() -> None:
    """Slack and GitHub messages waiting for, or done with, the relay."""


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (v if isinstance(v, int | float | str | bool | dict | list | type(None)) else str(v)) for k, v in row.items()
    }


@outbox.command("list")
@click.option("--status", type=click.Choice(["pending", "sending", "sent", "dead"]), help="Only this status.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@json_option
@_friendly
def outbox_list(status: str | None, limit: int, as_json: bool) -> None:
    """Newest messages first."""
    from models.outbox_sql import list_messages

    with _client() as client:
        rows = [_plain(r) for r in list_messages(client.db, status, limit)]
    lines = [
        f"{r['key']:<44} {r['channel']:<7} {r['destination']:<24} {r['status']:<8} attempts {r['attempts']}"
        + (f"  {r['last_error'][:60]}" if r["last_error"] else "")
        for r in rows
    ]
    _emit({"messages": rows}, as_json, "\n".join(lines) or "no messages")


@outbox.command("show")
@click.argument("key")
@json_option
@_friendly
def outbox_show(key: str, as_json: bool) -> None:
    """One message: status, attempts, last error, the receiver's id."""
    from models.outbox_sql import message_row

    with _client() as client:
        row = message_row(client.db, key)
    if row is None:
        raise click.ClickException(f"no outbox message has the key {key!r}")
    data = _plain(row)
    _emit(data, as_json, "\n".join(f"{k:<16} {v}" for k, v in data.items()))


@outbox.command("retry")
@click.argument("key")
@actor_option
@_friendly
def outbox_retry(key: str, actor: str) -> None:
    """Send a dead message again (journaled with --actor); it reconciles first if it may have arrived."""
    from agents.outbox.relay import retry_dead

    with _client() as client:
        retry_dead(client.db, key, actor=actor)
    click.echo(f"{key}: dead -> pending")


@outbox.command("stats")
@json_option
@_friendly
def outbox_stats(as_json: bool) -> None:
    """KPIs: deliveries per key (must be 1), duplicate rate, reconciled and dead counts."""
    from models.outbox_sql import stats

    with _client() as client:
        data = stats(client.db)
    text = "\n".join(f"{k:<30} {v}" for k, v in data.items())
    _emit(data, as_json, text)


# --- journal and audit -----------------------------------------------------------------------------------------


def journal_table(events: Sequence[Any]) -> str:
    """The journal as a fixed-width text table."""
    header = f"{'seq':>4}  {'at':<15} {'kind':<10} {'event':<16} {'from -> to':<30} {'rev':>4}  {'actor':<12} decision"
    lines = [header]
    for e in events:
        move = f"{e.from_phase} -> {e.to_phase}" if e.from_phase != e.to_phase else str(e.to_phase)
        lines.append(
            f"{e.seq:>4}  {e.at:%H:%M:%S.%f} {e.kind:<10} {e.event:<16} {move:<30} {e.revision:>4}  "
            f"{e.actor[:12]:<12} {e.decision}"
        )
    return "\n".join(lines)


@cli.command("journal")
@click.option("--agent", "agent_ref", help="Only this agent (id or name).")
@click.option("--request-id", help="Only this request.")
@click.option("--limit", type=click.IntRange(min=1), help="At most this many events.")
@json_option
@_friendly
def journal_cmd(agent_ref: str | None, request_id: str | None, limit: int | None, as_json: bool) -> None:
    """Show journal events, oldest first."""
    with _client() as client:
        events = client.journal(agent_id=agent_ref, request_id=request_id, limit=limit)
    _emit(events, as_json, journal_table(events) if events else "no events")


@cli.group()
def audit() -> None:
    """Check the journal's integrity."""


@audit.command("verify")
@json_option
@_friendly
def audit_verify(as_json: bool) -> None:
    """Walk every agent's hash chain; exit 1 at the first broken link of any chain."""
    from agents.core import journal

    with _client() as client:
        report = journal.verify(client.db)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "ok": report.ok,
                    "agents": report.agents,
                    "events": report.events,
                    "breaks": [
                        {
                            "agent_id": str(b.agent_id),
                            "seq": b.seq,
                            "journal_id": b.journal_id,
                            "reason": b.reason,
                        }
                        for b in report.breaks
                    ],
                },
                indent=2,
            )
        )
    elif report.ok:
        click.echo(f"ok: {report.events} events in {report.agents} agent chains verified")
    else:
        for b in report.breaks:
            where = f"journal id {b.journal_id}" if b.journal_id is not None else "chain head"
            click.echo(f"BROKEN agent {b.agent_id} at event {b.seq} ({where}): {b.reason}", err=True)
    if not report.ok:
        sys.exit(1)


@cli.command("kpi")
@json_option
@_friendly
def kpi(as_json: bool) -> None:
    """The KPIs, computed from the tables: suppressed duplicates, side effects confirmed twice, p95 step latency,
    recovery rate after a first failure, retry-caused cost, failure rate."""
    from models.kpi_sql import kpis

    with _client() as client:
        data = {k: (float(v) if hasattr(v, "as_tuple") else v) for k, v in kpis(client.db).items()}
    _emit(data, as_json, "\n".join(f"{k:<28} {v}" for k, v in data.items()))


# --- docs ------------------------------------------------------------------------------------------------------


@cli.group()
def docs() -> None:
    """Generated documentation."""


@docs.command("phases")
@click.option("--output", type=click.Path(path_type=Path), default=DOCS_PHASES, show_default=True)
@click.option("--check", is_flag=True, help="Exit 1 if the file differs from the phase table instead of writing.")
def docs_phases(output: Path, check: bool) -> None:
    """Write the phase diagram (Mermaid) generated from agents/core/phases.py."""
    from agents.core.phases import phases_markdown

    text = phases_markdown()
    if check:
        current = output.read_text() if output.exists() else ""
        if current != text:
            raise click.ClickException(f"{output} is out of date: run `keel docs phases`")
        click.echo(f"{output} matches the phase table")
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    click.echo(f"wrote {output}")


# --- demo and dev ----------------------------------------------------------------------------------------------


@cli.command("demo")
@_friendly
def demo() -> None:
    """The main job: scripted agents with a worker killed midway; exits 0 only if nothing ran twice."""
    from agents.demo.run import run_demo

    sys.exit(run_demo(settings_or_exit(), click.echo))


@cli.command("up")
@click.option("--flower-port", default=5555, show_default=True, type=int)
@click.option("--concurrency", default=2, show_default=True, type=click.IntRange(min=1))
def up(flower_port: int, concurrency: int) -> None:
    """Run the whole stack here — worker, beat and Flower — on the configured or embedded servers, until Ctrl-C."""
    import os
    import signal
    import subprocess
    import time

    from models import migrations
    from models.embedded import broker_url_for, database_url_for

    settings = settings_or_exit(imports=True)
    env = dict(os.environ)
    env["KEEL_DATABASE_URL"] = database_url_for(settings)
    env["KEEL_BROKER_URL"] = broker_url_for(settings)
    migrations.upgrade(env["KEEL_DATABASE_URL"])
    commands = {
        "worker": ["worker", "-c", str(concurrency)],
        "beat": ["beat"],
        "flower": ["flower", "--port", str(flower_port), "--address=127.0.0.1"],
    }
    procs = {
        name: subprocess.Popen([sys.executable, "-m", "agents", *args], env=env, start_new_session=True)
        for name, args in commands.items()
    }
    click.echo(f"keel up: worker, beat and Flower (http://127.0.0.1:{flower_port}) running; Ctrl-C stops them")
    try:
        while all(p.poll() is None for p in procs.values()):
            time.sleep(0.5)
        dead = [name for name, p in procs.items() if p.poll() is not None]
        click.echo(f"keel up: {', '.join(dead)} exited; stopping the rest", err=True)
    except KeyboardInterrupt:
        click.echo("keel up: stopping")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


@cli.group()
def dev() -> None:
    """The embedded development servers under ./.keel/."""


@dev.command("status")
@json_option
def dev_status(as_json: bool) -> None:
    """Show whether the embedded PostgreSQL and Redis are running."""
    from models import embedded

    home = settings_or_exit().home
    statuses = [embedded.postgres_status(home), embedded.redis_status(home)]
    if as_json:
        data = {
            s.name: {"running": s.running, "pid": s.pid, "url": s.url, "data_dir": str(s.data_dir)} for s in statuses
        }
        click.echo(json.dumps(data, indent=2))
        return
    for s in statuses:
        state = f"running (pid {s.pid})  {s.url}" if s.running else "stopped"
        click.echo(f"{s.name:<9} {state}  data: {s.data_dir}")


@dev.command("stop")
def dev_stop() -> None:
    """Stop the embedded PostgreSQL and Redis (their data stays in ./.keel/)."""
    from models import embedded

    home = settings_or_exit().home
    for name, stop in (("postgres", embedded.stop_postgres), ("redis", embedded.stop_redis)):
        click.echo(f"{name:<9} {'stopped' if stop(home) else 'was not running'}")


def main() -> None:
    """Entry point: every error is one line on stderr (no usage dump, no traceback) and a non-zero status."""
    # Python's own fallback prints warnings unfiltered: give the root logger a handler that masks secrets.
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    install_log_redaction()
    try:
        status = cli.main(prog_name="keel", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("keel: aborted", err=True)
        sys.exit(130)
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.format_message(), err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        message = " ".join(exc.format_message().split())
        if isinstance(exc, click.UsageError) and exc.ctx is not None:
            message += f" (see '{exc.ctx.command_path} --help')"
        click.echo(f"keel: error: {message}", err=True)
        sys.exit(exc.exit_code)
    sys.exit(status if isinstance(status, int) else 0)
