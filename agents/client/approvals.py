"""The direct client's approvals: the calls waiting across agents, and a person's approve (maybe with edited
arguments) or reject of one."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, timedelta
from typing import Any

from agents.client.base import ClientBase
from agents.client.checks import AgentRef, check_actor, check_reason
from agents.client.cursors import decode_cursor, encode_cursor
from agents.core import transition as core
from agents.core.commands import check_count, check_json_text, check_text
from agents.core.errors import InvalidInput, InvalidJob, quoted
from agents.core.json_input import check_depth
from agents.core.phases import Event
from agents.runtime import tools
from agents.runtime.loop import PendingApproval, approval_jobs, cancel_round_txn, pending_approval, rejection_jobs
from models.approvals_sql import WaitingCall, waiting_calls
from models.schemas import AgentState, ApprovalPage, WaitingApproval


class ApprovalsMixin(ClientBase):
    def approvals(
        self,
        *,
        tool: str | None = None,
        min_age: timedelta | None = None,
        agent_prefix: str | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> ApprovalPage:
        """Every call waiting for approval across agents, oldest first, filtered by ``tool``, ``min_age`` (waiting at
        least) and ``agent_prefix`` if given. At most ``limit``; ``after`` is the previous page's ``next``."""
        check_count("limit", limit, low=1, high=10_000)
        if tool is not None:
            check_text("tool", tool, limit=200)
        if agent_prefix is not None:
            check_text("agent_prefix", agent_prefix, limit=200)
        if min_age is not None and min_age < timedelta(0):
            raise InvalidInput(f"min_age must not be negative, got {min_age}")
        keyset = None
        if after is not None:
            try:
                keyset = decode_cursor(after)
            except InvalidInput:
                raise InvalidInput(
                    f"cursor {quoted(after)} is not the 'next' of a page of approvals (from `keel approvals` or the"
                    " API)"
                ) from None
        with core.store_errors():
            calls = waiting_calls(
                self.db, tool=tool, min_age=min_age, agent_prefix=agent_prefix, after=keyset, limit=limit + 1
            )
        more = len(calls) > limit
        calls = calls[:limit]
        return ApprovalPage(
            approvals=tuple(_waiting_approval(c) for c in calls),
            next=encode_cursor(calls[-1].since, calls[-1].agent_id) if more else None,
        )

    def approve(
        self,
        agent_id: AgentRef,
        *,
        expected_revision: int,
        actor: str,
        arguments: Mapping[str, Any] | None = None,
    ) -> AgentState:
        """Approve the pending tool call: it runs next, with ``arguments`` instead of its own if given (checked
        against the tool's input model first). See docs/explanation/clients.md#approving-with-edited-arguments."""
        check_actor(actor)
        row = self._row(agent_id)
        pending = pending_approval(self.db, row.id, row.request_id) if row.phase == "waiting_approval" else None
        details: dict[str, Any] = {"call": pending.as_dict()} if pending else {}
        outcome = "approved"
        if arguments is not None and pending is not None:
            arguments = self._edited_arguments(pending, arguments)
            if arguments != dict(pending.arguments):
                details["edited_arguments"] = arguments
                outcome = "approved with edited arguments"
        jobs = approval_jobs(pending, arguments) if pending else ()
        messages = pending.decided_messages(row.name, outcome, actor) if pending else ()
        return self._command(
            row.id, Event.APPROVE, expected_revision, actor, None, jobs=jobs, extra=details, messages=messages
        )

    def reject(
        self, agent_id: AgentRef, *, expected_revision: int, actor: str, reason: str | None = None
    ) -> AgentState:
        """Decline the pending tool call; the model is told why and revises its plan."""
        check_actor(actor)
        check_reason(reason)
        row = self._row(agent_id)
        pending = pending_approval(self.db, row.id, row.request_id) if row.phase == "waiting_approval" else None
        jobs = rejection_jobs(pending, reason or f"rejected by {actor}") if pending else ()
        details = {"call": pending.as_dict()} if pending else {}
        outcome = "rejected" if reason is None else f"rejected: {reason[:300]}"
        messages = pending.decided_messages(row.name, outcome, actor) if pending else ()
        return self._command(
            row.id,
            Event.REJECT,
            expected_revision,
            actor,
            reason,
            jobs=jobs,
            extra=details,
            effects=cancel_round_txn if pending else None,
            messages=messages,
        )

    def _edited_arguments(self, pending: PendingApproval, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """A person's edit of a call's arguments, if the tool accepts them (else :class:`InvalidInput`)."""
        if not isinstance(arguments, Mapping):
            raise InvalidInput(f"arguments must be a JSON object, got {type(arguments).__name__}")
        edited = dict(arguments)
        check_depth("arguments", edited)  # the bound parse_json puts on text, before anything recurses into it
        check_json_text("arguments", edited)
        self._import_handlers()
        tool_name = pending.tool
        if pending.resume is not None:  # a call an integration's run holds: its own tool checks them
            operation = str(pending.resume["operation"])
            check = tools.argument_check(operation)
            if check is None:
                raise InvalidInput(
                    f"operation {operation!r} is not known to this process, so edited arguments cannot be checked:"
                    " list the module that registers it in KEEL_IMPORTS"
                )
            try:
                return check(tool_name, edited)
            except InvalidJob as exc:
                raise InvalidInput(f"edited arguments refused: {exc}") from None
        tool = tools.stored_tool(tool_name)
        if tool is None:
            raise InvalidInput(
                f"tool {tool_name!r} is not known to this process, so edited arguments cannot be checked: list the"
                " module that defines it in KEEL_IMPORTS"
            )
        try:
            tool.validate(edited)
        except InvalidJob as exc:
            raise InvalidInput(f"edited arguments refused: {exc}") from None
        return edited


def _waiting_approval(call: WaitingCall) -> WaitingApproval:
    payload = call.payload
    timeout = payload.get("approval_timeout_seconds")
    seconds = float(timeout) if isinstance(timeout, int | float) else None
    since = call.since.astimezone(UTC)
    return WaitingApproval(
        agent_id=call.agent_id,
        agent=call.agent,
        revision=call.revision,
        request_id=call.request_id,
        tool=str(payload.get("tool")),
        call_id=str(payload.get("tool_call_id", payload.get("call_id"))),
        round=int(payload.get("round", 0)),
        arguments=dict(payload.get("arguments") or {}),
        since=since,
        waited_seconds=max(0.0, (call.now - call.since).total_seconds()),
        approval_timeout_seconds=seconds,
        on_timeout=str(payload.get("on_timeout", "reject")) if seconds is not None else None,
        times_out_at=since + timedelta(seconds=seconds) if seconds is not None else None,
        escalated=call.escalated,
    )
