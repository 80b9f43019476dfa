"""The settings of the services outside Keel: the model endpoint the steps call, and Slack and GitHub, which only
the outbox relay talks to. A part of :class:`models.settings.Settings`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, SecretStr, field_validator


class ServiceFields(BaseModel):
    """``KEEL_LLM_*``, ``KEEL_SLACK_*``, ``KEEL_GITHUB_*``, ``KEEL_OUTBOX_*`` and the channels Keel posts to."""

    # Inference: "scripted" replays the conversation each request carries in its input (tests, the demo, offline
    # use); "openai" calls an OpenAI-compatible chat-completions endpoint.
    llm_provider: Literal["scripted", "openai"] = "scripted"
    llm_base_url: str = "https://api.openai.com/v1"
    llm_model: str = "gpt-4o-mini"
    llm_api_key: SecretStr | None = None
    llm_timeout_seconds: float = Field(default=60.0, gt=0)
    # USD per million tokens, e.g. {"gpt-4o-mini": {"input": 0.15, "output": 0.6}}.
    llm_prices: dict[str, dict[str, float]] = Field(default_factory=dict)
    llm_system_prompt: str = "You are a careful assistant. Use the tools when they help; answer briefly."

    # The outbox relay and the receivers it talks to. Tokens are secrets: never logged, never in error text.
    slack_token: SecretStr | None = None
    slack_api_url: str = "https://slack.com/api/"
    github_token: SecretStr | None = None
    github_api_url: str = "https://api.github.com"
    http_timeout_seconds: float = Field(default=10.0, gt=0)
    # Where Keel tells people it stopped a request at its hard deadline (a Slack channel), if anywhere.
    notify_slack_channel: str | None = None
    # Where people are told that a tool call waits for their approval and how it was decided (a Slack channel), if
    # anywhere; and where a call is escalated when its tool's approval timeout passes with on_timeout="escalate".
    approval_slack_channel: str | None = None
    approval_escalation_slack_channel: str | None = None
    # How often the leading beat looks for calls that waited longer than their tool's approval timeout.
    approval_check_seconds: float = Field(default=5.0, gt=0)
    outbox_interval_seconds: float = Field(default=0.5, gt=0)
    outbox_concurrency: int = Field(default=8, ge=1, le=128)  # destinations sent to at once
    outbox_lease_seconds: float = Field(default=60.0, gt=0)
    outbox_max_attempts: int = Field(default=12, ge=1)
    outbox_backoff_seconds: float = Field(default=1.0, gt=0)
    outbox_backoff_max_seconds: float = Field(default=300.0, gt=0)
    outbox_pass_seconds: float = Field(default=10.0, gt=0)  # one relay pass sends for at most this long
    outbox_max_rate_limited: int = Field(default=200, ge=1)  # rate-limited attempts before a message is dead
    outbox_reconcile_max_pages: int = Field(default=10, ge=1)  # history/comment pages one reconciliation reads
    outbox_reconcile_seconds: float | None = Field(default=None, gt=0)  # its time budget; None: a third of the lease

    @field_validator("llm_prices")
    @classmethod
    def _prices_are_per_direction(cls, value: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        for model, price in value.items():
            if not price or set(price) - {"input", "output"}:
                raise ValueError(f"{model}: give prices as {{'input': …, 'output': …}} (USD per million tokens)")
            if any(p < 0 for p in price.values()):
                raise ValueError(f"{model}: prices must not be negative")
        return value
