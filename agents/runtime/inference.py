"""Inference providers: one protocol, an OpenAI-compatible chat-completions client, and a scripted provider. A
provider turns a conversation and the tools on offer into a :class:`Reply` (a final answer or tool calls, with usage
and cost) and raises failures as :class:`~agents.core.errors.JobError` subclasses, so the job runner retries them by
class (which class for which answer: docs/explanation/runtime-outbox-and-workers.md#inference-providers).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from email.utils import parsedate_to_datetime
from typing import Any, Literal, Protocol

import httpx
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from agents.core.commands import MAX_COST, MAX_TOKENS, Usage, check_json_text
from agents.core.errors import InvalidInput, InvalidJob, RateLimited, TransientError
from agents.core.json_input import parse_json
from agents.jobs.handlers import describe

Message = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Reply:
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    usage: Usage = field(default_factory=Usage)

    def checkpoint(self) -> dict[str, Any]:
        return {"reply": self.as_message(), "tokens": self.usage.tokens, "cost": str(self.usage.cost)}

    @classmethod
    def from_checkpoint(cls, data: Mapping[str, Any]) -> Reply:
        message = data["reply"]
        calls = tuple(
            ToolCall(c["id"], c["function"]["name"], json.loads(c["function"].get("arguments") or "{}"))
            for c in message.get("tool_calls") or []
        )
        return cls(message.get("content"), calls, Usage(int(data.get("tokens", 0)), Decimal(str(data.get("cost", 0)))))

    def as_message(self) -> dict[str, Any]:
        """The assistant message to put back into the conversation."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(dict(c.arguments))},
                }
                for c in self.tool_calls
            ]
        return message


class Provider(Protocol):
    def complete(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]], *, attempt: int = 1) -> Reply:
        """``attempt`` is the step's attempt number (1 first); real providers ignore it."""
        ...


def cost_of(
    prices: Mapping[str, Mapping[str, float]], model: str, prompt_tokens: int, completion_tokens: int
) -> Decimal:
    """Cost from a price table of USD per million tokens: ``{"model": {"input": 0.15, "output": 0.6}}``."""
    price = prices.get(model)
    if price is None:
        return Decimal(0)
    per_million = Decimal(1_000_000)
    cost = (
        Decimal(str(price.get("input", 0))) * prompt_tokens + Decimal(str(price.get("output", 0))) * completion_tokens
    ) / per_million
    return min(cost, MAX_COST - Decimal("0.000001"))  # an absurd reported count is capped where it can be recorded


class OpenAICompatible:
    """``POST {base_url}/chat/completions`` with tools; no hidden retries (the job runner owns them)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None,
        *,
        timeout: float = 60.0,
        prices: Mapping[str, Mapping[str, float]] | None = None,
        connections: int = 1000,
    ) -> None:
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.model = model
        self.prices = prices or {}
        self.api_key = api_key
        # One connection per call in flight (a worker keeps hundreds): httpx's default of 100 would queue the rest,
        # and a call queued past the timeout would fail as if the endpoint had.
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        self.client = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout, headers=headers, limits=limits)

    def close(self) -> None:
        self.client.close()

    def complete(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]], *, attempt: int = 1) -> Reply:
        body: dict[str, Any] = {"model": self.model, "messages": list(messages)}
        if tools:
            body["tools"] = list(tools)
        try:
            response = self.client.post("/chat/completions", json=body)
        except httpx.TimeoutException as exc:
            raise TransientError(f"model call timed out ({type(exc).__name__})") from None
        except httpx.TransportError as exc:
            raise TransientError(f"model endpoint unreachable ({type(exc).__name__})") from None
        if response.status_code != 200:
            raise self._error(response)
        try:
            data = response.json()
        except (ValueError, RecursionError):  # not JSON, or nested past what the parser can follow
            kind = response.headers.get("content-type", "no content type")
            raise InvalidJob(
                f"the model endpoint answered 200 with a body that is not JSON ({kind}, {len(response.content)} bytes)",
                usage=Usage(),  # nothing readable was reported: nothing to charge
            ) from None
        if not isinstance(data, dict):
            kind = _JSON_KINDS.get(type(data), type(data).__name__)
            raise InvalidJob(f"the model endpoint's reply is a JSON {kind}, not an object", usage=Usage())
        return parse_reply(data, self._usage(data.get("usage")))

    def _usage(self, reported: Any) -> Usage:
        """What the provider says the call cost; missing or nonsensical counts are taken as 0."""
        if not isinstance(reported, dict):
            return Usage()
        prompt, completion = _count(reported.get("prompt_tokens")), _count(reported.get("completion_tokens"))
        total = _count(reported.get("total_tokens")) or prompt + completion
        return Usage(total, cost_of(self.prices, self.model, prompt, completion))

    def _error(self, response: httpx.Response) -> Exception:
        status = response.status_code
        try:
            body = response.json()
        except (ValueError, RecursionError):
            body = None
        raw_error = body.get("error") if isinstance(body, dict) else None
        error = raw_error if isinstance(raw_error, dict) else {"message": str(raw_error or "")}
        message = str(error.get("message") or response.reason_phrase)[:300]
        if self.api_key:
            message = message.replace(self.api_key, "***")
        code = str(error.get("code") or "")
        if status == 429 and code == "insufficient_quota":
            return InvalidJob(f"the model account has no quota left: {message}")
        if status == 429:
            return RateLimited(f"model rate limited: {message}", retry_after=_retry_after(response))
        if status >= 500:
            return TransientError(f"model endpoint error {status}: {message}")
        if code == "context_length_exceeded" or "context length" in message.lower():
            return InvalidJob(f"the conversation no longer fits the model's context: {message}")
        return InvalidJob(f"model refused the request ({status}): {message}")


_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# A tool call id that can be a key segment as it is; anything else is mapped by tool_call_key.
_KEY_SAFE_CALL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]{0,63}$")


def tool_call_key(call_id: str) -> str:
    """The model's tool call id as it appears in keys (``{request}:tool:{name}:{round}.{key}``): kept if it is 1-64
    letters, digits, '_' and '-', else a readable prefix plus a hash of the whole id (stable, distinct, idempotent).
    Only keys use it: the model is answered with its own id."""
    if _KEY_SAFE_CALL_ID.fullmatch(call_id):
        return call_id
    digest = hashlib.sha256(call_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    prefix = re.sub(r"^[^A-Za-z0-9]+", "", re.sub(r"[^A-Za-z0-9_\-]+", "_", call_id))[:40]
    return f"{prefix or 'call'}-{digest}"


def parse_reply(data: Mapping[str, Any], usage: Usage) -> Reply:
    """A chat-completions body as a :class:`Reply`; a malformed one raises :class:`InvalidJob` carrying ``usage``."""

    def malformed(problem: str) -> InvalidJob:
        return InvalidJob(f"the model's reply is malformed: {problem}", usage=usage)

    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        raise malformed("it has no choices")
    message = choices[0].get("message") if isinstance(choices[0], dict) else None
    if not isinstance(message, dict):
        raise malformed("its first choice has no message")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise malformed(f"message.content is a {type(content).__name__}, not text")
    raw_calls = message.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise malformed(f"message.tool_calls is a {type(raw_calls).__name__}, not a list")
    calls = []
    for n, call in enumerate(raw_calls, 1):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise malformed(f"tool call {n} has no function.name")
        assert isinstance(call, dict) and isinstance(function, dict)
        call_id = call.get("id")
        if not isinstance(call_id, str):
            raise malformed(f"tool call {n} ({name[:64]!a}) has no id")
        raw_arguments = function.get("arguments")
        if raw_arguments is None or raw_arguments == "":
            arguments: Any = {}
        elif isinstance(raw_arguments, str):
            try:  # the same bounds as a person's JSON: a reply nested 100,000 deep is malformed, not a crash
                arguments = parse_json("arguments", raw_arguments, limit=MAX_ARGUMENT_CHARS)
            except InvalidInput as exc:
                raise InvalidJob(f"the model sent malformed arguments for {name[:64]!a} ({exc})", usage=usage) from None
        else:
            arguments = raw_arguments
        if not isinstance(arguments, dict):
            kind = _JSON_KINDS.get(type(arguments), type(arguments).__name__)
            raise malformed(f"the arguments of tool call {n} ({name[:64]!a}) are a JSON {kind}, not an object")
        calls.append(ToolCall(call_id, name, arguments))
    reply = Reply(content, tuple(calls), usage)
    # The reply is stored (checkpoint, result, journal): PostgreSQL refuses a lone surrogate and a NUL anywhere.
    try:
        check_json_text("the reply", {"content": content, "tool_calls": [[c.id, c.name, c.arguments] for c in calls]})
    except InvalidInput as exc:
        raise malformed(str(exc)) from None
    return reply


#: The most a tool call's arguments may hold (a Slack post is at most 40,000 characters, a GitHub comment 65,000).
MAX_ARGUMENT_CHARS = 1_048_576
_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0 or value == float("inf"):
        return 0
    return min(int(value), MAX_TOKENS)  # an absurd count is capped where it can still be recorded


def _retry_after(response: httpx.Response) -> float:
    value = response.headers.get("retry-after", "")
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        # An HTTP date is measured against the endpoint's own clock (its Date header), not this host's.
        try:
            server_now = parsedate_to_datetime(response.headers["date"])
        except (KeyError, TypeError, ValueError):
            server_now = datetime.now(UTC)
        return max(0.0, (parsedate_to_datetime(value) - server_now).total_seconds())
    except (TypeError, ValueError):
        return 5.0


class ScriptedCall(BaseModel):
    """One tool call of a scripted reply: the tool's name (as the model sees it) and its arguments."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64)
    arguments: dict[str, Any] = Field(default_factory=dict)


class ScriptEntry(BaseModel):
    """One scripted model reply: a final answer (``content``) or tool calls, with what it costs (``tokens``,
    ``cost`` in USD); with ``error``, the step's first ``times`` attempts fail that way before it is replied."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    content: str | None = None
    tool_calls: list[ScriptedCall] = Field(default_factory=list)
    error: Literal["transient", "rate_limited", "invalid"] | None = None
    times: int = Field(default=1, ge=1, le=1000)
    retry_after: float = Field(default=0.1, ge=0, le=3600)
    tokens: int = Field(default=100, ge=0, le=MAX_TOKENS)
    cost: Decimal = Field(default=Decimal("0.001"), ge=0, lt=MAX_COST)

    @model_validator(mode="after")
    def _says_something(self) -> ScriptEntry:
        if self.content is None and not self.tool_calls:
            # An error entry too: it is what the model replies once the entry's errors are spent.
            raise ValueError("a reply needs content or tool_calls (an error entry too: its reply after the errors)")
        return self


_SCRIPT = TypeAdapter(list[ScriptEntry])


def parse_script(script: Any) -> tuple[ScriptEntry, ...]:
    """A request's ``script`` as entries; one that is not in the format fails the step as ``invalid`` (the client
    refuses it at submit already: this guards requests that reached the database some other way)."""
    try:
        return tuple(_SCRIPT.validate_python(script))
    except ValidationError as exc:
        raise InvalidJob(f"the scripted provider cannot play this script: {describe(exc, 'input.script')}") from None


#: How the stand-in model starts every answer: a reader can tell at once that no model wrote it.
STAND_IN = "[stand-in model]"


@dataclass(frozen=True, slots=True)
class StandInProvider:
    """What ``KEEL_LLM_PROVIDER=scripted`` (the default) answers a request that carries no ``script``, outside
    production: one final answer that says it is a stand-in and quotes the prompt (its first 200 characters), so a
    first request runs end to end before any model is configured. Deterministic, offline and free."""

    def complete(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]], *, attempt: int = 1) -> Reply:
        prompt = next((str(m.get("content") or "") for m in reversed(messages) if m.get("role") == "user"), "")
        shown = prompt if len(prompt) <= 200 else prompt[:199] + "…"
        return Reply(
            f"{STAND_IN} You asked: {shown!r}. No model is configured, so this answer is Keel's stand-in: set"
            " KEEL_LLM_PROVIDER=openai (with KEEL_LLM_BASE_URL and KEEL_LLM_API_KEY) for a real one, or give the"
            " request a script of replies.",
            (),
            Usage(0),
        )


@dataclass
class ScriptedProvider:
    """Replays a script of :class:`ScriptEntry` replies, deterministic and offline (tests, demo): the entry played is
    the number of assistant messages already in the conversation, so a replay after a crash gives the same reply."""

    script: Sequence[ScriptEntry]

    def complete(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]], *, attempt: int = 1) -> Reply:
        turn = sum(1 for m in messages if m.get("role") == "assistant")
        if turn >= len(self.script):
            return Reply("(the script has ended)", (), Usage(1))
        entry = self.script[turn]
        usage = Usage(entry.tokens, entry.cost)
        if entry.error is not None and attempt <= entry.times:
            if entry.error == "rate_limited":
                raise RateLimited("scripted 429", retry_after=entry.retry_after, usage=usage)
            if entry.error == "invalid":
                raise InvalidJob("scripted 400", usage=usage)
            raise TransientError("scripted 503", usage=usage)
        calls = tuple(ToolCall(f"call_{turn}_{i}", c.name, c.arguments) for i, c in enumerate(entry.tool_calls))
        return Reply(entry.content, calls, usage)
