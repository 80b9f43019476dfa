"""Tools the model may call: registered with ``@tool`` under the one name the model calls them by, their input
validated by pydantic. A tool returns the content the model sees next and any Slack/GitHub messages, which the
outbox sends in the transition that records the result, never the tool itself (names, message keys, approval:
docs/explanation/runtime-outbox-and-workers.md#tools).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from importlib.metadata import entry_points
from typing import Any, get_type_hints

from pydantic import BaseModel, Field, ValidationError

from agents.core.commands import MessageSpec, Usage
from agents.core.errors import InvalidJob


@dataclass(frozen=True, slots=True)
class ToolContext:
    key: str
    request_id: str
    call_id: str


@dataclass(frozen=True, slots=True)
class ToolOutput:
    content: str
    messages: tuple[MessageSpec, ...] = ()
    usage: Usage = field(default_factory=Usage)


#: What OpenAI-compatible endpoints accept as a function name, and so what a tool may be called.
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True, slots=True)
class Tool:
    name: str  # e.g. "slack_post": what the model calls, and what keys, state and journal say
    fn: Callable[[Any, ToolContext], ToolOutput]
    input_model: type[BaseModel]
    needs_approval: bool
    timeout: float
    description: str
    #: How long a call may wait for a person before ``on_timeout`` applies (None: as long as it takes).
    approval_timeout: timedelta | None = None
    #: ``reject`` (the model is told the call timed out) or ``escalate`` (the escalation channel is told, once; the
    #: call keeps waiting).
    on_timeout: str = "reject"

    def schema(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry for this tool."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.input_model.model_json_schema(),
            },
        }

    def validate(self, arguments: Mapping[str, Any]) -> BaseModel:
        try:
            return self.input_model.model_validate(dict(arguments))
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "arguments"
            raise InvalidJob(f"tool {self.name}: {where}: {err['msg']}") from None


_TOOLS: dict[str, Tool] = {}


ON_TIMEOUT = ("reject", "escalate")


def tool(
    name: str,
    *,
    needs_approval: bool = False,
    timeout: float = 30.0,
    description: str | None = None,
    approval_timeout: timedelta | None = None,
    on_timeout: str = "reject",
) -> Callable[[Callable[[Any, ToolContext], ToolOutput]], Callable[[Any, ToolContext], ToolOutput]]:
    """Register a tool called ``name`` (1-64 letters, digits, ``_``, ``-``), its input model the annotation of its
    first parameter. With ``needs_approval``, ``approval_timeout`` rejects a call that waits longer, or escalates it
    once with ``on_timeout="escalate"``."""
    if approval_timeout is not None and not needs_approval:
        raise ValueError(f"tool {name}: approval_timeout needs needs_approval=True")
    if approval_timeout is not None and approval_timeout <= timedelta(0):
        raise ValueError(f"tool {name}: approval_timeout must be positive, got {approval_timeout}")
    if on_timeout not in ON_TIMEOUT:
        raise ValueError(f"tool {name}: on_timeout must be 'reject' or 'escalate', got {on_timeout!r}")
    if not TOOL_NAME.fullmatch(name):
        raise ValueError(
            f"tool name {name!r} is invalid: 1-64 letters, digits, '_' or '-' (the model calls a tool by its name,"
            " and function names cannot contain dots)"
        )

    def register(fn: Callable[[Any, ToolContext], ToolOutput]) -> Callable[[Any, ToolContext], ToolOutput]:
        params = list(inspect.signature(fn).parameters)
        model = get_type_hints(fn).get(params[0]) if params else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise TypeError(f"tool {name}: the first parameter must be annotated with a pydantic model")
        if name in _TOOLS and _TOOLS[name].fn is not fn:
            raise ValueError(f"a tool named {name!r} is registered already")
        _TOOLS[name] = Tool(
            name,
            fn,
            model,
            needs_approval,
            timeout,
            description or (fn.__doc__ or name).strip(),
            approval_timeout,
            on_timeout,
        )
        return fn

    return register


def registered() -> dict[str, Tool]:
    return dict(_TOOLS)


def by_name(name: str) -> Tool | None:
    """The tool the model called ``name``: exactly that name, no other spelling."""
    return _TOOLS.get(name)


def stored_tool(name: str) -> Tool | None:
    """The tool a stored step names. Steps recorded before tools had one name each carry the dotted name
    (``slack.post``): they still find their tool."""
    return _TOOLS.get(name) or _TOOLS.get(name.replace(".", "_"))


#: How a framework integration's operation checks a person's edit of a held call's arguments (agents/integrations):
#: ``check(tool_name, arguments)`` returns them as the tool will take them, or raises InvalidJob saying what is wrong.
ArgumentCheck = Callable[[str, Mapping[str, Any]], dict[str, Any]]
_ARGUMENT_CHECKS: dict[str, ArgumentCheck] = {}


def register_argument_check(operation: str, check: ArgumentCheck) -> None:
    """Let a person's edited arguments for a call held by ``operation``'s run be checked before they are accepted."""
    _ARGUMENT_CHECKS[operation] = check


def argument_check(operation: str) -> ArgumentCheck | None:
    """The check an integration registered for ``operation`` (None: none in this process)."""
    return _ARGUMENT_CHECKS.get(operation)


def load_entry_points() -> None:
    for point in entry_points(group="keel.tools"):
        point.load()


# --- built-ins ----------------------------------------------------------------------------------------------------


class SlackPost(BaseModel):
    channel: str = Field(pattern=r"^[CGD][A-Z0-9]{1,20}$", description="Slack conversation id, e.g. C0123ABCD")
    text: str = Field(min_length=1, max_length=40_000)


@tool("slack_post", description="Post a message to a Slack channel (sent once, through Keel's outbox).")
def slack_post(args: SlackPost, ctx: ToolContext) -> ToolOutput:
    message = MessageSpec("slack", args.channel, "post", {"text": args.text})
    return ToolOutput(f"queued for {args.channel}", messages=(message,))


class GitHubComment(BaseModel):
    repository: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9\-]{0,38}/[A-Za-z0-9._\-]{1,100}$", description="owner/repo"
    )
    issue: int = Field(ge=1, le=9_999_999_999)
    body: str = Field(min_length=1, max_length=65_000)


@tool(
    "github_comment",
    needs_approval=True,
    description="Comment on a GitHub issue or pull request (a person approves it first; sent once).",
)
def github_comment(args: GitHubComment, ctx: ToolContext) -> ToolOutput:
    message = MessageSpec("github", f"{args.repository}#{args.issue}", "comment", {"body": args.body})
    return ToolOutput(f"comment queued on {args.repository}#{args.issue}", messages=(message,))
