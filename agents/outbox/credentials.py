"""Which channels the outbox relay can send on: a channel's sender needs its token, and a message on a channel
without one goes dead unsent. One rule, read by the relay as it builds its senders and records such a message dead,
and by the start-up warning of the processes that run the relay (``keel worker``, ``keel up``)."""

from __future__ import annotations

from models.settings import Settings
from models.tables import CHANNELS

#: The setting each channel's sender takes its token from.
TOKEN_SETTINGS: dict[str, str] = {"slack": "KEEL_SLACK_TOKEN", "github": "KEEL_GITHUB_TOKEN"}

#: What puts messages on each channel, as the start-up warning names it.
_SENT_BY: dict[str, str] = {
    "slack": "Slack messages (slack_post, approval and deadline notices, alerts, KPI reports)",
    "github": "GitHub messages (github_comment)",
}


def sender_token(settings: Settings, channel: str) -> str | None:
    """The token ``channel``'s sender sends with; None when its setting is not set: the relay then has no sender
    for the channel, and each of its messages goes dead with :func:`not_configured`."""
    secret = {"slack": settings.slack_token, "github": settings.github_token}.get(channel)
    return None if secret is None else secret.get_secret_value()


def not_configured(channel: str) -> str:
    """The dead reason of a message on a channel the relay has no sender for."""
    return f"{channel} is not configured: set {TOKEN_SETTINGS.get(channel, f'KEEL_{channel.upper()}_TOKEN')}"


def missing_senders(settings: Settings) -> list[str]:
    """One warning per channel whose sender has no token under ``settings``: which setting, what becomes of the
    messages on it, and what to do. Empty when every sender can send."""
    return [
        f"{TOKEN_SETTINGS[channel]} is not set: {_SENT_BY[channel]} will go dead unsent"
        f' ("{not_configured(channel)}"); set it, then `keel outbox retry KEY` revives a dead one'
        for channel in CHANNELS
        if sender_token(settings, channel) is None
    ]
