"""``HttpClient``: the producer API over Keel's HTTP API, with :class:`~agents.client.Client`'s methods, signatures,
return types and errors."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from decimal import Decimal
from typing import Any
from urllib.parse import quote, unquote
from uuid import UUID

import httpx
from httpx_sse import connect_sse

from agents.client.checks import AgentRef, Deadline, check_deadline
from agents.client.errors import ApiUnavailable
from agents.client.problems import problem_error, problem_kind
from agents.core import journal as journal_mod
from agents.core.commands import check_text
from agents.core.errors import InvalidInput, KeelError
from agents.core.keys import check_request_id
from models.schemas import (
    AgentPage,
    AgentState,
    ApprovalPage,
    JobView,
    JournalEvent,
    RequestOutcome,
    RequestRecord,
    Submission,
    SubmittedRequest,
)

#: How long an event stream may stay silent before it is taken for dead and reopened (the API sends a keep-alive
#: comment every 15 s while nothing happens).
_STREAM_SILENCE_SECONDS = 60.0


class HttpClient:
    """:class:`~agents.client.Client`'s producer and person methods over Keel's HTTP API, with the same signatures,
    return types and errors: ``HttpClient("https://keel.example", token)``. Network errors, 5xx and 429 are retried
    safely; the journal's actor is the token's name, never ``actor=``. Only ``Client`` has ``archive``,
    ``unarchive``, ``delete_agent``, ``agent_row``, ``agent_names``, ``journal_after``, ``journal_page``,
    ``journal_agent``, ``request_agents`` and ``from_settings``. Why, and how it retries and what it raises:
    docs/explanation/clients.md#the-http-client."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: float = 30.0,
        retries: int = 5,
        backoff_seconds: float = 0.2,
        max_wait_seconds: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not token:
            raise InvalidInput("token must be an API token (keel token create NAME --scope …)")
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.backoff_seconds = backoff_seconds
        self.max_wait_seconds = max_wait_seconds
        self._name: str | None = None
        # A live stream is quiet between events but for the API's keep-alive comments: a longer silence is a
        # connection that died without a word, and the stream is reopened from the last event read.
        self._stream_timeout = httpx.Timeout(timeout, read=max(timeout, _STREAM_SILENCE_SECONDS))
        self._http = httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {token}", "Accept": "application/json"},
            timeout=timeout,
            transport=transport,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> HttpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- plumbing ---------------------------------------------------------------------------------------------

    def _call(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        ambiguous: Callable[[httpx.Response], Any] | None = None,
    ) -> httpx.Response:
        """One API call, retried on network errors, 5xx and 429. ``ambiguous`` decides a refusal that followed an
        attempt whose outcome is unknown (sent, no answer or a 5xx): true if that attempt is what was applied."""
        unknown_outcome = False
        for attempt in range(self.retries + 1):
            try:
                response = self._http.request(method, path, json=json_body, params=params, headers=headers)
            except httpx.TransportError as exc:
                # A connect error never reached the server; any other may have been applied there.
                unknown_outcome = unknown_outcome or not isinstance(exc, httpx.ConnectError)
                if attempt == self.retries:
                    raise ApiUnavailable(f"{method} {path}: {type(exc).__name__}: {exc}") from None
                time.sleep(self._backoff(attempt))
                continue
            if response.status_code == 429 and attempt < self.retries:
                time.sleep(self._retry_after(response, attempt))
                continue
            if response.status_code >= 500 and attempt < self.retries:
                unknown_outcome = True
                time.sleep(self._backoff(attempt))
                continue
            if response.is_success or response.status_code == 304:
                return response
            if unknown_outcome and ambiguous is not None and ambiguous(response):
                return response
            raise self._error(response)
        raise AssertionError("unreachable")  # pragma: no cover

    def _backoff(self, attempt: int) -> float:
        return float(min(self.backoff_seconds * 2**attempt, self.max_wait_seconds))

    def _retry_after(self, response: httpx.Response, attempt: int) -> float:
        """The wait a 429 asks for (whole seconds, as Keel sends it), at most ``max_wait_seconds``."""
        try:
            wait = float(response.headers.get("Retry-After", ""))
        except ValueError:
            return self._backoff(attempt)
        return min(max(wait, 0.0), self.max_wait_seconds)

    def _error(self, response: httpx.Response) -> KeelError:
        try:
            body = response.json()
        except ValueError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        detail = str(body.get("detail") or response.reason_phrase or f"HTTP {response.status_code}")
        kind = str(body.get("type", "")).rsplit("/", 1)[-1]
        segments = response.request.url.path.split("/")
        agent = unquote(segments[3]) if segments[1:3] == ["v1", "agents"] and len(segments) > 3 else None
        return problem_error(response.status_code, kind, detail, body, agent=agent)

    # --- reads ------------------------------------------------------------------------------------------------

    def get_state(self, agent: AgentRef) -> AgentState:
        return AgentState.model_validate(self._call("GET", f"/v1/agents/{_ref(agent)}").json())

    def list_agents(
        self,
        *,
        phases: Sequence[str] = (),
        archived: bool = False,
        limit: int | None = None,
        after: str | None = None,
        name_prefix: str | None = None,
    ) -> AgentPage:
        """As :meth:`Client.list_agents`; ``limit=None`` pages through every agent the token sees."""
        params: dict[str, Any] = {"phase": list(phases), "archived": archived}
        if name_prefix is not None:
            raise InvalidInput("name_prefix is the token's over HTTP (keel token create --agent-prefix)")
        found: list[AgentState] = []
        cursor = after
        while True:
            page_size = 1000 if limit is None else min(limit - len(found), 1000)
            body = self._call(
                "GET", "/v1/agents", params={**params, "limit": page_size, **({"cursor": cursor} if cursor else {})}
            ).json()
            page = AgentPage.model_validate(body)
            found.extend(page.agents)
            cursor = page.next
            if cursor is None or (limit is not None and len(found) >= limit):
                return AgentPage(agents=tuple(found), next=cursor)

    def get_request(self, agent: AgentRef, request_id: str) -> RequestRecord:
        """As :meth:`Client.get_request`."""
        check_request_id(request_id)
        body = self._call("GET", f"/v1/agents/{_ref(agent)}/requests/{request_id}").json()
        return RequestRecord.model_validate(body)

    def outcome(self, agent: AgentRef, request_id: str) -> RequestOutcome:
        """As :meth:`Client.outcome` (the ``outcome`` of ``GET …/requests/{id}``)."""
        check_request_id(request_id)
        body = self._call("GET", f"/v1/agents/{_ref(agent)}/requests/{request_id}").json()
        return RequestOutcome.model_validate(body["outcome"])

    def _story(self, agent: AgentRef, request_id: str) -> dict[str, Any]:
        check_request_id(request_id)
        return dict(self._call("GET", f"/v1/agents/{_ref(agent)}/requests/{request_id}/story").json())

    def request_jobs(self, agent: AgentRef, request_id: str) -> list[JobView]:
        return [JobView.model_validate(j) for j in self._story(agent, request_id)["jobs"]]

    def request_messages(self, agent: AgentRef, request_id: str) -> list[dict[str, Any]]:
        return list(self._story(agent, request_id)["outbox"])

    def conversation(self, agent: AgentRef, request_id: str) -> list[dict[str, Any]]:
        """As :meth:`Client.conversation` (part of the request's story: a token that may read it)."""
        said = self._story(agent, request_id)["conversation"]
        return [{k: v for k, v in m.items() if v is not None} for m in said]

    def journal(
        self, *, agent_id: AgentRef | None = None, request_id: str | None = None, limit: int | None = None
    ) -> list[JournalEvent]:
        """An agent's journal (``agent_id``), or one of its requests' events (with ``request_id``), oldest first."""
        journal_mod.request_scope(agent_id, request_id)
        if request_id is not None:
            assert agent_id is not None
            found = [JournalEvent.model_validate(e) for e in self._story(agent_id, request_id)["journal"]]
            return found[:limit] if limit is not None else found
        if agent_id is None:
            raise InvalidInput("over HTTP the journal is read per agent (agent_id) or per request (request_id)")
        events: list[JournalEvent] = []
        after = 0
        while True:
            page_size = 1000 if limit is None else min(limit - len(events), 1000)
            body = self._call(
                "GET", f"/v1/agents/{_ref(agent_id)}/journal", params={"after": after, "limit": page_size}
            ).json()
            events.extend(JournalEvent.model_validate(e) for e in body["events"])
            if body["next"] is None or (limit is not None and len(events) >= limit):
                return events
            after = body["next"]

    def follow_journal(
        self, *, agent_id: AgentRef | None = None, request_id: str | None = None, poll_seconds: float = 0.5
    ) -> Iterator[JournalEvent]:
        """Every journal event of the agent, oldest first, then each new one as it commits (the API's Server-Sent
        Events; a dropped stream resumes from the last event seen, so none is skipped or repeated)."""
        if agent_id is None:
            raise InvalidInput("over HTTP an agent is followed (agent_id)")
        path = f"/v1/agents/{_ref(agent_id)}/events"
        self.get_state(agent_id)  # an unknown agent raises AgentNotFound here, not at the first event

        def follow() -> Iterator[JournalEvent]:
            last = 0
            failures = 0
            while True:
                try:
                    stream = connect_sse(self._http, "GET", path, params={"after": last}, timeout=self._stream_timeout)
                    with stream as source:
                        answer = source.response
                        if answer.status_code == 429 or answer.status_code >= 500:
                            answer.read()
                            failures += 1
                            if failures > self.retries:
                                raise self._error(answer)
                            time.sleep(self._retry_after(answer, failures - 1))
                            continue
                        if answer.status_code != 200:
                            answer.read()
                            raise self._error(answer)
                        for sse in source.iter_sse():
                            if not sse.id:
                                continue
                            event = JournalEvent.model_validate_json(sse.data)  # the whole event: see event_data
                            last = event.seq
                            failures = 0
                            if request_id is None or event.request_id == request_id:
                                yield event
                except httpx.TransportError:
                    failures += 1
                    if failures > self.retries:
                        raise ApiUnavailable(f"GET {path}: the event stream kept failing") from None
                    time.sleep(max(poll_seconds, self._backoff(failures - 1)))

        return follow()

    # --- commands ---------------------------------------------------------------------------------------------

    def create_agent(
        self,
        name: str,
        *,
        budget_tokens: int | None = None,
        budget_cost: Decimal | float | str | None = None,
        actor: str = "client",
    ) -> AgentState:
        """As :meth:`Client.create_agent`; the journal's actor is the token's name (``actor`` is ignored). A retry
        that finds the name taken returns the agent if this token created it, else raises :class:`AgentExists`."""
        check_text("name", name)
        body = {"name": name, "budget_tokens": budget_tokens, "budget_cost": _decimal(budget_cost)}

        def applied(response: httpx.Response) -> bool:
            if problem_kind(response) != "agent-exists":
                return False
            return self._creator(self.get_state(name).id) == self._token_name()

        response = self._call("POST", "/v1/agents", json_body=body, ambiguous=applied)
        if not response.is_success:  # created by the attempt whose answer was lost
            return self.get_state(name)
        return AgentState.model_validate(response.json())

    def submit(
        self,
        agent_id: AgentRef,
        request_id: str,
        input: Any,
        *,
        expected_revision: int | None = None,
        soft_deadline: Deadline = None,
        hard_deadline: Deadline = None,
        actor: str = "client",
        operation: str = "plan",
    ) -> AgentState:
        """As :meth:`Client.submit` (the state is read right after the submit)."""
        return self.submit_request(
            agent_id,
            request_id,
            input,
            expected_revision=expected_revision,
            soft_deadline=soft_deadline,
            hard_deadline=hard_deadline,
            actor=actor,
            operation=operation,
        ).state

    def submit_request(
        self,
        agent_id: AgentRef,
        request_id: str,
        input: Any,
        *,
        expected_revision: int | None = None,
        soft_deadline: Deadline = None,
        hard_deadline: Deadline = None,
        actor: str = "client",
        operation: str = "plan",
    ) -> Submission:
        """As :meth:`Client.submit_request`. ``replayed`` is the API's ``Idempotent-Replayed``: true too when this
        call's own first attempt was applied and its answer lost."""
        done = self.submit_record(
            agent_id,
            request_id,
            input,
            expected_revision=expected_revision,
            soft_deadline=soft_deadline,
            hard_deadline=hard_deadline,
            actor=actor,
            operation=operation,
        )
        return Submission(request=done.request, state=self.get_state(done.request.agent_id), replayed=done.replayed)

    def submit_record(
        self,
        agent_id: AgentRef,
        request_id: str,
        input: Any,
        *,
        expected_revision: int | None = None,
        soft_deadline: Deadline = None,
        hard_deadline: Deadline = None,
        actor: str = "client",
        operation: str = "plan",
    ) -> SubmittedRequest:
        """As :meth:`Client.submit_record`: one POST, the request as first submitted (no read of the state)."""
        check_request_id(request_id)
        body: dict[str, Any] = {"input": input, "operation": operation}
        for name, value in (("soft_deadline", soft_deadline), ("hard_deadline", hard_deadline)):
            checked = check_deadline(name, value)
            if isinstance(checked, timedelta):
                body[f"{name}_seconds"] = checked.total_seconds()
            elif checked is not None:
                body[name] = checked.isoformat()
        headers = {"Idempotency-Key": request_id}
        if expected_revision is not None:
            headers["If-Match"] = f'"r{expected_revision}"'
        response = self._call("POST", f"/v1/agents/{_ref(agent_id)}/requests", json_body=body, headers=headers)
        return SubmittedRequest(
            request=RequestRecord.model_validate(response.json()),
            replayed=response.headers.get("Idempotent-Replayed") == "true",
        )

    def approve(
        self,
        agent_id: AgentRef,
        *,
        expected_revision: int,
        actor: str = "client",
        arguments: Mapping[str, Any] | None = None,
    ) -> AgentState:
        """As :meth:`Client.approve`; the journal's actor is the token's name."""
        return self._decide(agent_id, "approve", expected_revision, None, arguments=arguments)

    def approvals(
        self,
        *,
        tool: str | None = None,
        min_age: timedelta | None = None,
        agent_prefix: str | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> ApprovalPage:
        """As :meth:`Client.approvals`; a token limited to an agent prefix sees its agents' calls only."""
        params: dict[str, Any] = {"limit": limit}
        if tool is not None:
            params["tool"] = tool
        if min_age is not None:
            params["min_age_seconds"] = min_age.total_seconds()
        if agent_prefix is not None:
            params["agent_prefix"] = agent_prefix
        if after is not None:
            params["cursor"] = after
        return ApprovalPage.model_validate(self._call("GET", "/v1/approvals", params=params).json())

    def reject(
        self, agent_id: AgentRef, *, expected_revision: int, actor: str = "client", reason: str | None = None
    ) -> AgentState:
        return self._decide(agent_id, "reject", expected_revision, reason)

    def cancel(
        self,
        agent_id: AgentRef,
        *,
        expected_revision: int | None = None,
        actor: str = "client",
        reason: str | None = None,
    ) -> AgentState:
        return self._decide(agent_id, "cancel", expected_revision, reason)

    def dead_messages(self, agent: AgentRef) -> int:
        """As :meth:`Client.dead_messages` (``GET /v1/outbox?status=dead&agent=…``, every page: a token that may read
        the outbox)."""
        check_text("agent", str(agent), limit=200)
        found, cursor = 0, None
        while True:
            params = {"status": "dead", "agent": str(agent), "limit": 1000, **({"cursor": cursor} if cursor else {})}
            page = self._call("GET", "/v1/outbox", params=params).json()
            found += len(page["messages"])
            cursor = page.get("next")
            if cursor is None:
                return found

    def retry_outbox(self, key: str, *, actor: str = "client") -> None:
        check_text("key", key, limit=600)
        self._call("POST", f"/v1/outbox/{quote(key, safe='')}/retry")

    def _decide(
        self,
        agent: AgentRef,
        act: str,
        expected: int | None,
        reason: str | None,
        *,
        arguments: Mapping[str, Any] | None = None,
    ) -> AgentState:
        headers = {} if expected is None else {"If-Match": f'"r{expected}"'}
        path = f"/v1/agents/{_ref(agent)}/{act}"
        body: dict[str, Any] | None = {"reason": reason}
        if act == "approve":
            body = None if arguments is None else {"arguments": dict(arguments)}

        def applied(response: httpx.Response) -> bool:
            # Whether an earlier attempt, its answer lost, is what moved the agent on
            # (docs/explanation/clients.md#retries-and-lost-answers): with If-Match the revision it made, else the
            # agent's latest.
            if expected is not None:
                return response.status_code == 412 and self._mine(agent, expected + 1, act)
            if problem_kind(response) != "illegal-transition":
                return False
            state = self.get_state(agent)
            return self._mine(agent, state.revision, act, request_id=state.request_id)

        response = self._call("POST", path, json_body=body, headers=headers, ambiguous=applied)
        if not response.is_success:  # applied by the attempt whose answer was lost
            return self.get_state(agent)
        return AgentState.model_validate(response.json())

    def _mine(self, agent: AgentRef, revision: int, event: str, *, request_id: str | None = None) -> bool:
        """Whether the transition that brought the agent to ``revision`` is this token's ``event``."""
        found = self._call("GET", f"/v1/agents/{_ref(agent)}/journal", params={"revision": revision}).json()
        return any(
            e["kind"] == "transition"
            and e["event"] == event
            and e["actor"] == self._token_name()
            and (request_id is None or e["request_id"] == request_id)
            for e in found["events"]
        )

    def _token_name(self) -> str:
        """The token's name: the actor the journal records for what it does."""
        if self._name is None:
            self._name = str(self._call("GET", "/v1/tokens/me").json()["name"])
        return self._name

    def _creator(self, agent_id: UUID) -> str:
        """The actor of the agent's first journal event, read from its event stream (a producer may watch an agent
        but not read its journal)."""
        path = f"/v1/agents/{agent_id}/events"
        with connect_sse(self._http, "GET", path, params={"after": 0}, timeout=self._stream_timeout) as source:
            if source.response.status_code != 200:
                source.response.read()
                raise self._error(source.response)
            for sse in source.iter_sse():
                if sse.id:
                    return str(json.loads(sse.data)["actor"])
        raise ApiUnavailable(f"GET {path}: the stream ended before the agent's first event")


def _ref(agent: AgentRef) -> str:
    text = str(agent)
    check_text("agent", text, limit=200)
    return quote(text, safe="")


def _decimal(value: Decimal | float | str | None) -> str | None:
    return None if value is None else str(value)
