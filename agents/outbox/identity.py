"""Who Keel posts as at each receiver, as the receiver itself says (never configured), and the one test (``claim``)
of whether a message found there is Keel's delivery of a key: anyone who may post there can copy Keel's key into a
message of their own (docs/explanation/runtime-outbox-and-workers.md#reconciliation-and-planted-keys).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

#: Slack message metadata ``event_type`` of Keel's messages; the key is in its ``event_payload``.
METADATA_EVENT = "keel_outbox"

#: What a message at the receiver is to a key: Keel's delivery of it, someone else's message carrying it, or neither
#: (None).
Claim = Literal["keel", "planted"]


def marker(key: str) -> str:
    """The hidden marker a GitHub comment of Keel's carries."""
    return f"<!-- keel:{key} -->"


@dataclass(frozen=True, slots=True)
class Planted:
    """A message at the receiver carrying a key that someone other than Keel wrote: never a delivery."""

    external_id: str
    author: str


@dataclass(frozen=True, slots=True)
class SlackIdentity:
    """What ``auth.test`` says of Keel's token: its user (a bot token's bot user) and, for a bot token, its bot."""

    user_id: str
    bot_id: str | None

    def claim(self, message: Mapping[str, Any], key: str) -> Claim | None:
        metadata = message.get("metadata") or {}
        if metadata.get("event_type") != METADATA_EVENT or (metadata.get("event_payload") or {}).get("key") != key:
            return None
        ours = message.get("user") == self.user_id or (self.bot_id is not None and message.get("bot_id") == self.bot_id)
        return "keel" if ours else "planted"

    @staticmethod
    def author(message: Mapping[str, Any]) -> str:
        return f"user {message.get('user')} bot {message.get('bot_id')} app {message.get('app_id')}"


@dataclass(frozen=True, slots=True)
class GitHubIdentity:
    """What ``GET /user`` says of Keel's token: the account Keel comments as (its id is what counts: a login can be
    renamed and taken by someone else)."""

    user_id: int
    login: str

    def claim(self, comment: Mapping[str, Any], key: str) -> Claim | None:
        if marker(key) not in (comment.get("body") or ""):
            return None
        return "keel" if (comment.get("user") or {}).get("id") == self.user_id else "planted"

    @staticmethod
    def author(comment: Mapping[str, Any]) -> str:
        user = comment.get("user") or {}
        return f"user {user.get('login')!r} (id {user.get('id')})"
