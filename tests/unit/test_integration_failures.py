"""How each integration classifies its framework's failures for Keel's retry policy (agents/integrations): a provider's
429 is rate_limited after its Retry-After, 5xx (and 408, 409) transient, other 4xx and the framework's own refusals
invalid; anything else is left to the seam (unknown)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from langgraph.errors import GraphRecursionError
from langgraph.graph import START, MessagesState, StateGraph
from pydantic_ai import Agent
from pydantic_ai.exceptions import ModelHTTPError, UnexpectedModelBehavior, UsageLimitExceeded
from pydantic_ai.models.test import TestModel

from agents.core.errors import InvalidJob, RateLimited, TransientError
from agents.integrations.langgraph import KeelGraph
from agents.integrations.pydantic_ai import KeelAgent
from agents.jobs.handlers import Registry

PYDANTIC_AI = KeelAgent(Agent(TestModel(), name="classified"), name="classified_pai", registry=Registry())


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (ModelHTTPError(503, "m", body="busy"), TransientError),
        (ModelHTTPError(408, "m", body="timeout"), TransientError),
        (ModelHTTPError(400, "m", body="bad"), InvalidJob),
        (UsageLimitExceeded("request_limit of 50 exceeded"), InvalidJob),
        (UnexpectedModelBehavior("no tool call"), InvalidJob),
    ],
)
def test_pydantic_ai_failures_are_classified(error: Exception, kind: type) -> None:
    assert type(PYDANTIC_AI.classify(error)) is kind


def test_pydantic_ai_leaves_an_error_of_its_own_to_the_seam() -> None:
    assert PYDANTIC_AI.classify(ValueError("a bug")) is None


def _graph() -> KeelGraph:
    builder: StateGraph[Any] = StateGraph(MessagesState)
    builder.add_node("n", lambda state: {})
    builder.add_edge(START, "n")
    return KeelGraph(builder, name="classified_lg", registry=Registry())


class _ProviderError(Exception):
    """As LangChain's model clients raise them: a status code, and the response's headers."""

    def __init__(self, status: int, headers: dict[str, str] | None = None) -> None:
        super().__init__(f"HTTP {status}")
        self.status_code = status
        self.response = SimpleNamespace(status_code=status, headers=headers or {})


def test_langgraph_failures_are_classified() -> None:
    graph = _graph()
    limited = graph.classify(_ProviderError(429, {"retry-after": "7"}))
    assert isinstance(limited, RateLimited) and limited.retry_after == 7.0
    dated = graph.classify(_ProviderError(429, {"retry-after": "Wed, 21 Oct 2026 07:28:00 GMT"}))
    assert isinstance(dated, RateLimited) and dated.retry_after is None  # a date: the retry policy's backoff
    assert type(graph.classify(_ProviderError(503))) is TransientError
    assert type(graph.classify(_ProviderError(409))) is TransientError
    assert type(graph.classify(_ProviderError(404))) is InvalidJob
    assert type(graph.classify(GraphRecursionError("limit"))) is InvalidJob
    assert graph.classify(ValueError("a bug")) is None
