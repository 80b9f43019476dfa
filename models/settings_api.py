"""The settings of the HTTP API and the operator console (`keel serve`): a part of :class:`models.settings.Settings`."""

from __future__ import annotations

import ipaddress

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

#: What an API token may be allowed to do (see agents/ingress). Rate limits are set per scope.
SCOPES = ("producer", "approver", "operator", "auditor")


class ScopeRateLimit(BaseModel):
    """One scope's default rate control: ``rate`` requests per second sustained, ``burst`` at once (a token
    bucket holding ``burst`` requests that refills at ``rate`` per second)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rate: float = Field(gt=0, le=1_000_000, allow_inf_nan=False)
    burst: int = Field(ge=1, le=1_000_000)

    @field_validator("rate", "burst", mode="before")
    @classmethod
    def _not_a_boolean(cls, value: object) -> object:
        if isinstance(value, bool):  # JSON true would otherwise pass as 1
            raise ValueError("must be a number, not true or false")
        return value


#: Producers are services submitting work: the most headroom. Approvers are people in the console (a page makes a
#: few reads, an approval one write). Operators are people and their scripts (retries, cancels). Auditors read the
#: journal page by page.
DEFAULT_API_RATE_LIMITS: dict[str, ScopeRateLimit] = {
    "producer": ScopeRateLimit(rate=50, burst=100),
    "approver": ScopeRateLimit(rate=5, burst=20),
    "operator": ScopeRateLimit(rate=20, burst=50),
    "auditor": ScopeRateLimit(rate=10, burst=50),
}


class ApiFields(BaseModel):
    """``KEEL_API_*`` and ``KEEL_CONSOLE_*``."""

    api_rate_limit_enabled: bool = Field(
        default=True,
        description=(
            "Per-token rate limits on the HTTP API (`KEEL_API_RATE_LIMITS`), shared by every API process through "
            "Redis; `false` turns them off."
        ),
    )
    api_rate_limits: dict[str, ScopeRateLimit] = Field(
        default_factory=lambda: dict(DEFAULT_API_RATE_LIMITS),
        description=(
            'Per scope (`producer`, `approver`, `operator`, `auditor`) overrides as JSON, e.g. `{"producer": {"rate":'
            ' 100, "burst": 200}}`: `rate` requests per second sustained, `burst` requests at once; scopes not named '
            "keep their defaults. A token with several scopes gets the most generous of their limits."
        ),
    )

    api_host: str = Field(
        default="127.0.0.1",
        description="The address `keel serve` listens on (`--host` overrides it).",
    )
    api_port: int = Field(
        default=8000,
        ge=1,
        le=65535,
        description="The port `keel serve` listens on (`--port` overrides it).",
    )
    api_workers: int = Field(
        default=1,
        ge=1,
        le=64,
        description=(
            "uvicorn worker processes of `keel serve` (`--workers` overrides it); above 1 they share one metrics "
            "directory, so `/metrics` answers for all, and `KEEL_CONSOLE_SESSION_KEY` is required."
        ),
    )
    api_max_body_bytes: int = Field(
        default=256 * 1024,
        ge=1024,
        description="Largest request body the API reads: a larger one is refused with 413 before it is parsed.",
    )
    api_max_streams_per_token: int = Field(
        default=100,
        ge=1,
        le=100_000,
        description=(
            "Live event streams (API and console) one token may hold open in one API process; past it 429 "
            "`too-many-streams`."
        ),
    )
    api_max_streams_per_process: int = Field(
        default=1000,
        ge=1,
        le=100_000,
        description=(
            "Live event streams one API process holds open in all; past it 429 `too-many-streams`. Each is a socket: "
            "keep `ulimit -n` above it."
        ),
    )
    api_shutdown_seconds: int = Field(
        default=25,
        ge=0,
        le=3600,
        description=(
            "On SIGTERM, how long `keel serve` gives requests in flight before it cuts them (event streams end at "
            "once); keep it below the process manager's own grace period (compose: 30 s)."
        ),
    )
    api_public_url: str | None = Field(
        default=None,
        description=(
            "The address people and producers reach the API at, used in the links of Slack notices and the demo's "
            "summary: set it behind a proxy or a load balancer. Unset: `http://KEEL_API_HOST:KEEL_API_PORT`."
        ),
    )
    api_forwarded_allow_ips: list[str] = Field(
        default_factory=list,
        description=(
            "The reverse proxies `keel serve` believes `X-Forwarded-For` / `X-Forwarded-Proto` from, as a JSON list "
            'of addresses or networks (e.g. `["10.0.0.0/8"]`; `*` is refused); empty: no one, the connection\'s own '
            "address is the client's (it is what the console's sign-in limit counts by)."
        ),
    )

    console_session_key: SecretStr | None = Field(
        default=None,
        description=(
            "Signs the console's session cookies (32 characters or more); required with `KEEL_API_WORKERS` above 1; "
            "set it with several API hosts, or to keep sessions across restarts. Unset: a random key per API process."
        ),
    )
    #: Failed tokens, counted in Redis per client address and over all addresses together; why the global cap never
    #: refuses a real token by itself: docs/explanation/ingress-and-audit.md#guessing-tokens-the-sign-in-limits.
    console_signin_limit_enabled: bool = Field(
        default=True,
        description=(
            "Limit failed tokens (unknown or revoked), at the console's sign-in and in API calls alike, per client "
            "address; `false` turns the limit off."
        ),
    )
    console_signin_burst: int = Field(
        default=10,
        ge=1,
        le=1_000_000,
        description=(
            "Failed tokens one client address may send at once; past it the address is refused (429) before its token"
            " is looked up."
        ),
    )
    console_signin_per_minute: float = Field(
        default=5.0,
        gt=0,
        le=1_000_000,
        allow_inf_nan=False,
        description="Failed tokens a client address gets back a minute.",
    )
    console_signin_global_burst: int = Field(
        default=100,
        ge=1,
        le=1_000_000,
        description=(
            "Failed tokens over every address together (at least `KEEL_CONSOLE_SIGNIN_BURST`); past it, one failure "
            "uses up its address's allowance, and a real token is never refused by it."
        ),
    )
    console_signin_global_per_minute: float = Field(
        default=60.0,
        gt=0,
        le=1_000_000,
        allow_inf_nan=False,
        description="Failed tokens every address together gets back a minute.",
    )
    console_page_size: int = Field(
        default=100,
        ge=1,
        le=1000,
        description="Rows per page of the console's lists: agents, the outbox's unsent messages, an agent's journal.",
    )

    @field_validator("api_rate_limits")
    @classmethod
    def _rate_limits_are_per_known_scope(cls, value: dict[str, ScopeRateLimit]) -> dict[str, ScopeRateLimit]:
        unknown = set(value) - set(SCOPES)
        if unknown:
            raise ValueError(f"unknown scopes {sorted(unknown)}; known: {list(SCOPES)}")
        return {**DEFAULT_API_RATE_LIMITS, **value}

    @field_validator("api_forwarded_allow_ips")
    @classmethod
    def _forwarded_allow_ips_are_addresses(cls, value: list[str]) -> list[str]:
        for entry in value:
            if entry.strip() == "*":
                raise ValueError(
                    "name the proxies' addresses or networks (e.g. 10.0.0.0/8), not '*': with '*' any client could"
                    " claim any address"
                )
            try:
                ipaddress.ip_network(entry.strip(), strict=True)
            except ValueError:
                raise ValueError(
                    f"{entry[:60]!r} is not an IP address or network (e.g. 10.0.0.7, 10.0.0.0/8, fd00::/8; a network"
                    " without host bits set)"
                ) from None
        return [entry.strip() for entry in value]

    @field_validator("console_session_key")
    @classmethod
    def _session_key_is_long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 32:
            raise ValueError("must be at least 32 characters (it signs the console's session cookies)")
        return value
