"""Row snapshots and the pydantic models producers see."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: What a name may be (an agent's, an API token's): a letter or digit, then letters, digits, ``.``, ``_`` and ``-``.
#: PostgreSQL's regular expressions read it the same way (the CHECK on ``api_tokens.name`` uses it as is).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._\-]*$"
#: The longest name, in characters.
MAX_NAME_CHARS = 200


@dataclass(frozen=True, slots=True)
class AgentRow:
    """One ``agents`` row as read under its lock, built by position in its fields' order: the columns selected are
    these fields, in this order (:data:`models.sql.AGENT_COLUMNS`, :data:`models.sql.AGENT_ROW`)."""

    id: UUID
    name: str
    phase: str
    revision: int
    request_id: str | None
    soft_deadline: datetime | None
    hard_deadline: datetime | None
    budget_tokens: int | None
    budget_cost: Decimal | None
    spent_tokens: int
    spent_cost: Decimal
    created_at: datetime
    updated_at: datetime
    journal_seq: int
    journal_head: str
    priority: str = "normal"
    archived_at: datetime | None = None
    #: While waiting_approval: when the wait began (None otherwise, or for a wait older than migration 0014).
    waiting_since: datetime | None = None
    #: The first segment of the keys of the request in flight (``agents.core.keys.request_key``: its agent and id).
    request_key: str | None = None


@dataclass(frozen=True, slots=True)
class Submitted:
    """A request as it was first submitted: its input, and the details journaled with the submit (None if the
    journal has no submit event for it)."""

    input: Any
    submit_details: dict[str, Any] | None
    #: Whether the input of the submit being compared is this request's, as the database compares them (jsonb's
    #: text; once retention pruned the input, ``input`` is None and its digest decides). None: not compared, and
    #: ``input`` is (a request read before this was kept, or built by hand).
    same_input: bool | None = None


class JobView(BaseModel):
    """A job as the state view lists it."""

    model_config = ConfigDict(frozen=True)

    key: str
    operation: str
    target: str
    status: str
    queue: str
    run_at: datetime
    attempts: int
    error_attempts: dict[str, int]
    last_error: str | None


class AgentState(BaseModel):
    """What an agent is doing now, as a producer or a UI sees it."""

    model_config = ConfigDict(frozen=True)

    id: UUID
    name: str
    phase: str
    revision: int
    request_id: str | None
    soft_deadline: datetime | None
    hard_deadline: datetime | None
    budget_tokens: int | None
    budget_cost: Decimal | None
    spent_tokens: int
    spent_cost: Decimal
    created_at: datetime
    updated_at: datetime
    priority: str = "normal"
    #: When the agent was archived (it refuses new requests); None while it is in use.
    archived_at: datetime | None = None
    pending_jobs: tuple[JobView, ...] = ()
    #: While waiting_approval: the tool call a person must approve or reject (tool, call_id, arguments, round).
    pending_approval: dict[str, Any] | None = None

    @classmethod
    def of(
        cls, row: AgentRow, pending_jobs: tuple[JobView, ...] = (), pending_approval: dict[str, Any] | None = None
    ) -> AgentState:
        return cls(
            id=row.id,
            name=row.name,
            phase=row.phase,
            revision=row.revision,
            request_id=row.request_id,
            soft_deadline=row.soft_deadline,
            hard_deadline=row.hard_deadline,
            budget_tokens=row.budget_tokens,
            budget_cost=row.budget_cost,
            spent_tokens=row.spent_tokens,
            spent_cost=row.spent_cost,
            created_at=row.created_at,
            updated_at=row.updated_at,
            priority=row.priority,
            archived_at=row.archived_at,
            pending_jobs=pending_jobs,
            pending_approval=pending_approval,
        )


class DeletedAgent(BaseModel):
    """A deleted agent's tombstone: the agent as it was when deleted (archived, at rest), who deleted it and when,
    and the head of its journal chain — its ``operator``/``delete`` event. Its journal, requests and jobs are kept."""

    model_config = ConfigDict(frozen=True)

    id: UUID
    name: str
    created_at: datetime
    deleted_at: datetime
    deleted_by: str
    phase: str
    revision: int
    request_id: str | None
    journal_seq: int
    journal_head: str


class JournalEventPage(BaseModel):
    """One page of ``Client.journal_page``, newest first; ``next`` is the cursor of the following (older) page
    (None: the last)."""

    model_config = ConfigDict(frozen=True)

    events: tuple[JournalEvent, ...]
    next: str | None = None


class AgentPage(BaseModel):
    """One page of ``list_agents``, newest first; ``next`` is the cursor of the following page (None: the last)."""

    model_config = ConfigDict(frozen=True)

    agents: tuple[AgentState, ...]
    next: str | None = None


class WaitingApproval(BaseModel):
    """A call waiting for a person: which agent (at which revision: what an approval's If-Match names), which
    tool with which arguments, which request and round, and since when (the database's clock); if its tool has an
    approval timeout, how long, what then (``reject`` or ``escalate``), when, and whether it was escalated."""

    model_config = ConfigDict(frozen=True)

    agent_id: UUID
    agent: str
    revision: int
    request_id: str
    tool: str
    call_id: str
    round: int
    arguments: dict[str, Any]
    since: datetime
    waited_seconds: float
    approval_timeout_seconds: float | None = None
    on_timeout: str | None = None
    times_out_at: datetime | None = None
    escalated: bool = False


class ApprovalPage(BaseModel):
    """One page of the approvals inbox, oldest first; ``next`` is the cursor of the following page (None: the
    last)."""

    model_config = ConfigDict(frozen=True)

    approvals: tuple[WaitingApproval, ...]
    next: str | None = None


class JournalEvent(BaseModel):
    """One immutable journal event: who did what to which agent, and what the policy decided."""

    model_config = ConfigDict(frozen=True)

    id: int
    agent_id: UUID
    seq: int
    kind: str
    event: str
    actor: str
    request_id: str | None
    from_phase: str | None
    to_phase: str | None
    revision: int
    decision: str
    details: dict[str, Any]
    at: datetime
    prev_hash: str
    hash: str
    #: The audit key ``hash`` is an HMAC under; None: a legacy event, from before the journal was keyed.
    key_id: str | None = None


class SideEffect(BaseModel):
    """One Slack or GitHub message a request emitted, and how its delivery went: ``sent`` (with where it is at the
    receiver), ``pending``/``sending`` (the relay has it), or ``dead`` (given up: ``last_error`` says why; ``keel outbox
    retry KEY`` sends it again)."""

    model_config = ConfigDict(frozen=True)

    key: str
    channel: str
    destination: str
    status: str
    attempts: int
    last_error: str | None = None
    external_url: str | None = None
    sent_at: datetime | None = None


class RequestFailure(BaseModel):
    """Why a request failed: who stopped it (``event``: ``fail`` for Keel — an error cap, a deadline, the budget —
    ``cancel`` for a person or producer), the reason journaled, and the step that failed, if one did, with its error
    class and last error."""

    model_config = ConfigDict(frozen=True)

    event: str
    actor: str
    reason: str
    job: str | None = None
    error_class: str | None = None
    error: str | None = None


class RequestOutcome(BaseModel):
    """How a request stands or ended, read from what its steps stored (``agents.core.request_outcome``): its phase (the
    agent's, as its latest transition left it), the answer (when done), why it failed (when failed), what its steps
    spent, and its side effects with their delivery."""

    model_config = ConfigDict(frozen=True)

    request_id: str
    agent_id: UUID
    phase: str
    #: The revision and time of the request's latest transition.
    revision: int
    at: datetime
    #: The final answer: the last step's ``answer`` (Keel's loop, KeelAgent, KeelGraph), or a handler's whole result.
    answer: Any = None
    failure: RequestFailure | None = None
    tokens: int = 0
    cost: Decimal = Decimal(0)
    #: The attempts of its steps that failed, by error class (``{"transient": 2}``): what retries it took.
    failed_attempts: dict[str, int] = Field(default_factory=dict)
    side_effects: tuple[SideEffect, ...] = ()
    #: Its steps were pruned by retention (``KEEL_JOBS_RETENTION_DAYS``): the answer and the spend are no longer known.
    pruned: bool = False
    #: Read by someone who may not read the request's story: side effects without their errors and receiver links,
    #: and a failed step without its error text.
    partial: bool = False

    @property
    def dead(self) -> tuple[SideEffect, ...]:
        """The side effects Keel gave up on: the request may be done while these never arrived."""
        return tuple(s for s in self.side_effects if s.status == "dead")


class RequestRecord(BaseModel):
    """A request as it was submitted: what a producer asked for, when, by whom, and the agent's revision after the
    submit. Built only from what was stored at the first submit, so every retry of it reads the same record."""

    model_config = ConfigDict(frozen=True)

    request_id: str
    agent_id: UUID
    operation: str
    input: Any
    soft_deadline: datetime | None
    hard_deadline: datetime | None
    submitted_at: datetime
    submitted_by: str
    #: The agent's revision right after the submit (the ``submit`` event's).
    revision: int

    @field_validator("input", mode="after")
    @classmethod
    def _keys_sorted(cls, value: Any) -> Any:
        # Read back from JSONB its keys come in JSONB's order; as submitted, in the caller's: one order for both.
        return json.loads(json.dumps(value, sort_keys=True))

    @field_validator("soft_deadline", "hard_deadline", "submitted_at", mode="after")
    @classmethod
    def _in_utc(cls, value: datetime | None) -> datetime | None:
        return None if value is None else value.astimezone(UTC)


class Submission(BaseModel):
    """What a submit did: the request as first submitted, the agent's state now, and whether this call was a retry
    of a request already there (``replayed``: nothing changed)."""

    model_config = ConfigDict(frozen=True)

    request: RequestRecord
    state: AgentState
    replayed: bool


class SubmittedRequest(BaseModel):
    """What a submit did, without the agent's state: the request as first submitted, and whether this call was a
    retry of a request already there (``replayed``: nothing changed)."""

    model_config = ConfigDict(frozen=True)

    request: RequestRecord
    replayed: bool


class NewAgent(BaseModel):
    """Input of ``create_agent``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS, pattern=NAME_PATTERN)
    budget_tokens: int | None = Field(default=None, ge=0, le=2**63 - 1)  # a bigint column
    budget_cost: Decimal | None = Field(default=None, ge=0, max_digits=18, decimal_places=6)

    @field_validator("name")
    @classmethod
    def _name_is_not_an_id(cls, value: str) -> str:
        try:
            UUID(value)
        except ValueError:
            return value
        raise ValueError("must not look like a UUID: agents are looked up by id or name")
