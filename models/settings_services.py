"""The settings of the services outside Keel: the model endpoint the steps call, and Slack and GitHub, which only
the outbox relay talks to. A part of :class:`models.settings.Settings`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, SecretStr, field_validator


class ServiceFields(BaseModel):
    """``KEEL_LLM_*``, ``KEEL_SLACK_*``, ``KEEL_GITHUB_*``, ``KEEL_OUTBOX_*`` and the channels Keel posts to."""

    llm_provider: Literal["scripted", "openai"] = Field(
        default="scripted",
        description=(
            "`scripted` replays the model replies a request carries in its input (`script`: tests, the demo, "
            "offline use), and answers one without them with a labelled stand-in that repeats the prompt; `openai` "
            "calls an OpenAI-compatible chat-completions endpoint."
        ),
    )
    llm_base_url: str = Field(
        default="https://api.openai.com/v1",
        description="The OpenAI-compatible endpoint `KEEL_LLM_PROVIDER=openai` calls.",
    )
    llm_model: str = Field(
        default="gpt-4o-mini",
        description="The model `KEEL_LLM_PROVIDER=openai` asks for.",
    )
    llm_api_key: SecretStr | None = Field(
        default=None,
        description="The model endpoint's API key; required when `KEEL_LLM_PROVIDER=openai` calls api.openai.com.",
    )
    llm_timeout_seconds: float = Field(
        default=60.0,
        gt=0,
        description="How long one model call may take.",
    )
    llm_prices: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description=(
            'USD per million tokens, per model, e.g. `{"gpt-4o-mini": {"input": 0.15, "output": 0.6}}`: what spend '
            "and budgets count."
        ),
    )
    llm_system_prompt: str = Field(
        default="You are a careful assistant. Use the tools when they help; answer briefly.",
        description="The system message that opens every plan step's conversation.",
    )

    # Tokens are secrets: never logged, never in error text.
    slack_token: SecretStr | None = Field(
        default=None,
        description="The relay's Slack bot token. Unset: Slack messages cannot be sent.",
    )
    slack_api_url: str = Field(
        default="https://slack.com/api/",
        description="Slack's Web API.",
    )
    github_token: SecretStr | None = Field(
        default=None,
        description=(
            "The GitHub token the relay comments with: a personal access token of the account Keel comments as (not a"
            " GitHub App installation token). Unset: GitHub comments cannot be sent."
        ),
    )
    github_api_url: str = Field(
        default="https://api.github.com",
        description="GitHub's REST API (GitHub Enterprise: its `/api/v3`).",
    )
    http_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        description="How long one request to Slack or GitHub may take.",
    )
    notify_slack_channel: str | None = Field(
        default=None,
        description=(
            "Slack conversation id (`C…`, `G…` or `D…`, not `#name`) where a hard-deadline stop is announced. Unset: "
            "nothing is sent."
        ),
    )
    approval_slack_channel: str | None = Field(
        default=None,
        description=(
            "Slack conversation id where a call waiting for approval is announced and its decision followed up. "
            "Unset: nothing is sent."
        ),
    )
    approval_escalation_slack_channel: str | None = Field(
        default=None,
        description=(
            'Slack conversation id told (once) when a call to a tool with `on_timeout="escalate"` waits past its '
            "`approval_timeout`."
        ),
    )
    approval_check_seconds: float = Field(
        default=5.0,
        gt=0,
        description="How often the leading beat applies tools' approval timeouts.",
    )
    outbox_interval_seconds: float = Field(
        default=0.5,
        gt=0,
        description="How often the beat schedules a relay pass.",
    )
    outbox_concurrency: int = Field(
        default=8,
        ge=1,
        le=128,
        description="Destinations the relay sends to at once.",
    )
    outbox_lease_seconds: float = Field(
        default=60.0,
        gt=0,
        description="A claimed message's lease: at least 3 x `KEEL_HTTP_TIMEOUT_SECONDS`.",
    )
    outbox_max_attempts: int = Field(
        default=12,
        ge=1,
        description="Attempts before a message is dead (rate limits aside).",
    )
    outbox_backoff_seconds: float = Field(
        default=1.0,
        gt=0,
        description=(
            "The first backoff after a 5xx or a network error; it doubles up to `KEEL_OUTBOX_BACKOFF_MAX_SECONDS`."
        ),
    )
    outbox_backoff_max_seconds: float = Field(
        default=300.0,
        gt=0,
        description="The longest backoff after a 5xx or a network error.",
    )
    outbox_pass_seconds: float = Field(
        default=10.0,
        gt=0,
        description="One relay pass sends for at most this long.",
    )
    outbox_max_rate_limited: int = Field(
        default=200,
        ge=1,
        description="Rate-limited attempts (429, secondary limits) before a message is dead.",
    )
    outbox_reconcile_max_pages: int = Field(
        default=10,
        ge=1,
        description="Pages of channel history or issue comments one reconciliation reads.",
    )
    outbox_reconcile_seconds: float | None = Field(
        default=None,
        gt=0,
        description=(
            "One reconciliation's time budget; plus `KEEL_HTTP_TIMEOUT_SECONDS`, less than the lease. Unset: a third "
            "of `KEEL_OUTBOX_LEASE_SECONDS`."
        ),
    )

    @field_validator("llm_prices")
    @classmethod
    def _prices_are_per_direction(cls, value: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        for model, price in value.items():
            if not price or set(price) - {"input", "output"}:
                raise ValueError(f"{model}: give prices as {{'input': …, 'output': …}} (USD per million tokens)")
            if any(p < 0 for p in price.values()):
                raise ValueError(f"{model}: prices must not be negative")
        return value
