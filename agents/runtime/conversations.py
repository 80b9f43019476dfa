"""A request's conversation as a person reads it — the prompt, the model's replies (their reasoning text too), the
tool calls and their results, in order — whatever ran it: Keel's own plan/tool loop, or a framework integration,
which registers how to read what its steps record (:func:`register_reader`). What an approver reads before deciding
on a held call, and what the request's record shows."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

#: ``{"role": "user" | "assistant" | "tool" | "system", "content": str}``, with ``"calls"``
#: (``[{"tool": …, "arguments": {…}}]``) on a reply that called tools, ``"reasoning"`` on one that gave its reasoning.
Message = dict[str, Any]
#: Reads an integration's steps (the request's steps whose record has the reader's key, oldest first) and the
#: request's input into messages.
Reader = Callable[[Any, list[Mapping[str, Any]]], list[Message]]

_READERS: dict[str, Reader] = {}


def register_reader(record_key: str, reader: Reader) -> None:
    """Read the steps whose stored ``record`` holds ``record_key`` with ``reader`` (an integration, at import)."""
    _READERS[record_key] = reader


def conversation_of(request_input: Any, steps: Sequence[Mapping[str, Any]]) -> list[Message]:
    """The conversation of a request from its input and its steps (``key``, ``operation``, ``status``, ``payload``,
    ``result``, oldest first), as far as the steps recorded it."""
    for record_key, reader in _READERS.items():
        theirs = [s for s in steps if isinstance(_record(s), Mapping) and record_key in _record(s)]
        if theirs:
            return reader(request_input, theirs)
    return _keel_loop(request_input, steps)


def prompt_of(request_input: Any) -> str:
    if isinstance(request_input, Mapping):
        return str(request_input.get("prompt", ""))
    return "" if request_input is None else str(request_input)


def text_of(value: Any) -> str:
    """A result or argument as a person reads it: text as it is, anything else as JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):  # pragma: no cover - JSON from storage always dumps
        return str(value)


def arguments_of(value: Any) -> Any:
    """A call's arguments as given (a JSON text is parsed; what does not parse is kept as text)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _record(step: Mapping[str, Any]) -> Any:
    result = step.get("result")
    return result.get("record") if isinstance(result, Mapping) else None


def _keel_loop(request_input: Any, steps: Sequence[Mapping[str, Any]]) -> list[Message]:
    """Keel's own loop: each plan step's reply, each tool step's result, in the order they ran (none: a request to a
    handler of its own, which has no conversation)."""
    if not any(step.get("operation") == "plan" for step in steps):
        return []
    messages: list[Message] = [{"role": "user", "content": prompt_of(request_input)}]
    for step in steps:
        result = step.get("result")
        if not isinstance(result, Mapping):
            continue
        if step.get("operation") == "plan" and isinstance(result.get("reply"), Mapping):
            reply = result["reply"]
            said: Message = {"role": "assistant", "content": str(reply.get("content") or "")}
            calls = [
                {"tool": c["function"]["name"], "arguments": arguments_of(c["function"].get("arguments"))}
                for c in reply.get("tool_calls") or ()
                if isinstance(c, Mapping) and isinstance(c.get("function"), Mapping)
            ]
            if calls:
                said["calls"] = calls
            messages.append(said)
        elif step.get("operation") == "tool" and "content" in result:
            messages.append({"role": "tool", "content": text_of(result["content"])})
    return messages
