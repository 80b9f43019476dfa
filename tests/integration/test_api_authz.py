"""The HTTP API's authorization matrix, against a real ``keel serve``: every operation its OpenAPI document lists,
by every scope (and with no token, a token in the wrong scheme, a malformed, an unknown and a revoked one), with a
token limited to the prefix ``acme-`` or not, on a target inside (``acme-``) or outside (``globex-``) that prefix.

What is expected (:data:`MATRIX`) is written out here from the documentation (docs/how-to/tokens-and-tenants.md,
"What each scope may call" and "Refusals"), not read from ``agents/ingress/tokens.py``: the test is a second opinion on
the code, and an operation the live app serves without an entry here fails it. Every refusal is checked to change
nothing (journal, agents, requests, jobs, outbox, tokens), and an outside target's refusal to read exactly like a
missing one's."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from agents.client import Client
from agents.ingress.tokens import revoke_token
from models.db import Database
from tests.support.api import COMMENT, PROBLEM, Api, problem, running_api, script
from tests.support.broker import Broker
from tests.support.keys import scoped
from tests.support.runs import run_all

pytestmark = pytest.mark.integration

SCOPES = ("producer", "approver", "operator", "auditor")
ANY = frozenset(SCOPES)
PRODUCERS = frozenset({"producer", "operator"})
READERS = frozenset({"operator", "auditor"})  # request stories, jobs, the outbox
INSIDE, OUTSIDE = "acme-", "globex-"
#: Ways to call without a valid token: each is a 401.
NO_TOKEN = ("none", "basic", "malformed", "unknown", "revoked")
SLACK = script(
    {"tool_calls": [{"name": "slack_post", "arguments": {"channel": "C1", "text": "hi"}}]},
    {"content": "Posted."},
)


class Reach(Enum):
    """What an operation names, which decides what a token's prefix does to it."""

    NONE = "none"  # no agent: the public endpoints, the token itself
    AGENT = "agent"  # an agent, or a request, job or message of one: outside the prefix, the 404 of a missing one
    LIST = "list"  # a list: what is outside the prefix is left out
    CREATE = "create"  # the name of an agent to be: outside the prefix, a 403


class Fresh(Enum):
    """What an allowed write uses up, made anew for each one."""

    NAME = "a name no agent has"
    IDLE = "an agent at rest"
    WAITING = "an agent waiting for approval"
    DEAD = "a dead outbox message"


@dataclass(frozen=True)
class Target:
    """One tenant's things, for the calls to name."""

    prefix: str
    agent: str  # the id of an agent at rest that ran ``request`` (its job ``job`` sent ``message``, now dead)
    request: str
    job: str
    message: str
    waiting: str  # the id of an agent waiting for approval, at ``waiting_revision``
    waiting_revision: int
    new_name: str

    def refs(self) -> list[str]:
        """Everything of it a call may name (and an answer echo), longest first."""
        found = [self.agent, self.request, self.job, self.message, self.waiting, self.new_name]
        return sorted(found, key=len, reverse=True)


@dataclass(frozen=True)
class Call:
    method: str
    url: str
    headers: dict[str, str] = field(default_factory=dict)
    json: Any = None


@dataclass(frozen=True)
class Op:
    """Who may call an operation (None: anybody, no token needed), what it names, its success status, and what an
    allowed call of it uses up (None: a read)."""

    scopes: frozenset[str] | None
    reach: Reach
    call: Callable[[Target, int], Call]
    ok: int = 200
    fresh: Fresh | None = None


def _if_match(t: Target) -> dict[str, str]:
    return {"If-Match": f'"r{t.waiting_revision}"'}


# From docs/how-to/tokens-and-tenants.md: "What each scope may call" (operation | scope).
MATRIX: dict[tuple[str, str], Op] = {
    ("GET", "/healthz"): Op(None, Reach.NONE, lambda t, n: Call("GET", "/healthz")),
    ("GET", "/readyz"): Op(None, Reach.NONE, lambda t, n: Call("GET", "/readyz")),
    ("GET", "/problems"): Op(None, Reach.NONE, lambda t, n: Call("GET", "/problems")),
    ("GET", "/problems/{slug}"): Op(None, Reach.NONE, lambda t, n: Call("GET", "/problems/forbidden")),
    ("GET", "/v1/tokens/me"): Op(ANY, Reach.NONE, lambda t, n: Call("GET", "/v1/tokens/me")),
    ("POST", "/v1/agents"): Op(
        PRODUCERS, Reach.CREATE, lambda t, n: Call("POST", "/v1/agents", json={"name": t.new_name}), 201, Fresh.NAME
    ),
    ("GET", "/v1/agents"): Op(ANY, Reach.LIST, lambda t, n: Call("GET", "/v1/agents")),
    ("GET", "/v1/agents/{agent}"): Op(ANY, Reach.AGENT, lambda t, n: Call("GET", f"/v1/agents/{t.agent}")),
    ("POST", "/v1/agents/{agent}/requests"): Op(
        PRODUCERS,
        Reach.AGENT,
        lambda t, n: Call(
            "POST",
            f"/v1/agents/{t.agent}/requests",
            {"Idempotency-Key": f"{t.prefix}submit-{n}"},
            {"input": script({"content": "hi"})},
        ),
        201,
        Fresh.IDLE,
    ),
    ("GET", "/v1/agents/{agent}/requests/{request_id}"): Op(
        ANY, Reach.AGENT, lambda t, n: Call("GET", f"/v1/agents/{t.agent}/requests/{t.request}")
    ),
    ("GET", "/v1/requests/{request_id}"): Op(ANY, Reach.AGENT, lambda t, n: Call("GET", f"/v1/requests/{t.request}")),
    ("GET", "/v1/agents/{agent}/requests/{request_id}/story"): Op(
        READERS, Reach.AGENT, lambda t, n: Call("GET", f"/v1/agents/{t.agent}/requests/{t.request}/story")
    ),
    ("POST", "/v1/agents/{agent}/approve"): Op(
        frozenset({"approver"}),
        Reach.AGENT,
        lambda t, n: Call("POST", f"/v1/agents/{t.waiting}/approve", _if_match(t)),
        fresh=Fresh.WAITING,
    ),
    ("POST", "/v1/agents/{agent}/reject"): Op(
        frozenset({"approver"}),
        Reach.AGENT,
        lambda t, n: Call("POST", f"/v1/agents/{t.waiting}/reject", _if_match(t), {"reason": "not now"}),
        fresh=Fresh.WAITING,
    ),
    ("POST", "/v1/agents/{agent}/cancel"): Op(
        frozenset({"operator"}),
        Reach.AGENT,
        lambda t, n: Call("POST", f"/v1/agents/{t.waiting}/cancel", json={"reason": "enough"}),
        fresh=Fresh.WAITING,
    ),
    ("GET", "/v1/agents/{agent}/journal"): Op(
        frozenset({"approver", "operator", "auditor"}),
        Reach.AGENT,
        lambda t, n: Call("GET", f"/v1/agents/{t.agent}/journal"),
    ),
    ("GET", "/v1/approvals"): Op(
        frozenset({"approver", "operator", "auditor"}), Reach.LIST, lambda t, n: Call("GET", "/v1/approvals")
    ),
    ("GET", "/v1/agents/{agent}/events"): Op(
        ANY, Reach.AGENT, lambda t, n: Call("GET", f"/v1/agents/{t.agent}/events", {"Last-Event-ID": "0"})
    ),
    ("GET", "/v1/jobs/{key}"): Op(READERS, Reach.AGENT, lambda t, n: Call("GET", f"/v1/jobs/{t.job}")),
    ("GET", "/v1/outbox"): Op(READERS, Reach.LIST, lambda t, n: Call("GET", "/v1/outbox")),
    ("GET", "/v1/outbox/{key}"): Op(READERS, Reach.AGENT, lambda t, n: Call("GET", f"/v1/outbox/{t.message}")),
    ("POST", "/v1/outbox/{key}/retry"): Op(
        frozenset({"operator"}),
        Reach.AGENT,
        lambda t, n: Call("POST", f"/v1/outbox/{t.message}/retry"),
        fresh=Fresh.DEAD,
    ),
}


def expected(op: Op, cred: str, prefix: str | None, side: str) -> int:
    """The status the documentation promises for ``cred`` (a scope, or one of :data:`NO_TOKEN`) calling ``op`` with a
    token limited to ``prefix`` on the target of tenant ``side``. The scope is checked before the agent: a token outside
    its scope learns nothing about agents either."""
    if op.scopes is None:
        return 200
    if cred not in SCOPES:
        return 401
    if cred not in op.scopes:
        return 403
    if prefix is not None and not side.startswith(prefix):
        if op.reach is Reach.AGENT:
            return 404
        if op.reach is Reach.CREATE:
            return 403
    return op.ok


# --- the world --------------------------------------------------------------------------------------------------


class World:
    """Two tenants' agents on the test's own database, made in-process; fresh things for allowed writes."""

    def __init__(self, db: Database, client: Client) -> None:
        self.db = db
        self.client = client
        self.n = 0
        self.tenants = {prefix: self._tenant(prefix) for prefix in (INSIDE, OUTSIDE)}
        # Nothing has these refs: the missing twin of the outside tenant. Its name to create is an existing agent's,
        # so a token limited to acme- is refused the same whether a globex- agent exists or not. Its request id is as
        # long as the real one: a key past the length an error quotes whole is shortened alike in both answers.
        ghost, nobody = f"{OUTSIDE}g1", uuid.uuid4()
        self.missing = replace(
            self.tenants[OUTSIDE],
            agent=str(nobody),
            request=ghost,
            job=scoped(nobody, f"{ghost}:plan:1"),
            # Under the outside agent (a request it never had): a key longer than an error quotes whole is shortened
            # in the middle of its step, after the agent's hex, alike in both answers.
            message=scoped(uuid.UUID(self.tenants[OUTSIDE].agent), f"{ghost}:slack:tool.slack_post:1.call_0_0@post"),
            waiting=str(uuid.uuid4()),
            new_name=f"{OUTSIDE}story",
        )

    def _tenant(self, prefix: str) -> Target:
        story = self.client.create_agent(f"{prefix}story", actor="setup")
        request = f"{prefix}r1"
        self.client.submit(story.id, request, SLACK, actor="setup")
        run_all(self.db)
        message = scoped(story.id, f"{request}:slack:tool.slack_post:1.call_0_0@post")
        self.kill(message)
        waiting, revision = self._waiting(f"{prefix}waiting")
        job = scoped(story.id, f"{request}:plan:1")
        return Target(prefix, str(story.id), request, job, message, waiting, revision, f"{prefix}new")

    def _waiting(self, name: str) -> tuple[str, int]:
        agent = self.client.create_agent(name, actor="setup")
        self.client.submit(agent.id, f"{name}-r1", COMMENT, actor="setup")
        run_all(self.db)
        state = self.client.get_state(agent.id)
        assert state.phase == "waiting_approval", state
        return str(agent.id), state.revision

    def kill(self, message: str) -> None:
        """The relay gave up on ``message`` (set directly: the test's own database)."""
        with psycopg.connect(self.db.libpq_url, autocommit=True) as conn:
            done = conn.execute(
                "UPDATE outbox SET status = 'dead', last_error = 'gave up (test)' WHERE key = %s", (message,)
            )
            assert done.rowcount == 1, message

    def fresh(self, target: Target, what: Fresh) -> Target:
        """``target`` with a new thing of the kind an allowed write uses up."""
        self.n += 1
        if what is Fresh.NAME:
            return replace(target, new_name=f"{target.prefix}new-{self.n}")
        if what is Fresh.IDLE:
            agent = self.client.create_agent(f"{target.prefix}idle-{self.n}", actor="setup")
            return replace(target, agent=str(agent.id))
        if what is Fresh.WAITING:
            waiting, revision = self._waiting(f"{target.prefix}waiting-{self.n}")
            return replace(target, waiting=waiting, waiting_revision=revision)
        self.kill(target.message)
        return target


def snapshot(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """What a refusal must leave as it was (a token's last use may move: it is noted at most once a minute)."""
    queries = {
        "journal": "SELECT count(*), max(id) FROM audit.journal",
        "agents": "SELECT id, revision, phase FROM agents ORDER BY id",
        "requests": "SELECT count(*) FROM requests",
        "jobs": "SELECT key, status FROM jobs ORDER BY key",
        "outbox": "SELECT key, status FROM outbox ORDER BY key",
        "tokens": "SELECT id, name, scopes, agent_prefix, created_at, created_by, revoked_at, revoked_by"
        " FROM api_tokens ORDER BY id",
    }
    return {name: conn.execute(sql).fetchall() for name, sql in queries.items()}


# --- calling ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Caller:
    """One way of calling: ``cred`` (a scope or one of :data:`NO_TOKEN`), the token's prefix and name, its headers."""

    cred: str
    prefix: str | None
    name: str | None
    headers: dict[str, str]

    def __str__(self) -> str:
        return f"{self.cred} token {self.name or '-'} (prefix {self.prefix or 'none'})"


def send(http: httpx.Client, call: Call) -> httpx.Response:
    """The answer, read whole unless it is a live event stream (then its status and headers are the answer)."""
    with http.stream(call.method, call.url, headers=call.headers, json=call.json) as response:
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            response.read()
        return response


def masked(body: Any, refs: list[str]) -> Any:
    """``body`` with each of ``refs`` in its strings replaced by ``<ref>``."""
    if isinstance(body, dict):
        return {k: masked(v, refs) for k, v in body.items()}
    if isinstance(body, list):
        return [masked(v, refs) for v in body]
    if isinstance(body, str):
        for ref in refs:
            body = body.replace(ref, "<ref>")
    return body


class Matrix:
    """Runs the cases of one test: refusals first (each against the shared world, each checked to change nothing),
    then the allowed calls (writes on fresh things, their journal actor checked). One keep-alive client per caller
    and one database connection for the snapshots, closed by :meth:`close`."""

    def __init__(self, api: Api, world: World, callers: list[Caller]) -> None:
        self.api = api
        self.world = world
        self.callers = callers
        self.clients = {str(c): httpx.Client(base_url=api.url, headers=c.headers, timeout=30) for c in callers}
        self.conn = psycopg.connect(api.db.libpq_url, autocommit=True)
        self.checked: list[str] = []

    def close(self) -> None:
        for http in self.clients.values():
            http.close()
        self.conn.close()

    def run(self, operations: list[tuple[str, str]]) -> None:
        cases = [
            (key, caller, side, expected(MATRIX[key], caller.cred, caller.prefix, side))
            for key in operations
            for caller in self.callers
            for side in (INSIDE, OUTSIDE)
        ]
        for key, caller, side, status in sorted(cases, key=lambda c: 200 <= c[3] < 300):
            if 200 <= status < 300:
                self.allowed(key, caller, side, status)
            else:
                self.refused(key, caller, side, status)

    def refused(self, key: tuple[str, str], caller: Caller, side: str, status: int) -> None:
        op, target, http = MATRIX[key], self.world.tenants[side], self.clients[str(caller)]
        call = op.call(target, 0)
        before = snapshot(self.conn)
        response = send(http, call)
        what = f"{caller} → {call.method} {call.url} ({side} target)"
        assert response.status_code == status, f"{what}: expected {status}, got {response.text}"
        assert snapshot(self.conn) == before, f"{what}: the refusal changed something"
        if status == 401:
            problem(response, 401, "unauthorized")
            assert response.headers["WWW-Authenticate"] == 'Bearer realm="keel"', what
        elif status == 403:
            problem(response, 403, "forbidden")
        else:
            assert response.headers["content-type"] == PROBLEM and response.json()["status"] == 404, what
        if caller.prefix is not None and side == OUTSIDE:
            # The same call on things that do not exist: the same answer, but for the refs it echoes.
            answer = send(http, op.call(self.world.missing, 0))
            assert snapshot(self.conn) == before, f"{what}: the refusal of the missing twin changed something"
            assert answer.status_code == status, f"{what}: the missing twin got {answer.text}"
            assert masked(answer.json(), self.world.missing.refs()) == masked(response.json(), target.refs()), what
        self.checked.append(f"{status} {what}")

    def allowed(self, key: tuple[str, str], caller: Caller, side: str, status: int) -> None:
        op, target, http = MATRIX[key], self.world.tenants[side], self.clients[str(caller)]
        if op.fresh is not None:
            target = self.world.fresh(target, op.fresh)
        call = op.call(target, self.world.n)
        before = snapshot(self.conn)
        response = send(http, call)
        what = f"{caller} → {call.method} {call.url} ({side} target)"
        assert response.status_code == status, f"{what}: expected {status}, got {response.text}"
        if op.fresh is None:
            assert snapshot(self.conn) == before, f"{what}: a read changed something"
        else:
            ((_, last),) = before["journal"]
            journaled = self.conn.execute(
                "SELECT actor, kind, event FROM audit.journal WHERE id > %s ORDER BY id", (last or 0,)
            ).fetchall()
            assert journaled, f"{what}: nothing journaled"
            assert {actor for actor, _, _ in journaled} == {caller.name}, f"{what}: journaled as {journaled}"
        if op.reach is Reach.LIST:
            self.check_list(key, caller, response.json())
        self.checked.append(f"{status} {what}")

    def check_list(self, key: tuple[str, str], caller: Caller, body: dict[str, Any]) -> None:
        """A prefix leaves the other tenants out of lists; without one, both are in."""
        if key == ("GET", "/v1/agents"):
            names = [a["name"] for a in body["agents"]]
        elif key == ("GET", "/v1/approvals"):
            names = [a["agent"] for a in body["approvals"]]
        else:
            names = [m["request_id"] for m in body["messages"]]
        tenants = {name.split("-", 1)[0] + "-" for name in names}
        assert tenants == ({caller.prefix} if caller.prefix else {INSIDE, OUTSIDE}), f"{caller}: {key} {names}"


@contextmanager
def matrix(api: Api, world: World, callers: list[Caller]) -> Iterator[Matrix]:
    running = Matrix(api, world, callers)
    try:
        yield running
    finally:
        running.close()


def live_operations(api: Api) -> list[tuple[str, str]]:
    """Every operation the running app serves, per its OpenAPI document — each must have an entry in the matrix."""
    with api.http() as http:
        paths = http.get("/openapi.json").json()["paths"]
    served = [(method.upper(), path) for path, ops in paths.items() for method in ops]
    missing = sorted(set(served) - MATRIX.keys())
    assert not missing, f"operations without an entry in the authorization matrix: {missing}"
    gone = sorted(MATRIX.keys() - set(served))
    assert not gone, f"matrix entries for operations the app no longer serves: {gone}"
    return served


@pytest.fixture
def server(db: Database, db_url: str, broker: Broker, tmp_path: Path) -> Iterator[Api]:
    """A real ``keel serve`` with room in every scope's rate and for failed tokens from one address (the matrix makes
    many calls per token, bad ones too; both limits have their own tests)."""
    roomy = {
        "KEEL_API_RATE_LIMITS": json.dumps({s: {"rate": 1000, "burst": 1000} for s in SCOPES}),
        "KEEL_CONSOLE_SIGNIN_BURST": "100000",
        "KEEL_CONSOLE_SIGNIN_GLOBAL_BURST": "100000",
    }
    with running_api(db, db_url, broker, tmp_path, env=roomy) as api:
        yield api


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


# --- the tests --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scope", SCOPES)
def test_each_scope_may_call_what_the_readme_says_in_its_prefix_and_nothing_else(
    scope: str, server: Api, client: Client
) -> None:
    operations = live_operations(server)
    world = World(server.db, client)
    callers = [
        Caller(scope, prefix, name, bearer(server.token(scope, prefix=prefix, name=name)))
        for prefix, name in ((INSIDE, f"{scope}-acme"), (None, f"{scope}-all"))
    ]
    with matrix(server, world, callers) as cases:
        cases.run(operations)
    assert len(cases.checked) == len(operations) * len(callers) * 2


def test_without_a_valid_token_every_operation_but_the_public_ones_is_401(server: Api, client: Client) -> None:
    operations = live_operations(server)
    world = World(server.db, client)
    callers = [
        Caller("none", None, None, {}),
        Caller("basic", None, None, {"Authorization": "Basic dXNlcjpwYXNz"}),
        Caller("malformed", None, None, bearer("not-a-keel-token")),
        Caller("unknown", None, None, bearer("keel_" + "A" * 43)),
    ]
    revoked = [
        Caller("revoked", prefix, name, bearer(server.token(*SCOPES, prefix=prefix, name=name)))
        for prefix, name in ((INSIDE, "revoked-acme"), (None, "revoked-all"))
    ]
    callers += revoked
    with matrix(server, world, callers) as cases:
        for caller in revoked:
            # Refused from the very next request on, on the same connection: no cache of tokens anywhere.
            http = cases.clients[str(caller)]
            assert http.get("/v1/tokens/me").status_code == 200
            revoke_token(server.db, caller.name or "", actor="test")
            problem(http.get("/v1/tokens/me"), 401, "unauthorized")
        cases.run(operations)
    assert len(cases.checked) == len(operations) * len(callers) * 2


def _agents_things(conn: psycopg.Connection[Any], agent_id: uuid.UUID) -> dict[str, Any]:
    """One agent's row, requests, jobs, messages and journal: what another tenant's submit must leave as it was."""
    queries = {
        "agent": "SELECT revision, phase, request_id FROM agents WHERE id = %s",
        "requests": "SELECT request_id, input, actor, submitted_at FROM requests WHERE agent_id = %s ORDER BY 1",
        "jobs": "SELECT key, status FROM jobs WHERE agent_id = %s ORDER BY key",
        "outbox": "SELECT key, status FROM outbox WHERE agent_id = %s ORDER BY key",
        "journal": "SELECT count(*), max(seq) FROM audit.journal WHERE agent_id = %s",
    }
    return {name: conn.execute(sql, (agent_id,)).fetchall() for name, sql in queries.items()}


def test_a_request_id_another_tenant_used_is_a_fresh_request_that_neither_touches_nor_names_theirs(
    server: Api, client: Client
) -> None:
    """Request ids are each agent's own: ours may be the id of another tenant's request, and is a new request of
    ours (not a conflict, not a replay of theirs) that reads nothing of theirs and changes nothing of theirs."""
    ask = script({"content": "hi"})
    theirs = client.create_agent(f"{OUTSIDE}secret-project", actor="setup")
    client.submit(theirs.id, "shared-1", ask, actor="setup")
    ours = client.create_agent(f"{INSIDE}worker", actor="setup")
    with (
        psycopg.connect(server.db.libpq_url, autocommit=True) as conn,
        server.http(server.token("producer", "auditor", prefix=INSIDE)) as http,
    ):
        their_before = _agents_things(conn, theirs.id)
        url = f"/v1/agents/{ours.id}/requests"
        fresh = http.post(url, json={"input": ask}, headers={"Idempotency-Key": "shared-1"})
        assert fresh.status_code == 201, fresh.text
        assert "Idempotent-Replayed" not in fresh.headers  # not their request played back
        body = fresh.json()
        assert (body["agent_id"], body["request_id"], body["revision"]) == (str(ours.id), "shared-1", 1)
        assert "globex" not in fresh.text and str(theirs.id) not in fresh.text
        assert _agents_things(conn, theirs.id) == their_before  # nothing of theirs moved
        again = http.post(url, json={"input": ask}, headers={"Idempotency-Key": "shared-1"})
        assert (again.status_code, again.headers.get("Idempotent-Replayed")) == (201, "true")
        assert again.content == fresh.content
        story = http.get(f"/v1/agents/{ours.id}/requests/shared-1/story").json()
        assert [j["key"] for j in story["jobs"]] == [scoped(ours.id, "shared-1:plan:1")]
        assert {e["agent_id"] for e in story["journal"]} == {str(ours.id)}
        # Looked up by id alone, the token finds its own agent's request: the other tenant's stays out of sight.
        found = http.get("/v1/requests/shared-1")
        assert found.status_code == 200 and found.json()["agent_id"] == str(ours.id)
        assert "globex" not in found.text and str(theirs.id) not in found.text
        journal = http.get(f"/v1/agents/{ours.id}/journal").text
        assert "globex" not in journal and str(theirs.id) not in journal
        assert http.get(f"/v1/agents/{theirs.id}/requests/shared-1").status_code == 404
    # Their request is still theirs: a retry of it is a duplicate on their agent, not a new request.
    assert client.submit(theirs.id, "shared-1", ask, actor="setup").revision == 1
    assert client.get_request(theirs.id, "shared-1").agent_id == theirs.id
