"""The producer API: ``Client`` on Keel's database and ``HttpClient`` over its HTTP API, with the same methods to
create agents, submit requests, approve, reject, cancel, and read state and the journal. docs/explanation/clients.md
explains how they behave."""

from agents.client.base import Publisher, submit_publisher
from agents.client.checks import AgentRef, Deadline
from agents.client.direct import Client
from agents.client.errors import AccessDenied, ApiUnavailable
from agents.client.http import HttpClient

__all__ = [
    "AccessDenied",
    "AgentRef",
    "ApiUnavailable",
    "Client",
    "Deadline",
    "HttpClient",
    "Publisher",
    "submit_publisher",
]
