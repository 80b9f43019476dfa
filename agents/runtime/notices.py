"""What people are told about a call that waits for approval: Slack messages sent through the outbox, each keyed
from the gate step it is about so it is sent once, with the call's arguments redacted and bounded (more:
docs/explanation/runtime-outbox-and-workers.md#approval-notices).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from agents.core import approval_notices as kinds
from agents.core.commands import MessageSpec
from agents.core.redaction import redact_value
from models.settings import Settings

#: The most of a call's arguments a message shows (as JSON); the console shows them whole.
MAX_ARGUMENTS_CHARS = 1500


def console_link(settings: Settings, agent_name: str) -> str:
    """The console page of an agent (``KEEL_API_PUBLIC_URL``, else the API's own host and port)."""
    base = settings.api_public_url or f"http://{settings.api_host}:{settings.api_port}"
    return f"{base.rstrip('/')}/agents/{quote(agent_name, safe='')}"


def shown_arguments(arguments: Mapping[str, Any]) -> str:
    """A call's arguments as people read them in a message: redacted, at most :data:`MAX_ARGUMENTS_CHARS`."""
    text = json.dumps(redact_value(dict(arguments)), sort_keys=True, ensure_ascii=False)
    if len(text) > MAX_ARGUMENTS_CHARS:
        text = text[: MAX_ARGUMENTS_CHARS - 1] + "…"
    return text


def waiting_notice(
    channel: str, gate: str, *, agent: str, tool: str, arguments: Mapping[str, Any], link: str
) -> MessageSpec:
    """ "A call waits for you": the agent, the tool, its arguments and where to decide."""
    text = (
        f"Agent {agent} waits for approval to call {tool} with {shown_arguments(arguments)}.\n"
        f"Approve or reject it: {link}"
    )
    return kinds.notice(channel, gate, kinds.WAITING, text)


def decided_notice(
    channel: str, gate: str, *, agent: str, tool: str, outcome: str, by: str, escalation: bool = False
) -> MessageSpec:
    """The follow-up once the call is decided, on the approval channel (or, with ``escalation``, the escalation
    channel): ``outcome`` is approved, approved with edited arguments, rejected, or rejected: timed out."""
    kind = kinds.ESCALATION_DECIDED if escalation else kinds.DECIDED
    return kinds.notice(channel, gate, kind, f"Agent {agent}'s call to {tool}: {outcome} (by {by}).")


def escalation_notice(
    channel: str, gate: str, *, agent: str, tool: str, waited: str, arguments: Mapping[str, Any], link: str
) -> MessageSpec:
    """The call waited longer than its tool's approval timeout and still waits: the escalation channel is told."""
    text = (
        f"Escalated: agent {agent} has waited {waited} for approval to call {tool} with"
        f" {shown_arguments(arguments)}.\nApprove or reject it: {link}"
    )
    return kinds.notice(channel, gate, kinds.ESCALATED, text)
