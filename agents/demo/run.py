"""``keel demo``: scripted agents plan, call tools, wait for approval and post to Slack and GitHub while the worker
is SIGKILLed midway, on a worker, beat, API and local sinks the demo starts itself; it exits 0 only if the numbers
say nothing ran twice and every invariant it checks held (docs/explanation/runtime-outbox-and-workers.md#the-demo).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import redis

import agents.demo.tools  # noqa: F401 - registers kb_search here too: submits are checked against the tools
from agents.cli.common import count, decimal_text, percent, seconds
from agents.cli.progress import Progress, Step
from agents.cli.supervisor import api_ready, local_url, supervised_env, where
from agents.client import Client, HttpClient
from agents.core import journal
from agents.core.errors import KeelError, StaleRevision
from agents.demo.fake_servers import FakeGitHub, FakeSlack
from agents.ingress.tokens import Scope, create_token, revoke_token
from models import migrations
from models.db import Database
from models.embedded import broker_url_for, free_port, migration_url_for
from models.keepalives import tcp_options
from models.kpi_sql import agent_kpis, request_outcomes
from models.roles import RoleNames, refuse_privileged
from models.settings import Settings
from models.urls import libpq_url

try:  # the demo's Pydantic AI agent, with the pydantic-ai extra (registers operation concierge here too)
    from agents.demo import pai
except ImportError:  # pragma: no cover - the extra is installed wherever the tests run
    pai = None  # type: ignore[assignment]

#: The demo's agents are named with this prefix: its approver token sees only them.
DEMO_PREFIX = "demo-"
#: What the Pydantic AI agent's model and tools log over its run (agents/demo/pai.py): each reply and call once.
PAI_EXPECTED = ["model reply 1", "runbook failover", "model reply 2", "page_oncall database", "model reply 3"]

SLACK_TOKEN = "xoxb-keel-demo-sink-token"
GITHUB_TOKEN = "ghp_keelDemoSinkToken"


@dataclass
class Checks:
    results: list[tuple[str, bool]] = field(default_factory=list)

    def __call__(self, name: str, ok: bool) -> None:
        self.results.append((name, ok))

    @property
    def ok(self) -> bool:
        return all(ok for _, ok in self.results)


def _search(query: str, tokens: int = 150) -> dict[str, Any]:
    return {"tool_calls": [{"name": "kb_search", "arguments": {"query": query}}], "tokens": tokens, "cost": "0.002"}


def scenarios() -> list[tuple[str, dict[str, Any], dict[str, Any], str, str]]:
    """(agent, budget, request input, how it should end, operation)."""
    post = {"name": "slack_post", "arguments": {"channel": "C0DEMO", "text": "Incident summary posted by Keel"}}
    comment = {
        "name": "github_comment",
        "arguments": {"repository": "acme/api", "issue": 42, "body": "Root cause: failover"},
    }
    final = {"content": "Two incidents; the database failover is the root cause.", "tokens": 90, "cost": "0.001"}
    out: list[tuple[str, dict[str, Any], dict[str, Any], str, str]] = []
    for n in range(1, 4):
        script = [_search(f"outage {n}"), {"tool_calls": [post], "tokens": 120}, final]
        out.append((f"triage-{n}", {}, {"prompt": f"Triage outage {n}", "script": script}, "done", "plan"))
    for n in range(1, 3):
        script = [_search("failover"), {"tool_calls": [comment], "tokens": 110}, final]
        asked = {"prompt": "Explain the failover on the issue", "script": script}
        out.append((f"reviewer-{n}", {}, asked, "done", "plan"))
    flaky = [{**_search("cache"), "error": "transient", "tokens": 40}, final]
    out.append(("flaky-model", {}, {"prompt": "What broke the cache?", "script": flaky}, "done", "plan"))
    spender = [_search("a"), _search("b"), _search("c"), _search("d"), final]
    asked = {"prompt": "Search everything", "script": spender}
    out.append(("spender", {"budget_tokens": 400}, asked, "failed", "plan"))
    if pai is not None:  # the Pydantic AI agent: its own replies, its own tools, one call held for approval
        out.append(("concierge", {}, {"prompt": "The database failed over: who do we page?"}, "done", "concierge"))
    return out


class Stack:
    """The worker, beat and API processes the demo starts, each in its own process group, killed by group."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs = env, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str) -> None:
        with open(self.logs / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "agents", *args],
                env=supervised_env(self.env),  # SIGTERMed by the kernel if the demo dies, however it dies
                stdout=log,
                stderr=log,
                start_new_session=True,
                cwd=self.logs,
            )

    def wait_ready(self, name: str, timeout: float = 60, ready: Callable[[], bool] | None = None) -> None:
        """Wait until ``ready`` answers True (by default: until the process logs Celery's ``ready.``)."""
        deadline = time.monotonic() + timeout
        ready = ready or (lambda: b"ready." in (self.logs / f"{name}.log").read_bytes())
        while not ready():
            if time.monotonic() > deadline or self.procs[name].poll() is not None:
                raise KeelError(f"{name} did not start; see {self.logs / (name + '.log')}")
            time.sleep(0.1)

    def start_api(self, pick_port: Callable[[], int] = free_port, attempts: int = 3) -> str:
        """Start the HTTP API on a free port and wait until it is ready; returns its URL. A port is free when
        picked but taken by someone else before the API binds it now and then: then the API exits ("address already
        in use") and it is started again on another, up to ``attempts`` times."""
        log = self.logs / "api.log"
        for attempt in range(1, attempts + 1):
            port = pick_port()
            url = local_url("127.0.0.1", port)
            written = log.stat().st_size if log.exists() else 0
            self.start("api", "serve", "--host", "127.0.0.1", "--port", str(port))
            try:
                self.wait_ready("api", ready=lambda: api_ready(url))  # noqa: B023 - called within the iteration
                return url
            except KeelError:
                with open(log, "rb") as f:
                    f.seek(written)
                    taken = b"address already in use" in f.read().lower()
                if not taken or attempt == attempts:
                    raise
                self.kill("api")
        raise AssertionError("unreachable")  # pragma: no cover

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        """SIGTERM every group at once (each stops on its own: the worker warm, the API within its bound), then wait
        for each, killing what has not stopped within 15 s."""
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for name in list(self.procs):
            self.kill(name, signal.SIGTERM)


class DemoRunning(KeelError):
    """Another ``keel demo`` is running on the same database."""


#: The demo's session advisory lock, ``pg_try_advisory_lock(int4, int4)``: "keel", "demo" in ASCII (a key space the
#: outbox's single-bigint locks never meet).
DEMO_LOCK = (0x6B65656C, 0x64656D6F)
_HOLDER = re.compile(r"keel demo: pid (?P<pid>\d+) on (?P<host>.+)")


@contextmanager
def only_demo_on(database_url: str, embedded_home: Path | None) -> Iterator[None]:
    """Hold the demo's advisory lock on its database for the block, on a connection of its own (so the lock goes with
    the process however it ends), or raise :class:`DemoRunning` naming the demo that holds it. ``embedded_home``: the
    database is the embedded one under it (the advice differs)."""
    me = f"keel demo: pid {os.getpid()} on {socket.gethostname()}"[:63]  # application_name holds 63 bytes
    with psycopg.connect(
        libpq_url(database_url), autocommit=True, application_name=me, **tcp_options(database_url)
    ) as conn:
        holder = _take_lock(conn)
        if holder is not None:
            if embedded_home is not None:
                here, advice = f"the embedded servers under {embedded_home.resolve()}", "another KEEL_HOME"
            else:
                here = f"this database ({where(database_url)})"
                advice = "another database (KEEL_DATABASE_URL)"
            raise DemoRunning(f"{holder} is running on {here}: wait until it ends, or run this one with {advice}")
        yield


def _take_lock(conn: psycopg.Connection[Any]) -> str | None:
    """Take the demo's lock on this connection: None once taken, else who holds it."""
    for _ in range(2):  # the holder may end between our try and our look at it: then try again
        if conn.execute("SELECT pg_try_advisory_lock(%s, %s)", DEMO_LOCK).fetchone() == (True,):
            return None
        holder = _holder(conn)
        if holder is not None:
            return holder
    return "another keel demo"


def _holder(conn: psycopg.Connection[Any]) -> str | None:
    """Who holds the demo's lock on this database: ``another keel demo (pid N on HOST)``; None if nobody does."""
    row = conn.execute(
        "SELECT a.application_name, a.pid FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s AND l.objid = %s AND l.objsubid = 2"
        " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        DEMO_LOCK,
    ).fetchone()
    if row is None:
        return None
    found = _HOLDER.fullmatch(row[0] or "")
    if found is None:  # not a demo's connection (someone took the key by hand): name its server process
        return f"another session (PostgreSQL backend pid {row[1]}, application {row[0]!r})"
    return f"another keel demo (pid {found['pid']} on {found['host']})"


def _broker_prefix(settings: Settings, run: str) -> str:
    """The demo's own part of the broker: every key and channel its worker and beat use starts with it, so demos on
    one Redis never take each other's messages (and a user's workers there never take the demo's)."""
    prefix = f"{settings.broker_prefix}demo-{run}:"
    return prefix if len(prefix) <= 100 else f"keel-demo-{run}:"  # KEEL_BROKER_PREFIX holds 100 characters


def _forget_broker_keys(url: str, prefix: str) -> None:
    """Delete the keys the demo's worker and beat left under its prefix (queue bindings, at most a few messages)."""
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3) as client:
            keys = list(client.scan_iter(match=prefix + "*", count=1000))
            if keys:
                client.delete(*keys)
    except redis.RedisError:  # the broker is gone: nothing to tidy there
        pass


class Shutdown:
    """Stops the demo on SIGTERM, SIGHUP or SIGQUIT from within the handler (the worker, beat and API, then exit 128 +
    the signal's number), raising nothing into the main thread, whose database connection the clean-up may need."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)

    def __init__(self) -> None:
        self.stack: Stack | None = None
        self.tidy: Callable[[], None] | None = None

    @contextmanager
    def installed(self) -> Iterator[Shutdown]:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in self.SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, _frame: object) -> None:
        for sig in self.SIGNALS:  # a second signal must not interrupt this clean-up
            signal.signal(sig, signal.SIG_IGN)
        if self.stack is not None:
            self.stack.stop()
        if self.tidy is not None:
            self.tidy()
        name = signal.Signals(signum).name
        message = f"\nkeel demo: stopped by {name}; its worker, beat and API were stopped\n"
        try:
            cursor = "\x1b[?25h" if sys.stdout.isatty() else ""  # a live display hid it
            os.write(sys.stdout.fileno(), (cursor + message).encode())
        except (OSError, ValueError):  # the terminal is gone (SIGHUP)
            pass
        os._exit(128 + signum)


def run_demo(settings: Settings, out: Progress | None = None, *, migrate: bool = False) -> int:
    """Run the demo, showing its progress on ``out``; 0 if every invariant held. The embedded database is migrated
    first, a configured one only with ``migrate`` (else it must be at this code's revision)."""
    with Shutdown().installed() as shutdown, ExitStack() as held:
        return _run_demo(settings, out or Progress(), shutdown, migrate, held)


def _run_demo(settings: Settings, out: Progress, shutdown: Shutdown, migrate: bool, held: ExitStack) -> int:
    started = time.monotonic()
    servers = "configured servers" if not settings.uses_embedded else f"embedded servers under {settings.home}"
    out.line(f"Keel demo on {servers}")
    with out.task("starting the database and the broker"):
        db = Database.from_settings(settings)
        # The direct URL: the lock is a session's, which a transaction pooler would not keep for this process.
        held.enter_context(only_demo_on(db.direct_url, settings.home if settings.database_url is None else None))
        # First: an unreachable database, or one at another revision, stops the demo before anything is started.
        migrated = migrations.prepare(
            migration_url_for(settings), migrate=migrate or settings.database_url is None, roles=RoleNames.of(settings)
        )
        refuse_privileged(db.engine, settings)  # in production, not as a role that could rewrite the journal
        broker = broker_url_for(settings)
    if migrated is not None:
        out.line(migrated)
    run = uuid.uuid4().hex[:6]
    prefix = _broker_prefix(settings, run)
    logs = (settings.home / "demo" / run).resolve()
    logs.mkdir(parents=True, exist_ok=True)
    # The person who approves: the demo's own approver token, for the demo's agents only; its secret is never shown.
    token, secret = create_token(db, f"demo-approver-{run}", [Scope.APPROVER], agent_prefix=DEMO_PREFIX, actor="demo")
    slack = FakeSlack(token=SLACK_TOKEN).start()
    github = FakeGitHub(token=GITHUB_TOKEN).start()
    assert isinstance(slack, FakeSlack) and isinstance(github, FakeGitHub)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
    env.update(
        {
            "KEEL_DATABASE_URL": db.url,
            "KEEL_BROKER_URL": broker,
            "KEEL_BROKER_PREFIX": prefix,
            "KEEL_HOME": str(settings.home.resolve()),
            # Log files a person reads: readable lines, unless KEEL_LOG_FORMAT asks for JSON.
            "KEEL_LOG_FORMAT": settings.log_format or "console",
            "KEEL_IMPORTS": json.dumps(["agents.demo.tools", *(["agents.demo.pai"] if pai is not None else [])]),
            "KEEL_LLM_PROVIDER": "scripted",
            "KEEL_SLACK_TOKEN": SLACK_TOKEN,
            "KEEL_SLACK_API_URL": f"{slack.url}/api/",
            "KEEL_GITHUB_TOKEN": GITHUB_TOKEN,
            "KEEL_GITHUB_API_URL": github.url,
            "KEEL_HTTP_TIMEOUT_SECONDS": "2",
            "KEEL_OUTBOX_LEASE_SECONDS": "6",
            "KEEL_OUTBOX_INTERVAL_SECONDS": "0.3",
            "KEEL_JOB_LEASE_SECONDS": "3",
            "KEEL_ENQUEUE_TIMEOUT_SECONDS": "5",
            "KEEL_DISPATCH_INTERVAL_SECONDS": "0.2",
            "KEEL_DEADLINE_CHECK_SECONDS": "1",
            "KEEL_VISIBILITY_TIMEOUT_SECONDS": "30",
            "KEEL_RETRY_POLICY": json.dumps({"transient": {"base_seconds": 0.3, "max_seconds": 2}}),
        }
    )
    if settings.audit_keys:  # the journal's key ring, as given; without one the processes share the home's key
        env["KEEL_AUDIT_KEYS"] = json.dumps({k: v.get_secret_value() for k, v in settings.audit_keys.items()})
        env["KEEL_AUDIT_KEY_ID"] = settings.current_audit_key_id or ""
    stack = shutdown.stack = Stack(env, logs)
    shutdown.tidy = lambda: _forget_broker_keys(broker, prefix)
    client = Client(db, settings)
    approver: HttpClient | None = None
    checks = Checks()
    try:
        with out.task("starting a worker, a beat and the HTTP API"):
            stack.start("worker-1", "worker", "-n", f"demo1-{run}@%h")  # as it starts by default
            stack.start("beat", "beat")
            api_url = stack.start_api()
            stack.wait_ready("worker-1")
        approver = HttpClient(api_url, secret)
        out.line(
            f"worker, beat, the API at {api_url} and the Slack/GitHub sinks are up; submitting"
            f" {len(scenarios())} scripted requests" + ("" if pai is None else " (one to a Pydantic AI agent)")
        )
        expected: dict[str, str] = {}
        ids: dict[str, Any] = {}
        late: list[Callable[[], None]] = []
        for name, budget, request, ending, operation in scenarios():
            # DEMO_PREFIX: the approver token sees only them.
            agent = client.create_agent(f"{DEMO_PREFIX}{name}-{run}", **budget)
            expected[agent.name] = ending
            submit = _submitter(client, ids, agent, f"{name}-{run}", request, operation)
            # The Pydantic AI agent's steps take milliseconds: submitted once the worker was killed, so that its
            # log (each reply and tool call once) is not muddled by a kill between a call and its checkpoint.
            if operation == "concierge":
                late.append(submit)
            else:
                submit()
        _drive(client, approver, ids, stack, run, out, checks, late)
        _report(client, db, ids, expected, slack, github, logs, out, checks)
        approvals = [e for a in ids.values() for e in client.journal(agent_id=a) if e.event == "approve"]
        checks(
            f"every approval came through the HTTP API, journaled as its token ({token.name})",
            bool(approvals) and all(e.actor == token.name for e in approvals),
        )
        revoke_token(db, token.id, actor="demo")
    finally:
        stack.stop()
        _forget_broker_keys(broker, prefix)
        slack.stop()
        github.stop()
        if approver is not None:
            approver.close()
        client.close()
    elapsed = time.monotonic() - started
    checks("finished in under two minutes", elapsed < 120)
    out.line(f"\nHTTP API: {api_url} (docs at {api_url}/docs), stopped with the demo.")
    out.line(f"The approvals went through it with the demo's own approver token, {token.name}:")
    out.line(f"scope approver, {DEMO_PREFIX}* agents only, revoked now.")
    out.line("\nInvariants:")
    for name, ok in checks.results:
        out.line(f"  [{'ok' if ok else 'FAILED'}] {name}")
    out.line(f"\n{'all invariants held' if checks.ok else 'SOME INVARIANTS FAILED'} ({elapsed:.0f}s; logs in {logs})")
    return 0 if checks.ok else 1


def _submitter(
    client: Client, ids: dict[str, Any], agent: Any, request_id: str, request: Any, operation: str
) -> Callable[[], None]:
    """Submit one scenario's request (now, or when the demo says) and follow its agent from then on."""

    def submit() -> None:
        client.submit(agent.id, request_id, request, actor="demo", operation=operation)
        ids[agent.name] = agent.id

    return submit


def _drive(
    client: Client,
    approver: HttpClient,
    ids: dict[str, Any],
    stack: Stack,
    run: str,
    out: Progress,
    checks: Checks,
    late: list[Callable[[], None]],
) -> None:
    """Run until every request rests: kill the worker once a tool is mid-call (then submit the ``late`` ones),
    approve what waits (over HTTP)."""
    with out.task(f"running {len(ids) + len(late)} requests", total=len(ids) + len(late)) as step:
        killed = _drive_until_rest(client, approver, ids, stack, run, out, step, late)
    checks("the worker was killed mid-run and a new one took over", killed)
    checks("every request came to rest", all(client.get_state(a).phase in ("done", "failed") for a in ids.values()))


def _drive_until_rest(
    client: Client,
    approver: HttpClient,
    ids: dict[str, Any],
    stack: Stack,
    run: str,
    out: Progress,
    step: Step,
    late: list[Callable[[], None]],
) -> bool:
    killed = False
    approved: set[str] = set()
    waiting = list(late)  # submitted once the worker was killed (or, if it never was, once the rest came to rest)
    deadline = time.monotonic() + 90
    last = ""
    while time.monotonic() < deadline:
        states = {name: client.get_state(agent_id) for name, agent_id in ids.items()}
        phases = Counter(s.phase for s in states.values())
        running = sum(
            1 for s in states.values() for j in s.pending_jobs if j.status == "running" and j.operation == "tool"
        )
        if not killed and running:
            stack.kill("worker-1")
            out.line(f"  SIGKILL the worker while {running} tool call(s) run; starting a new one")
            stack.start("worker-2", "worker", "-n", f"demo2-{run}@%h")
            stack.wait_ready("worker-2")
            killed = True
            while waiting:
                waiting.pop(0)()
            continue
        for name, state in states.items():
            if state.phase == "waiting_approval" and name not in approved and state.pending_approval:
                try:
                    approver.approve(state.id, expected_revision=state.revision)  # If-Match: "r<revision>"
                except StaleRevision:  # another step moved the agent since we looked: look again
                    continue
                approved.add(name)
                tool = state.pending_approval["tool"]
                out.line(f"  approved {tool} for {name} at revision {state.revision} (POST …/approve, If-Match)")
        line = ", ".join(f"{phase} {n}" for phase, n in sorted(phases.items()))
        at_rest = sum(1 for s in states.values() if s.phase in ("done", "failed") and not s.pending_jobs)
        step.update(completed=at_rest, status=line)
        if line != last:
            out.line(f"  {line}")
            last = line
        if at_rest == len(states):
            if not waiting:
                break
            while waiting:
                waiting.pop(0)()
        time.sleep(0.3)
    return killed


def _report(
    client: Client,
    db: Database,
    ids: dict[str, Any],
    expected: dict[str, str],
    slack: FakeSlack,
    github: FakeGitHub,
    logs: Path,
    out: Progress,
    checks: Checks,
) -> None:
    deadline = time.monotonic() + 30
    with out.task("delivering the last Slack and GitHub messages") as step, db.connection() as conn:
        while time.monotonic() < deadline:
            row = conn.execute("SELECT count(*) FROM outbox WHERE status IN ('pending', 'sending')").fetchone()
            conn.rollback()
            if row == (0,):
                break
            step.update(status=f"{row[0] if row else '?'} to go")
            time.sleep(0.3)
    outcomes = {r["name"]: r for r in request_outcomes(db) if r["name"] in ids}
    table = [(n, outcomes[n]["phase"], outcomes[n]["why"], count(outcomes[n]["spent_tokens"])) for n in sorted(ids)]
    width = max(len("agent"), *(len(n) for n in ids))
    out.table(
        "Requests:",
        ("agent", "outcome", "why", "tokens"),
        table,
        [f"  {'agent':<{width}} {'outcome':<8} {'why':<22} {'tokens':>7}"]
        + [f"  {name:<{width}} {phase:<8} {why:<22} {tokens:>7}" for name, phase, why, tokens in table],
    )
    checks(
        "each request ended as scripted (the spender on its budget)",
        all(outcomes[n]["phase"] == expected[n] for n in ids)
        and all(outcomes[n]["why"] == "budget_exhausted" for n in ids if expected[n] == "failed"),
    )
    k = agent_kpis(db, ids.values())
    at_receivers = slack.delivered_keys() + github.delivered_keys()
    duplicates = sum(n - 1 for n in at_receivers.values() if n > 1)
    searches_file = logs / "demo-searches.log"
    searches = Counter(searches_file.read_text().split()) if searches_file.exists() else Counter()
    rows = [
        ("model calls (attempts)", count(k["model_calls"])),
        ("tool calls (attempts)", count(k["tool_calls"])),
        (
            "messages at Slack / GitHub",
            f"{sum(slack.delivered_keys().values())} / {sum(github.delivered_keys().values())}",
        ),
        ("suppressed duplicates", count(k["suppressed_duplicates"])),
        ("duplicate side effects", count(duplicates)),
        # Not `keel kpi`'s p95 phase-transition latency (the database's time in one transition): a step's whole wait.
        ("p95 step latency", f"{seconds(k['p95_step_seconds'] or 0)} (a step due -> its outcome recorded)"),
        (
            "recovery rate after first failure",
            f"{percent(k['recovery_rate'] or 0)} of {count(k['jobs_finished_after_failure'])} jobs finished after a"
            " failure",
        ),
        ("retry-caused cost", f"{count(k['retry_tokens'])} tokens, ${decimal_text(k['retry_cost'])}"),
        ("failure rate", percent(k["failure_rate"] or 0)),
    ]
    out.table("KPIs:", ("KPI", "value"), rows, [f"  {label:<36} {value}" for label, value in rows])
    checks(
        "no side effect happened twice (counted at the receivers)", duplicates == 0 and k["keys_confirmed_twice"] == 0
    )
    checks("every Slack and GitHub message was delivered", len(at_receivers) == 5 and k["deliveries"] == 5)
    checks("no finished tool call ran again after the crash", all(n == 1 for n in searches.values()))
    if pai is not None:
        said = Counter((logs / pai.PAI_LOG).read_text().splitlines()) if (logs / pai.PAI_LOG).exists() else Counter()
        checks(
            "the Pydantic AI agent's model was asked once per reply and its tools ran once, the page once approved",
            said == Counter(PAI_EXPECTED),
        )
    checks("the killed step and the flaky model recovered", (k["recovery_rate"] or 0) == 1.0)
    report = journal.verify(db)
    checks("every journal hash chain verifies", report.ok)
