"""``HttpClient`` against a real ``keel serve``: a producer's code written for ``Client`` runs unchanged over HTTP,
refusals come back as Keel's own exceptions, and retries under network faults (injected by an HTTP proxy between
the two) never do anything twice."""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from agents.client import AccessDenied, ApiUnavailable, Client, HttpClient
from agents.core.errors import (
    AgentExists,
    AgentNotFound,
    IllegalTransition,
    InvalidInput,
    Rejected,
    RequestConflict,
    StaleRevision,
)
from agents.core.keys import request_key
from models.db import Database
from models.schemas import AgentState
from tests.support.api import COMMENT, Api, running_api, script
from tests.support.broker import Broker
from tests.support.http_proxy import FaultyProxy
from tests.support.keys import scoped
from tests.support.runs import run_all

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
HARD = datetime(2100, 1, 1, tzinfo=UTC)


def fast(url: str, secret: str, **kwargs: Any) -> HttpClient:
    """An HttpClient whose backoff is short enough for a test."""
    return HttpClient(url, secret, backoff_seconds=0.01, max_wait_seconds=2, **kwargs)


# --- runs unchanged -----------------------------------------------------------------------------------------------


def producer(keel: Client | HttpClient, db: Database, tag: str, me: str) -> dict[str, Any]:
    """A producer written against Client's interface: it never asks which client it got. What it saw, with the
    tag (names, request ids) taken out and the actor it expects the journal to name (``me``) written ``ME``, so two
    runs compare."""
    seen: dict[str, Any] = {}
    bot = keel.create_agent(f"{tag}-bot", budget_tokens=100_000, budget_cost="5.00", actor="alice")

    def unkeyed(key: str) -> str:
        """A key of the bot's request without its agent and tag (they differ between runs), checked to be there."""
        mine = request_key(bot.id, tag)
        assert key.startswith(mine), key
        return key.removeprefix(mine)

    seen["created"] = (bot.phase, bot.revision, bot.budget_tokens, bot.budget_cost)

    first = keel.submit(
        bot.id, f"{tag}-r1", COMMENT, soft_deadline=timedelta(minutes=5), hard_deadline=HARD, actor="alice"
    )
    seen["submitted"] = (first.phase, first.revision, first.hard_deadline == HARD, first.soft_deadline is not None)
    seen["pending"] = [unkeyed(j.key) for j in first.pending_jobs]
    again = keel.submit_request(
        bot.id, f"{tag}-r1", COMMENT, soft_deadline=timedelta(minutes=5), hard_deadline=HARD, actor="alice"
    )
    seen["retried"] = (again.replayed, again.state.revision, again.request.revision, again.request.submitted_by == me)

    state = keel.get_state(bot.id)
    for _ in range(10):
        if state.phase == "waiting_approval":
            break
        run_all(db)
        state = keel.get_state(f"{tag}-bot")
    seen["waiting"] = (state.phase, state.revision, state.pending_approval)
    try:
        keel.approve(bot.id, expected_revision=state.revision - 1, actor="alice")
    except StaleRevision as exc:
        seen["stale"] = (exc.expected_revision, exc.current_revision)
    approved = keel.approve(bot.id, expected_revision=state.revision, actor="alice")
    seen["approved"] = (approved.phase, approved.revision)
    run_all(db)
    done = keel.get_state(bot.id)
    seen["done"] = (done.phase, done.revision, done.spent_tokens)
    try:
        keel.cancel(bot.id, expected_revision=done.revision, actor="alice", reason="late")
    except IllegalTransition as exc:
        seen["illegal"] = (exc.phase, exc.event, exc.allowed)

    seen["journal"] = [
        (e.kind, e.event, e.from_phase, e.to_phase, e.revision, "ME" if e.actor == me else e.actor, e.request_id)
        for e in keel.journal(agent_id=bot.id)
    ]
    request_events = keel.journal(agent_id=bot.id, request_id=f"{tag}-r1")
    seen["request journal"] = [(e.kind, e.event, e.revision) for e in request_events]
    seen["jobs"] = [(unkeyed(j.key), j.status) for j in keel.request_jobs(bot.id, f"{tag}-r1")]
    messages = keel.request_messages(bot.id, f"{tag}-r1")
    seen["messages"] = [(unkeyed(m["key"]), m["channel"], m["status"]) for m in messages]
    record = keel.get_request(bot.id, f"{tag}-r1")
    seen["request"] = (record.operation, record.input, record.revision, record.hard_deadline == HARD)
    outcome = keel.outcome(bot.id, f"{tag}-r1")
    seen["outcome"] = (
        outcome.phase,
        outcome.revision,
        outcome.answer,
        outcome.failure,
        outcome.tokens,
        [(unkeyed(e.key), e.channel, e.destination, e.status) for e in outcome.side_effects],
    )

    second = keel.submit(bot.id, f"{tag}-r2", script({"content": "hi"}), actor="alice")
    cancelled = keel.cancel(bot.id, actor="alice", reason="changed my mind")
    seen["cancelled"] = (second.revision, cancelled.phase, cancelled.revision, cancelled.pending_jobs)
    failure = keel.outcome(bot.id, f"{tag}-r2").failure
    assert failure is not None
    seen["cancel outcome"] = (failure.event, failure.reason.replace(me, "ME"), failure.job)
    listed = keel.list_agents(phases=["failed"])
    seen["listed"] = [a.name.removeprefix(tag) for a in listed.agents if a.name.startswith(tag)]
    return seen


def test_a_producer_runs_unchanged_over_http(api: Api, client: Client) -> None:
    direct = producer(client, api.db, "direct", me="alice")
    # The journal's actor over HTTP is the token's name, whatever the producer passes as actor=.
    secret = api.token("operator", "approver", name="svc-ingest")
    with HttpClient(api.url, secret) as http:
        over_http = producer(http, api.db, "http", me="svc-ingest")

    for seen in (direct, over_http):  # request ids differ by the tag, as the names do
        seen["journal"] = [(*e[:6], e[6] and e[6].split("-", 1)[1]) for e in seen["journal"]]
    assert over_http == direct
    # and what was compared says what a producer sees
    assert [e[:2] for e in direct["journal"] if e[5] == "ME"] == [
        ("created", "create"),
        ("transition", "submit"),
        ("suppressed", "submit"),
        ("rejected", "approve"),
        ("transition", "approve"),
        ("rejected", "cancel"),
    ]
    assert direct["retried"] == (True, 1, 1, True)
    assert [channel for _, channel, _ in direct["messages"]] == ["github"]  # the approved comment, read back
    assert direct["waiting"][0] == "waiting_approval" and direct["done"][0] == "done"
    assert direct["stale"] == (direct["waiting"][1] - 1, direct["waiting"][1])
    assert "submit" in direct["illegal"][2] and direct["cancelled"][1] == "failed"
    # The outcome, through both doors: the answer, the spend and the comment not yet relayed; a cancel's reason.
    comment = (direct["messages"][0][0], "github", "acme/api#7", "pending")
    assert direct["outcome"] == ("done", direct["done"][1], "Commented.", None, direct["done"][2], [comment])
    assert direct["cancel outcome"] == ("cancel", "cancelled by ME: changed my mind", None)


def _shape(sig: inspect.Signature) -> tuple[list[tuple[str, Any]], Any]:
    return [(p.name, p.kind) for p in sig.parameters.values()], sig.return_annotation


def test_http_client_has_clients_signatures_and_names_what_it_leaves_out() -> None:
    # Client is assembled from mixins (agents/client/direct.py): its methods are those of every class it is made of.
    public = {name for cls in Client.__mro__ if cls is not object for name in vars(cls) if not name.startswith("_")}
    shared = public & set(vars(HttpClient))
    for name in sorted(shared):
        assert _shape(inspect.signature(getattr(HttpClient, name))) == _shape(
            inspect.signature(getattr(Client, name))
        ), name
    client_only = public - shared
    assert client_only == {
        "agent_row",
        "agent_names",
        "journal_after",
        "journal_page",
        "journal_agent",
        "request_agents",
        "archive",
        "unarchive",
        "delete_agent",
        "from_settings",
    }
    doc = inspect.getdoc(HttpClient) or ""
    for name in client_only:
        assert f"``{name}``" in doc, f"HttpClient's docstring does not say why it has no {name}"


# --- errors -------------------------------------------------------------------------------------------------------


def waiting(keel: HttpClient, db: Database, name: str) -> AgentState:
    bot = keel.create_agent(name)
    keel.submit(bot.id, f"{name}-r1", COMMENT)
    run_all(db)
    state = keel.get_state(bot.id)
    assert state.phase == "waiting_approval", state
    return state


def detail(http: httpx.Client, method: str, path: str, **kwargs: Any) -> str:
    """The server's own detail for this refusal."""
    response = http.request(method, path, **kwargs)
    assert response.status_code >= 400
    return str(response.json()["detail"])


def test_refusals_come_back_as_keels_exceptions_with_the_servers_facts(api: Api) -> None:
    secret = api.token("operator", "approver", name="alice")
    with HttpClient(api.url, secret) as keel, api.http(secret) as http:
        state = waiting(keel, api.db, "w1")
        url = f"/v1/agents/{state.id}"

        with pytest.raises(StaleRevision) as stale:
            keel.approve(state.id, expected_revision=state.revision - 1)
        assert (stale.value.current_revision, stale.value.expected_revision) == (state.revision, state.revision - 1)
        assert stale.value.current_state == state  # type: ignore[attr-defined]
        assert str(stale.value) == detail(
            http, "POST", f"{url}/approve", headers={"If-Match": f'"r{state.revision - 1}"'}
        )

        idle = keel.create_agent("idle")
        with pytest.raises(IllegalTransition) as illegal:
            keel.approve(idle.id, expected_revision=0)
        assert (illegal.value.phase, illegal.value.event) == ("idle", "approve")
        assert "submit" in illegal.value.allowed
        assert str(illegal.value) == detail(http, "POST", f"/v1/agents/{idle.id}/approve", headers={"If-Match": '"r0"'})

        keel.submit(idle.id, "i-1", script({"content": "hi"}))
        with pytest.raises(RequestConflict) as conflict:
            keel.submit(idle.id, "i-1", script({"content": "bye"}))
        assert conflict.value.differs == ("input",) and conflict.value.request_id == "i-1"

        with pytest.raises(AgentNotFound) as missing:
            keel.get_state("nobody")
        assert str(missing.value) == detail(http, "GET", "/v1/agents/nobody")
        assert missing.value.deleted is None

        with pytest.raises(AgentExists) as taken:
            keel.create_agent("idle")
        assert "idle" in str(taken.value)

        with pytest.raises(InvalidInput) as invalid:
            keel.submit(idle.id, "i-2", {"script": "not a list"})
        assert "prompt" in str(invalid.value) or "script" in str(invalid.value)

        # Approve always sends If-Match; the API's 428 without it maps to Rejected all the same.
        required = http.post(f"{url}/approve")
        assert required.status_code == 428
        assert type(keel._error(required)) is Rejected
        assert str(keel._error(required)) == required.json()["detail"]

    with HttpClient(api.url, "keel_not-a-token") as stranger, pytest.raises(AccessDenied) as unknown:
        stranger.get_state(state.id)
    assert unknown.value.status == 401
    with HttpClient(api.url, api.token("producer")) as producer_only, pytest.raises(AccessDenied) as scope:
        producer_only.approve(state.id, expected_revision=state.revision)
    assert scope.value.status == 403 and "approve" in str(scope.value)
    assert Client(api.db).get_state(state.id).revision == state.revision  # nothing changed on any refusal


# --- retries under faults -----------------------------------------------------------------------------------------


@pytest.fixture
def proxy(api: Api) -> Iterator[FaultyProxy]:
    with FaultyProxy(api.url) as faulty:
        yield faulty


def submits(client: Client, agent: Any) -> list[str]:
    return [e.kind for e in client.journal(agent_id=agent) if e.event == "submit"]


def test_a_submit_reset_before_it_reaches_the_server_is_sent_again_once(
    api: Api, client: Client, proxy: FaultyProxy
) -> None:
    with fast(proxy.url, api.token("producer")) as keel:
        bot = keel.create_agent("bot")
        path = f"/v1/agents/{bot.id}/requests"
        proxy.fail("POST", path, "reset", "reset")
        state = keel.submit(bot.id, "r-1", script({"content": "hi"}))
    assert (state.phase, state.revision) == ("planning", 1)
    assert proxy.outcomes("POST", path) == ["reset", "reset", "201"]
    assert submits(client, bot.id) == ["transition"]


def test_a_submit_whose_answer_was_lost_is_replayed_not_run_again(api: Api, client: Client, proxy: FaultyProxy) -> None:
    with fast(proxy.url, api.token("producer", name="ingest")) as keel:
        bot = keel.create_agent("bot")
        path = f"/v1/agents/{bot.id}/requests"
        proxy.fail("POST", path, "lose")
        done = keel.submit_request(bot.id, "r-1", script({"content": "hi"}), hard_deadline=timedelta(hours=1))
    assert proxy.outcomes("POST", path) == ["201 lost", "201"]
    assert (done.state.phase, done.state.revision) == ("planning", 1)
    assert (done.request.request_id, done.request.revision, done.request.submitted_by) == ("r-1", 1, "ingest")
    assert done.replayed  # the API answered the retry with the original record
    assert submits(client, bot.id) == ["transition", "suppressed"]  # applied once; the retry changed nothing
    assert [j.key for j in client.request_jobs(bot.id, "r-1")] == [scoped(bot.id, "r-1:plan:1")]


def test_503_twice_is_retried_with_the_same_key_and_applied_once(api: Api, client: Client, proxy: FaultyProxy) -> None:
    with fast(proxy.url, api.token("producer")) as keel:
        bot = keel.create_agent("bot")
        path = f"/v1/agents/{bot.id}/requests"
        proxy.fail("POST", path, "503", "503")
        state = keel.submit(bot.id, "r-1", script({"content": "hi"}))
        assert proxy.outcomes("POST", path) == ["503", "503", "201"]
        assert (state.phase, state.revision) == ("planning", 1)
        assert submits(client, bot.id) == ["transition"]

        proxy.fail("GET", f"/v1/agents/{bot.id}", *["503"] * 6)
        with pytest.raises(ApiUnavailable):
            keel.get_state(bot.id)  # past its retries (5): the caller hears of it


def test_a_create_whose_answer_was_lost_returns_the_agent_it_created(
    api: Api, client: Client, proxy: FaultyProxy
) -> None:
    with fast(proxy.url, api.token("producer", name="ingest")) as keel:
        proxy.fail("POST", "/v1/agents", "lose")
        bot = keel.create_agent("bot")
        assert proxy.outcomes("POST", "/v1/agents") == ["201 lost", "409"]
        assert (bot.name, bot.revision) == ("bot", 0)
        with pytest.raises(AgentExists):  # one that was there before is still refused
            keel.create_agent("bot")
    client.create_agent("theirs")
    with fast(proxy.url, api.token("producer", name="other")) as keel, pytest.raises(AgentExists):
        proxy.fail("POST", "/v1/agents", "lose")
        keel.create_agent("theirs")  # lost answer or not, another's agent of that name is not ours


def test_an_approve_whose_answer_was_lost_is_recognised_as_its_own(api: Api, proxy: FaultyProxy) -> None:
    secret = api.token("approver", "producer", name="alice")
    with fast(proxy.url, secret) as keel:
        state = waiting(keel, api.db, "w1")
        path = f"/v1/agents/{state.id}/approve"
        proxy.fail("POST", path, "lose")
        approved = keel.approve(state.id, expected_revision=state.revision)
    assert proxy.outcomes("POST", path) == ["200 lost", "412"]
    assert (approved.phase, approved.revision) == ("executing", state.revision + 1)
    events = Client(api.db).journal(agent_id=state.id)
    assert [(e.event, e.actor) for e in events if e.kind == "transition"][-1] == ("approve", "alice")


def test_an_approve_beaten_by_someone_else_is_still_stale(api: Api, proxy: FaultyProxy) -> None:
    with fast(proxy.url, api.token("approver", "producer", name="alice")) as alice:
        state = waiting(alice, api.db, "w1")
        with fast(api.url, api.token("approver", name="bob")) as bob:
            bob.approve(state.id, expected_revision=state.revision)
        path = f"/v1/agents/{state.id}/approve"
        proxy.fail("POST", path, "reset")  # alice's outcome unknown; her retry finds the agent moved on
        with pytest.raises(StaleRevision) as stale:
            alice.approve(state.id, expected_revision=state.revision)
    assert proxy.outcomes("POST", path) == ["reset", "412"]
    assert stale.value.current_revision == state.revision + 1


def test_a_cancel_without_a_revision_whose_answer_was_lost_returns_the_state(
    api: Api, client: Client, proxy: FaultyProxy
) -> None:
    with fast(proxy.url, api.token("operator", name="ops")) as keel:
        bot = keel.create_agent("bot")
        keel.submit(bot.id, "r-1", script({"content": "hi"}))
        path = f"/v1/agents/{bot.id}/cancel"
        proxy.fail("POST", path, "lose")
        cancelled = keel.cancel(bot.id, reason="stop")
        assert proxy.outcomes("POST", path) == ["200 lost", "409"]
        assert (cancelled.phase, cancelled.revision) == ("failed", 2)
        with pytest.raises(IllegalTransition):  # a cancel of a request that is over is refused as with Client
            keel.cancel(bot.id)


def test_429_waits_its_retry_after_and_goes_through(db: Database, db_url: str, broker: Broker, tmp_path: Path) -> None:
    limits = {"KEEL_API_RATE_LIMITS": json.dumps({"producer": {"rate": 2, "burst": 1}})}
    with running_api(db, db_url, broker, tmp_path, env=limits) as api, FaultyProxy(api.url) as proxy:
        with fast(proxy.url, api.token("producer")) as keel:
            bot = keel.create_agent("bot")
            state = keel.submit(bot.id, "r-1", script({"content": "hi"}))  # a POST, then a GET at once
        assert (state.phase, state.revision) == ("planning", 1)
        statuses = [s.outcome for s in proxy.seen]
        assert "429" in statuses and statuses.count("201") == 2, statuses
        assert submits(Client(db), bot.id) == ["transition"]


# --- following the journal ----------------------------------------------------------------------------------------


def test_follow_journal_gets_existing_then_live_events_across_a_dropped_stream(
    api: Api, client: Client, proxy: FaultyProxy
) -> None:
    bot = client.create_agent("watched")
    client.submit(bot.id, "f-1", script({"content": "hi"}), actor="p")
    client.cancel(bot.id, actor="o")
    with fast(proxy.url, api.token("producer")) as keel:
        events = keel.follow_journal(agent_id=bot.id)
        existing = [next(events) for _ in range(3)]
        assert [(e.seq, e.event) for e in existing] == [(1, "create"), (2, "submit"), (3, "cancel")]

        proxy.cut()  # the stream drops; four transitions commit, two of them before anyone reconnects
        client.submit(bot.id, "f-2", script({"content": "hi"}), actor="p")
        client.cancel(bot.id, actor="o")
        later = [next(events) for _ in range(2)]

        live = threading.Thread(
            target=lambda: (
                client.submit(bot.id, "f-3", script({"content": "hi"}), actor="p"),
                client.cancel(bot.id, actor="o"),
            )
        )
        live.start()
        later += [next(events) for _ in range(2)]
        live.join()
        events.close()  # type: ignore[attr-defined]
    assert [(e.seq, e.event, e.request_id) for e in later] == [
        (4, "submit", "f-2"),
        (5, "cancel", "f-2"),
        (6, "submit", "f-3"),
        (7, "cancel", "f-3"),
    ]
    streams = proxy.outcomes("GET", f"/v1/agents/{bot.id}/events")
    assert len(streams) >= 2, streams  # it did reconnect


# --- the documentation --------------------------------------------------------------------------------------------


def test_the_docs_http_client_example_runs_as_written(
    api: Api, client: Client, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/how-to/python-client.md's HttpClient example, taken from the page itself."""
    page = (ROOT / "docs" / "how-to" / "python-client.md").read_text()
    block = page.split("<!-- http-client-example", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.setenv("KEEL_API_URL", api.url)
    monkeypatch.setenv("KEEL_API_TOKEN", api.token("producer", name="ingest"))
    exec(compile(block, "docs/how-to/python-client.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        "req-7 True",
        "1 created create ingest",
        "2 transition submit ingest",
    ]
    state = client.get_state("triage-bot")  # its own agent: the Client example's ops-bot and req-42 do not collide
    assert (state.phase, state.revision, state.request_id) == ("planning", 1, "req-7")
    assert [(e.event, e.actor) for e in client.journal(agent_id=state.id) if e.kind == "transition"] == [
        ("submit", "ingest")
    ]
