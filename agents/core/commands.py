"""Commands and the pure decision on each: accept, suppress as a duplicate, or reject. Nothing here touches the
database: :func:`decide` sees the locked row and returns what should happen."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any
from uuid import UUID

from agents.core.errors import (
    AgentArchived,
    HardDeadlinePassed,
    IllegalTransition,
    InvalidDeadlines,
    InvalidInput,
    Rejected,
    StaleRevision,
)
from agents.core.keys import check_request_id, make_key, request_key, split_key, step_message_key
from agents.core.phases import COMMAND_EVENTS, Event, Phase, allowed_events, target_of
from models.clock import parse_time, rfc3339
from models.schemas import AgentRow, Submitted

ACCEPTED = "accepted"
NORMAL, LOW = "normal", "low"
#: Events that may still be applied after the hard deadline: the ones that stop or restart a request.
AFTER_HARD_DEADLINE = frozenset({Event.CANCEL, Event.FAIL, Event.SUBMIT, Event.CHARGE})


#: The largest number a bigint column (revisions, token counts and budgets) holds.
MAX_BIGINT = 2**63 - 1
#: The largest spend one step can record (the columns are bigint and numeric(18, 6)).
MAX_TOKENS = 2**62
#: The furthest a relative deadline may reach (a century: beyond it the arithmetic overflows, and it means "never").
MAX_DEADLINE_AHEAD = timedelta(days=36500)
MAX_COST = Decimal(10) ** 11


@dataclass(frozen=True, slots=True)
class Usage:
    """What one step spent: model tokens and money."""

    tokens: int = 0
    cost: Decimal = Decimal(0)

    def __post_init__(self) -> None:
        if self.tokens < 0 or self.cost < 0:
            raise InvalidInput(f"usage cannot be negative (tokens={self.tokens}, cost={self.cost})")
        if self.tokens > MAX_TOKENS or self.cost >= MAX_COST:
            raise InvalidInput(f"usage is beyond what can be recorded (tokens={self.tokens}, cost={self.cost})")

    def __bool__(self) -> bool:
        return bool(self.tokens or self.cost)

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> Usage:
        """Usage as stored (``{"tokens": …, "cost": "…"}``; missing fields are 0)."""
        data = data or {}
        return cls(int(data.get("tokens", 0)), Decimal(str(data.get("cost", "0"))))


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A job a transition schedules. Its key is ``{request}:{operation}:{target}`` of the agent's request."""

    operation: str
    target: str
    payload: Mapping[str, Any] = field(default_factory=dict)
    #: Due this long after the transition that schedules it, on the database's clock (None: at once).
    delay: timedelta | None = None
    priority: int = 5

    def __post_init__(self) -> None:
        make_key("r", self.operation, self.target)  # validates both segments
        if not 0 <= self.priority <= 9:
            raise InvalidInput(f"job priority must be 0-9, got {self.priority}")
        if self.delay is not None and self.delay < timedelta(0):
            raise InvalidInput(f"job delay must not be negative, got {self.delay}")


# A conversation id (C…, G…, D…): reconciliation reads the channel's history, which takes ids, not names.
_SLACK_DESTINATION = re.compile(r"^[CGD][A-Z0-9]{1,20}$")
_GITHUB_DESTINATION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9\-]{0,38}/[A-Za-z0-9._\-]{1,100}#[1-9][0-9]{0,9}$")
MESSAGE_LIMITS = {"slack": ("text", 40_000), "github": ("body", 65_000)}
#: Free text people write into the append-only journal is bounded: what is journaled stays there forever.
MAX_REASON_CHARS = 2000
MAX_ACTOR_CHARS = 200


def check_text(field: str, value: object, *, limit: int | None = None) -> str:
    """Return ``value`` if PostgreSQL can store it as text (a str, valid Unicode, no NUL) and it has at most
    ``limit`` characters; else raise :class:`InvalidInput` naming ``field`` and the rule (never echoing the text)."""
    if not isinstance(value, str):
        raise InvalidInput(f"{field} must be text, got {type(value).__name__}")
    if limit is not None and len(value) > limit:
        raise InvalidInput(f"{field} must be at most {limit} characters, got {len(value)}")
    if "\x00" in value:
        raise InvalidInput(f"{field} must not contain NUL characters (found at position {value.index(chr(0))})")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInput(
            f"{field} is not valid Unicode: it has a lone surrogate U+{ord(value[exc.start]):04X} at position"
            f" {exc.start}"
        ) from None
    return value


def check_count(field: str, value: object, *, low: int = 0, high: int = MAX_BIGINT) -> int:
    """Return ``value`` if it is an integer from ``low`` to ``high`` (by default what a bigint column holds), else
    raise :class:`InvalidInput` naming ``field`` and the range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"{field} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise InvalidInput(f"{field} must be from {low} to {high}, got {value}")
    return value


def check_json_text(field: str, value: Any) -> None:
    """Check every string in a JSON-like ``value`` (keys too) with :func:`check_text`; the error names its path."""
    if isinstance(value, str):
        check_text(field, value)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str):
                check_text(f"a key of {field}", key)
            check_json_text(f"{field}.{key}", item)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            check_json_text(f"{field}[{index}]", item)


@dataclass(frozen=True, slots=True)
class MessageSpec:
    """A Slack or GitHub message a transition emits through the outbox; the same key is never delivered twice.
    A message a step's outcome emits, or that names the step it is about (``step``), is keyed from that step's key
    (:func:`~agents.core.keys.step_message_key`: ``target`` names it within the step); any other is
    ``{request}:{channel}:{target}``."""

    channel: str  # slack | github
    destination: str  # Slack conversation id (C…/G…/D…); GitHub "owner/repo#number"
    target: str  # names this message within its step (e.g. "post"), or within the request (e.g. "hard-deadline")
    payload: Mapping[str, Any]  # slack: {"text": …, "blocks": […]}; github: {"body": …}
    #: The key of the step this message is about when that is not the step whose outcome emits it (an approval's
    #: follow-up is about its gate); None: the emitting step's, or the request's if no step emits it.
    step: str | None = None

    def __post_init__(self) -> None:
        if self.channel not in MESSAGE_LIMITS:
            raise InvalidInput(f"message channel {self.channel!r} is unknown: use slack or github")
        pattern = _SLACK_DESTINATION if self.channel == "slack" else _GITHUB_DESTINATION
        if not pattern.fullmatch(self.destination):
            shape = "a conversation id like C0123ABCD" if self.channel == "slack" else "owner/repo#number"
            raise InvalidInput(f"{self.channel} destination {self.destination!r} is invalid: expected {shape}")
        make_key("r", self.channel, self.target)
        if self.step is not None:
            if not isinstance(self.step, str) or self.step.count(":") < 2:
                raise InvalidInput(f"message step {self.step!r} is not a step's key (request:operation:target)")
            step_message_key(self.step, self.channel, self.target)
        field_name, limit = MESSAGE_LIMITS[self.channel]
        text = self.payload.get(field_name)
        if not isinstance(text, str) or not text.strip():
            raise InvalidInput(f"a {self.channel} message needs a non-empty payload[{field_name!r}]")
        if len(text) > limit or "\x00" in text:
            raise InvalidInput(f"payload[{field_name!r}] must be at most {limit} characters, without NUL")


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """The outcome of a claimed job, written by the transition that records it, and only while ``fencing_token`` is
    still the job's (a worker whose lease was taken over writes nothing). ``status`` ``pending`` is a retry."""

    key: str
    fencing_token: int
    status: str  # succeeded, pending (retry at run_at), failed, dead, cancelled
    result: Mapping[str, Any] | None = None
    usage: Usage = field(default_factory=Usage)  # of a successful attempt
    failed_usage: Usage = field(default_factory=Usage)  # of a failed attempt: retry-caused cost
    error: str | None = None
    error_class: str | None = None
    error_attempts: Mapping[str, int] | None = None
    #: A retry is due this long after the transition that records it (on the database's clock, not a host's).
    retry_delay: timedelta | None = None

    def __post_init__(self) -> None:
        if self.status not in ("succeeded", "pending", "failed", "dead", "cancelled"):
            raise InvalidInput(f"job outcome status {self.status!r} is unknown")
        if self.status == "pending" and self.retry_delay is None:
            raise InvalidInput("a retry (status pending) needs retry_delay")

    @property
    def leaves_job_live(self) -> bool:
        return self.status == "pending"


@dataclass(frozen=True, slots=True)
class Join:
    """Applied instead of the command's event when the job it records was the agent's last live one, while the
    agent is executing: the last tool result of a round sends the conversation back to the model."""

    event: Event
    jobs: tuple[JobSpec, ...] = ()


@dataclass(frozen=True, slots=True)
class Command:
    """A request to apply ``event`` to one agent.

    ``expected_revision`` None means "whatever the current revision is" (system moves). ``reason`` is the policy
    decision recorded in the journal for an accepted move (e.g. ``budget_exhausted`` for a ``fail``).
    """

    agent_id: UUID
    event: Event
    actor: str
    expected_revision: int | None = None
    request_id: str | None = None
    #: Absolute (timezone-aware), or relative to the transition's time on the database's clock.
    soft_deadline: datetime | timedelta | None = None
    hard_deadline: datetime | timedelta | None = None
    reason: str = ACCEPTED
    details: Mapping[str, Any] = field(default_factory=dict)
    spend: Usage = field(default_factory=Usage)
    jobs: tuple[JobSpec, ...] = ()
    priority: str | None = None  # "low" demotes the agent's jobs (soft deadline)
    outcome: JobOutcome | None = None  # the job whose result this transition records
    messages: tuple[MessageSpec, ...] = ()  # Slack/GitHub messages, sent by the outbox relay after commit
    join: Join | None = None  # see Join: decided under the agent's lock, where the count of live jobs is exact

    def __post_init__(self) -> None:
        if not isinstance(self.event, Event):
            raise InvalidInput(f"event {self.event!r} is unknown: expected one of {', '.join(Event)}")
        if not isinstance(self.actor, str) or not self.actor or len(self.actor) > MAX_ACTOR_CHARS:
            raise InvalidInput(f"actor must be 1-{MAX_ACTOR_CHARS} characters: every change names who made it")
        check_text("actor", self.actor)
        check_text("reason", self.reason, limit=MAX_REASON_CHARS)
        if not isinstance(self.details, Mapping):
            raise InvalidInput(f"details must be a mapping, got {type(self.details).__name__}")
        if isinstance(self.details.get("reason"), str):  # a person's reason, journaled as written
            check_text("reason", self.details["reason"], limit=MAX_REASON_CHARS)
        check_json_text("details", self.details)
        if self.expected_revision is not None:
            check_count("expected_revision", self.expected_revision)
        if self.event is Event.SUBMIT:
            if self.request_id is None:
                raise InvalidInput("submit needs a request_id")
            check_request_id(self.request_id)
        elif self.request_id is not None or self.soft_deadline or self.hard_deadline:
            raise InvalidInput("request_id and deadlines are set only by submit")
        for name in ("soft_deadline", "hard_deadline"):
            value = getattr(self, name)
            if isinstance(value, datetime) and value.tzinfo is None:
                raise InvalidInput(f"{name} must be timezone-aware")
            if isinstance(value, timedelta) and value <= timedelta(0):
                raise InvalidInput(f"{name} must be in the future, got {value}")
            if isinstance(value, timedelta) and value > MAX_DEADLINE_AHEAD:
                raise InvalidInput(f"{name} must be at most {MAX_DEADLINE_AHEAD.days} days ahead, got {value}")
            if value is not None and not isinstance(value, datetime | timedelta):
                raise InvalidInput(f"{name} must be a datetime or a timedelta, got {type(value).__name__}")
        soft, hard = self.soft_deadline, self.hard_deadline
        if soft and hard and type(soft) is type(hard) and soft > hard:  # type: ignore[operator]
            raise InvalidInput("soft_deadline must not be after hard_deadline")
        if self.priority not in (None, NORMAL, LOW):
            raise InvalidInput(f"priority must be 'normal' or 'low', got {self.priority!r}")


@dataclass(frozen=True, slots=True)
class Accept:
    after: AgentRow  # the row with the move applied; its journal fields are filled in by the writer


@dataclass(frozen=True, slots=True)
class Suppress:
    reason: str


@dataclass(frozen=True, slots=True)
class Reject:
    error: Rejected
    decision: str


Decision = Accept | Suppress | Reject


def _waiting_since(row: AgentRow, phase: Phase, target: Phase, now: datetime) -> datetime | None:
    """When the agent's wait for approval began: now, on entering it; unchanged by moves within it (an escalation,
    another step of the round finishing), which change ``updated_at``; None once it is over."""
    if target is not Phase.WAITING_APPROVAL:
        return None
    return row.waiting_since if phase is Phase.WAITING_APPROVAL else now


def is_repeat_submit(row: AgentRow, command: Command) -> bool:
    """A submit of the request the agent is already on: a producer's retry."""
    return command.event is Event.SUBMIT and command.request_id == row.request_id


def decide(
    row: AgentRow,
    command: Command,
    now: datetime,
    *,
    request_seen: bool = False,
) -> Decision:
    """Decide ``command`` against the locked ``row``.

    ``request_seen``: for a submit, whether this agent had a request of that id already (request ids are each
    agent's own: another agent's never counts).
    Order matters: a duplicate submit is suppressed before its (necessarily old) revision is checked.
    """
    if command.event is Event.SUBMIT:
        if is_repeat_submit(row, command) or request_seen:
            return Suppress("duplicate_request")
        if row.archived_at is not None:
            return Reject(AgentArchived(agent_id=row.id, name=row.name), "agent_archived")
    if command.expected_revision is not None and command.expected_revision != row.revision:
        error = StaleRevision(agent_id=row.id, name=row.name, expected=command.expected_revision, current=row.revision)
        return Reject(error, "stale_revision")
    if command.event not in AFTER_HARD_DEADLINE and row.hard_deadline is not None and row.hard_deadline <= now:
        passed = HardDeadlinePassed(agent_id=row.id, name=row.name, hard_deadline=row.hard_deadline)
        return Reject(passed, "hard_deadline_passed")
    phase = Phase(row.phase)
    target = target_of(phase, command.event)
    if target is None:
        # A person is told what they may send; the system's own events (charge, finish, …) are no concern of theirs.
        allowed = [e.value for e in allowed_events(phase) if command.event not in COMMAND_EVENTS or e in COMMAND_EVENTS]
        illegal = IllegalTransition(
            agent_id=row.id, name=row.name, phase=phase.value, event=command.event.value, allowed=allowed
        )
        return Reject(illegal, "illegal_transition")
    after = replace(
        row,
        phase=target.value,
        revision=row.revision + 1,
        updated_at=now,
        spent_tokens=row.spent_tokens + command.spend.tokens,
        spent_cost=row.spent_cost + command.spend.cost,
        priority=command.priority or row.priority,
        waiting_since=_waiting_since(row, phase, target, now),
    )
    if command.event is Event.SUBMIT:
        soft, hard = resolve_deadline(command.soft_deadline, now), resolve_deadline(command.hard_deadline, now)
        if soft is not None and hard is not None and soft > hard:
            return Reject(InvalidDeadlines("soft_deadline must not be after hard_deadline"), "invalid_deadlines")
        if hard is not None and hard <= now:
            return Reject(InvalidDeadlines(f"hard_deadline {rfc3339(hard)} has passed already"), "invalid_deadlines")
        assert command.request_id is not None
        after = replace(
            after,
            request_id=command.request_id,
            request_key=request_key(row.id, command.request_id),
            soft_deadline=soft,
            hard_deadline=hard,
            priority=command.priority or NORMAL,
        )
    return Accept(after)


def as_given(deadline: datetime | timedelta | None) -> str | None:
    """A submit's deadline as the producer gave it, as text: an instant in UTC, or ``+N us`` from the submit."""
    if isinstance(deadline, timedelta):
        return f"+{deadline // timedelta(microseconds=1)}us"
    return None if deadline is None else rfc3339(deadline)


def _same_given(recorded: Any, given: str | None) -> bool:
    """Whether a deadline recorded as given names the same as ``given``: the same instant, however the time was
    spelled when it was journaled (events written before Keel had one time format keep theirs)."""
    if recorded == given:
        return True
    before, now = (parse_time(v) if isinstance(v, str) else None for v in (recorded, given))
    return before is not None and before == now


def differences(submitted: Submitted, command: Command, input_json: str) -> list[str]:
    """What a submit of an existing request id asks for that the request's first submit did not: ``input``,
    ``operation``, ``soft_deadline``, ``hard_deadline``. Requests journaled before deadlines were recorded as given
    are compared on input and operation only."""
    differs = []
    if submitted.same_input is not None:  # compared by the database, whether retention pruned the input or not
        if not submitted.same_input:
            differs.append("input")
    elif json.loads(input_json) != submitted.input:
        differs.append("input")
    first = submitted.submit_details or {}
    keys = first.get("jobs") or []
    if keys and command.jobs and split_key(keys[0])[1] != command.jobs[0].operation:
        differs.append("operation")
    given = first.get("as_given")
    if isinstance(given, dict):
        for name in ("soft_deadline", "hard_deadline"):
            if not _same_given(given.get(name), as_given(getattr(command, name))):
                differs.append(name)
    return differs


def resolve_deadline(value: datetime | timedelta | None, now: datetime) -> datetime | None:
    """An absolute deadline; a relative one counts from ``now``, the transition's time on the database's clock."""
    return now + value if isinstance(value, timedelta) else value
