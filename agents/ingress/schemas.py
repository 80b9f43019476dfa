"""The bodies the HTTP API takes and gives. Every body refuses fields it does not know (``extra="forbid"``)."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any, Literal
from uuid import UUID

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, JsonValue, model_validator

from agents.core.commands import MAX_REASON_CHARS
from agents.ingress.problems import MEDIA_TYPE
from models.schemas import AgentState, JobView, JournalEvent, RequestOutcome, RequestRecord

#: A revision or a budget: what a bigint column holds.
MAX_BIGINT = 2**63 - 1


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateAgent(Body):
    name: str = Field(
        min_length=1,
        max_length=200,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._\-]*$",
        description="Unique; letters, digits, '.', '_', '-'. Not a UUID (agents are addressed by id or name).",
    )
    budget_tokens: int | None = Field(default=None, ge=0, le=MAX_BIGINT, description="None: unlimited")
    budget_cost: Decimal | None = Field(
        default=None, ge=0, max_digits=18, decimal_places=6, description="USD; None: unlimited"
    )


class SubmitRequest(Body):
    """A request for an agent. The ``Idempotency-Key`` header is its request id: repeat the same body under the same
    key and the original response comes back; a different body under it is a 409."""

    input: JsonValue = Field(description="The operation's input; for plan: {prompt, script?}")
    operation: str = Field(default="plan", min_length=1, max_length=128)
    soft_deadline: AwareDatetime | None = Field(default=None, description="After it the request runs at low priority")
    hard_deadline: AwareDatetime | None = Field(default=None, description="After it the request is stopped")
    soft_deadline_seconds: float | None = Field(
        default=None, gt=0, le=10 * 365 * 86400, description="A soft deadline relative to the submit (instead)"
    )
    hard_deadline_seconds: float | None = Field(
        default=None, gt=0, le=10 * 365 * 86400, description="A hard deadline relative to the submit (instead)"
    )

    @model_validator(mode="after")
    def _one_form_per_deadline(self) -> SubmitRequest:
        for name in ("soft_deadline", "hard_deadline"):
            if getattr(self, name) is not None and getattr(self, f"{name}_seconds") is not None:
                raise ValueError(f"give {name} or {name}_seconds, not both")
        return self


class Approval(Body):
    """An approval carries its ``If-Match``: the call approved is the one waiting at that revision. ``arguments``
    (optional) replace the call's arguments: checked against the tool's input model (422 naming the field), both
    versions journaled, and the model told what changed."""

    arguments: dict[str, Any] | None = Field(
        default=None, description="Edited arguments the call runs with instead of the model's"
    )


class Decision(Body):
    reason: str | None = Field(default=None, min_length=1, max_length=MAX_REASON_CHARS)


class Links(BaseModel):
    model_config = ConfigDict(frozen=True)

    self: str
    agent: str
    story: str
    events: str


class RequestOut(RequestRecord):
    """A request as first submitted, with where to follow it. The same for every retry of the submit."""

    links: Links


class RequestView(RequestOut):
    """A request as submitted, and how it stands or ended (``outcome``: phase, answer, failure, spend, side effects
    with their delivery)."""

    outcome: RequestOutcome


class ConversationMessage(BaseModel):
    """One message of a request's conversation, as a person reads it (agents/runtime/conversations.py)."""

    role: str = Field(description="user, assistant, tool or system")
    content: str
    calls: list[dict[str, Any]] | None = Field(default=None, description="the tools a reply called: tool, arguments")
    reasoning: str | None = Field(default=None, description="a reply's reasoning text, when the model gave it")


class RequestStory(BaseModel):
    """Everything that happened for one request: its record, its jobs, its journal events, its outbox messages, and
    its conversation (the prompt, the model's replies and calls, the tools' results: empty for a handler of its
    own)."""

    request: RequestOut
    outcome: RequestOutcome
    jobs: list[JobView]
    journal: list[JournalEvent]
    outbox: list[OutboxMessage]
    conversation: list[ConversationMessage] = Field(default_factory=list)


class OutboxMessage(BaseModel):
    key: str
    agent_id: UUID | None  # None: one of Keel's own messages (an alert, the daily KPI report)
    request_id: str
    channel: str
    destination: str
    status: str
    attempts: int
    rate_limited_attempts: int
    next_attempt_at: datetime
    last_error: str | None
    external_id: str | None
    external_url: str | None
    created_at: datetime
    sent_at: datetime | None
    #: The receiver-facing content (Slack text/blocks, GitHub comment body).
    payload: dict[str, Any] | None = None


class OutboxPage(BaseModel):
    messages: list[OutboxMessage]
    next: str | None = None


class JobOut(BaseModel):
    key: str
    agent_id: UUID
    request_id: str
    operation: str
    target: str
    status: str
    queue: str
    run_at: datetime
    attempts: int
    error_attempts: dict[str, int]
    error_class: str | None
    last_error: str | None
    lease_until: datetime | None
    worker: str | None
    fencing_token: int
    tokens: int
    cost: Decimal
    suppressed: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    payload: dict[str, Any]
    result: Any


class JournalPage(BaseModel):
    events: list[JournalEvent]
    #: The ``after`` of the next page (the last event's seq); None when this page reached the end.
    next: int | None = None


class StaleState(BaseModel):
    """A 412's extension members: the agent as it is now, and its ETag to retry with."""

    current_state: AgentState
    etag: str


class ProblemDetails(BaseModel):
    """RFC 9457 problem details. ``type`` is stable per kind of problem (``GET /problems`` lists them); extension
    members carry the facts (``errors`` for bad input, ``current_state`` and ``etag`` for a stale revision,
    ``allowed`` for an illegal move, ``differs`` for a reused Idempotency-Key)."""

    model_config = ConfigDict(extra="allow")

    type: str
    title: str
    status: int
    detail: str
    instance: str | None = None


def problem_doc(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {MEDIA_TYPE: {"schema": ProblemDetails.model_json_schema()}},
    }


#: What any /v1 call may answer besides its success (each route adds its own, e.g. 412).
ERRORS: dict[int | str, dict[str, Any]] = {
    400: problem_doc("Bad request: a malformed header (If-Match, Last-Event-ID) or a missing Idempotency-Key"),
    401: problem_doc("Missing, unknown or revoked token"),
    403: problem_doc("The token lacks the scope"),
    404: problem_doc("No such agent, request, job or message — or one outside the token's agent prefix"),
    409: problem_doc("The agent's phase or a reused key does not allow this"),
    412: problem_doc("If-Match names a revision that is not the current one: the body has the current state"),
    413: problem_doc("Request body too large"),
    422: problem_doc("Invalid input: `errors` names each field and rule"),
    428: problem_doc("If-Match is required"),
    429: problem_doc(
        "Over the token's rate (see Retry-After and the RateLimit headers), or, for a live event stream, too many open"
    ),
    503: problem_doc("The database is unavailable: retry"),
}


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    checks: dict[str, str] = {}


RequestStory.model_rebuild()
