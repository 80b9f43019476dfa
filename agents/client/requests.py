"""The direct client's requests: submit one (checked, idempotent, published at once if it can be), read it back,
read its jobs, cancel it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from agents.client.base import ClientBase, Publisher, log
from agents.client.checks import AgentRef, Deadline, as_uuid, check_actor, check_deadline, check_reason
from agents.core import transition as core
from agents.core.commands import Command, JobSpec, check_json_text, check_text
from agents.core.errors import AgentNotFound, InvalidInput, RequestNotFound
from agents.core.json_input import check_depth
from agents.core.keys import check_request_id, split_key
from agents.core.phases import Event
from agents.core.request_outcome import outcome_of
from agents.jobs import handlers
from agents.runtime.conversations import conversation_of
from models.jobs_sql import Due, request_jobs, request_steps, unpublish
from models.outcome_sql import request_outcome_parts
from models.schemas import (
    AgentRow,
    AgentState,
    JobView,
    RequestOutcome,
    RequestRecord,
    Submission,
    SubmittedRequest,
)
from models.sql import request_agents, request_record


class RequestsMixin(ClientBase):
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
        """Start request ``request_id`` on an idle, done or failed agent; its first job is ``operation`` (key
        ``{request}:{operation}:1``), given the input as ``payload["input"]``. Input that does not fit the
        operation raises :class:`InvalidInput`, an unknown operation :class:`UnknownOperation`; a repeat changes
        nothing, a different one under the same id raises :class:`RequestConflict`. See
        docs/explanation/clients.md#submitting-a-request."""
        done = self._submit(
            agent_id,
            request_id,
            input,
            expected_revision=expected_revision,
            soft_deadline=soft_deadline,
            hard_deadline=hard_deadline,
            actor=actor,
            operation=operation,
            with_jobs=True,
        )
        return self._state(done.agent, done.jobs)

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
        """:meth:`submit`, returning the request as first submitted, the agent's state now, and whether this call
        was a retry that changed nothing (``replayed``)."""
        done = self._submit(
            agent_id,
            request_id,
            input,
            expected_revision=expected_revision,
            soft_deadline=soft_deadline,
            hard_deadline=hard_deadline,
            actor=actor,
            operation=operation,
            with_jobs=True,
        )
        return Submission(
            state=self._state(done.agent, done.jobs), request=self._record(done), replayed=done.suppressed
        )

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
        """:meth:`submit_request` without reading the agent's state (one query fewer): what the HTTP ingress uses."""
        done = self._submit(
            agent_id,
            request_id,
            input,
            expected_revision=expected_revision,
            soft_deadline=soft_deadline,
            hard_deadline=hard_deadline,
            actor=actor,
            operation=operation,
        )
        return SubmittedRequest(request=self._record(done), replayed=done.suppressed)

    def get_request(self, agent: AgentRef, request_id: str) -> RequestRecord:
        """The agent's request as submitted: operation, input, deadlines, who submitted it and when, and the agent's
        revision after the submit. Raises :class:`RequestNotFound`."""
        check_request_id(request_id)
        agent_id = self._chain_id(agent)
        with core.store_errors(), self.db.autocommit() as plain:
            row = request_record(plain.connection, agent_id, request_id)
        if row is None or row["details"] is None:
            raise RequestNotFound(request_id)
        details = row["details"]
        jobs = details.get("jobs")
        return RequestRecord(
            request_id=row["request_id"],
            agent_id=row["agent_id"],
            operation=split_key(jobs[0])[1] if jobs else "plan",  # its first job's; a submit without one: plan
            input=row["input"],
            soft_deadline=details.get("soft_deadline"),
            hard_deadline=details.get("hard_deadline"),
            submitted_at=row["submitted_at"],
            submitted_by=row["actor"],
            revision=row["revision"],
        )

    def outcome(self, agent: AgentRef, request_id: str) -> RequestOutcome:
        """How the agent's request ``request_id`` stands or ended: its phase, the answer (done), why it failed
        (failed), what its steps spent, and its Slack/GitHub side effects with their delivery — dead ones
        included. Raises :class:`RequestNotFound`."""
        check_request_id(request_id)
        agent_id = self._chain_id(agent)
        with core.store_errors():
            parts = request_outcome_parts(self.db, agent_id, request_id)
        if parts is None:
            raise RequestNotFound(request_id)
        return outcome_of(agent_id, request_id, parts)

    def request_agents(self, request_id: str) -> list[UUID]:
        """The agents that have a request ``request_id``, first submitted first (request ids are each agent's own)."""
        check_request_id(request_id)
        with core.store_errors(), self.db.autocommit() as plain:
            return request_agents(plain.connection, request_id)

    def conversation(self, agent: AgentRef, request_id: str) -> list[dict[str, Any]]:
        """The conversation of the agent's request ``request_id`` as far as its steps recorded it: the prompt, the
        model's replies and their calls, the tools' results, in order (:mod:`agents.runtime.conversations`), whatever
        ran it — Keel's own loop or a framework integration (whose module this process imports: ``KEEL_IMPORTS``)."""
        check_text("request_id", request_id, limit=200)
        agent_id = self._chain_id(agent)
        self._import_handlers()
        with core.store_errors():
            request_input, steps = request_steps(self.db, agent_id, request_id)
        return conversation_of(request_input, steps)

    def request_jobs(self, agent: AgentRef, request_id: str) -> list[JobView]:
        """Every job (step) of the agent's request ``request_id``, finished ones included, oldest first."""
        check_text("request_id", request_id, limit=200)
        agent_id = self._chain_id(agent)
        with core.store_errors():
            return [JobView(**r) for r in request_jobs(self.db, agent_id, request_id)]

    def cancel(
        self,
        agent_id: AgentRef,
        *,
        expected_revision: int | None = None,
        actor: str,
        reason: str | None = None,
    ) -> AgentState:
        """Stop the request in flight: any active phase moves to failed."""
        check_actor(actor)
        check_reason(reason)
        return self._command(agent_id, Event.CANCEL, expected_revision, actor, reason)

    def _submit(
        self,
        agent: AgentRef,
        request_id: str,
        input: Any,
        *,
        expected_revision: int | None,
        soft_deadline: Deadline,
        hard_deadline: Deadline,
        actor: str,
        operation: str,
        with_jobs: bool = False,
    ) -> _Submitted:
        check_actor(actor)
        # Relative deadlines count from the transition's time on the database's clock, not this host's.
        soft, hard = check_deadline("soft_deadline", soft_deadline), check_deadline("hard_deadline", hard_deadline)
        input_json = self._input_json(input)
        check_text("operation", operation, limit=128)
        self._import_handlers()
        handlers.registry.check_input(operation, json.loads(input_json))
        # By id, the transition's own locking read finds the agent (and a deleted one's tombstone): no read before it.
        agent_id = as_uuid(agent)
        command = Command(
            agent_id=agent_id if agent_id is not None else self._row(agent).id,
            event=Event.SUBMIT,
            actor=actor,
            expected_revision=expected_revision,
            request_id=request_id,
            soft_deadline=soft,
            hard_deadline=hard,
            jobs=(JobSpec(operation, "1", payload={"input": json.loads(input_json)}),),
        )
        try:
            # While the broker is down, between retries, the jobs are left to the dispatcher at once.
            publish_due = self.publisher is not None and self.broker.wait() == 0
            done = core.transition(
                self.db, command, input_json=input_json, publish_due=publish_due, with_jobs=with_jobs
            )
        except AgentNotFound as exc:
            raise AgentNotFound(agent, deleted=exc.deleted) from None  # named as the caller named it
        if self.publisher is not None and done.to_publish:
            self._publish(self.publisher, done.to_publish)
        return _Submitted(done.agent, done.suppressed, request_id, operation, input_json, actor, done.pending_jobs)

    def _record(self, done: _Submitted) -> RequestRecord:
        """The request as first submitted: a new one from what the transition wrote, a retry's read back."""
        if done.suppressed:
            return self.get_request(done.agent.id, done.request_id)
        row = done.agent
        return RequestRecord(
            request_id=done.request_id,
            agent_id=row.id,
            operation=done.operation,
            input=json.loads(done.input_json),
            soft_deadline=row.soft_deadline,
            hard_deadline=row.hard_deadline,
            submitted_at=row.updated_at,  # the transition's time, which the request row records too
            submitted_by=done.actor,
            revision=row.revision,
        )

    def _publish(self, publisher: Publisher, due: Sequence[Due]) -> None:
        try:
            publisher(due)
        except Exception as exc:
            # The submit is committed whatever happens here: its jobs go back to pending for the dispatcher's next
            # pass (not after KEEL_ENQUEUE_TIMEOUT_SECONDS), and the caller gets its answer.
            self.broker.failed(exc)
            log.debug("%d jobs left to the dispatcher: publishing failed", len(due))
            try:
                unpublish(self.db, [d.key for d in due])
            except Exception:  # they stay enqueued: re-published after KEEL_ENQUEUE_TIMEOUT_SECONDS
                log.exception("could not hand jobs %s to the dispatcher", ", ".join(d.key for d in due))
        else:
            self.broker.recovered()

    def _input_json(self, value: Any) -> str:
        check_depth("input", value)  # the bound parse_json puts on text, before anything recurses into it
        check_json_text("input", value)  # before json.dumps, which would escape a lone surrogate PostgreSQL refuses
        try:
            text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"input must be JSON-serialisable: {exc}") from None
        if "\\u0000" in text:
            raise InvalidInput("input must not contain NUL characters (PostgreSQL cannot store them)")
        size = len(text.encode())
        if size > self.settings.max_input_bytes:
            raise InvalidInput(f"input is {size} bytes as JSON; the limit is {self.settings.max_input_bytes}")
        return text


@dataclass(frozen=True, slots=True)
class _Submitted:
    """What one submit did, and what it was asked (for the request's record)."""

    agent: AgentRow
    suppressed: bool
    request_id: str
    operation: str
    input_json: str
    actor: str
    #: The agent's live jobs as the submit committed them (None: not asked for).
    jobs: tuple[JobView, ...] | None = None
