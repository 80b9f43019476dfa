"""The outbox's senders, Slack (slack_sdk) and GitHub (REST over httpx): each sends a message carrying its key and
finds it again at the receiver (only a message Keel itself wrote counts), with the client's own retries off and every
error text scrubbed of the token (docs/explanation/runtime-outbox-and-workers.md#senders).
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import re
import socket
import threading
import time
import urllib.error
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, Generic, Literal, Protocol, TypeVar

import httpx
from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError

from agents.outbox.identity import METADATA_EVENT, GitHubIdentity, Planted, SlackIdentity, marker

FailureKind = Literal["ambiguous", "rate_limited", "transient", "permanent"]


@dataclass(frozen=True, slots=True)
class Delivered:
    external_id: str
    url: str | None = None


@dataclass(frozen=True, slots=True)
class SendFailed:
    """``ambiguous``: the receiver may have applied it (timeout or dropped connection after sending);
    ``rate_limited``: try again after ``retry_after``; ``transient``: not applied, try again; ``permanent``: never."""

    kind: FailureKind
    error: str
    retry_after: float | None = None


@dataclass(frozen=True, slots=True)
class ScanLimit:
    """How much of a receiver's history one reconciliation may read: ``max_pages`` pages, and no page started
    after ``deadline`` (``time.monotonic()``)."""

    max_pages: int
    deadline: float

    def reached(self, pages: int) -> SendFailed | None:
        """None while another page may be read; else why not (the key was not found in what was read)."""
        if pages >= self.max_pages:
            return SendFailed("transient", f"the key was not in the first {pages} pages (the page cap)")
        if time.monotonic() >= self.deadline:
            return SendFailed("transient", f"the key was not in the {pages} pages read in the time allowed")
        return None


@dataclass(frozen=True, slots=True)
class Lookup:
    """What a look for a key at the receiver found. ``outcome``: Keel's own message carrying it, None if the receiver
    surely holds none, a failure if that cannot be told; ``planted``: messages carrying it that others wrote."""

    outcome: Delivered | SendFailed | None
    planted: tuple[Planted, ...] = ()


class Sender(Protocol):
    """Sends messages to one receiver (Slack, GitHub) and finds them there again by key."""

    def send(self, key: str, destination: str, payload: Mapping[str, Any]) -> Delivered | SendFailed: ...

    def find(self, key: str, destination: str, since: datetime, limit: ScanLimit) -> Lookup:
        """Keel's own message carrying ``key`` if the receiver has it (looking only at what is newer than
        ``since``); None if it surely does not; a failure if that cannot be told within ``limit`` — or without
        knowing who Keel posts there as."""
        ...

    def close(self) -> None: ...


def redact(text: str, *secrets: str | None) -> str:
    """``text`` with every secret replaced by ``***`` (secrets too short to be real tokens are left alone)."""
    for secret in secrets:
        if secret and len(secret) >= 8:
            text = text.replace(secret, "***")
    return text


Who = TypeVar("Who", SlackIdentity, GitHubIdentity)


class Learnt(Generic[Who]):
    """One sender's identity, learnt from the receiver once per token and kept for the process (a failure is not
    kept). One call asks at a time; the others wait at most ``wait`` seconds for its answer."""

    def __init__(self, wait: float) -> None:
        self.wait = wait
        self._lock = threading.Lock()
        self._known: tuple[bytes, Who] | None = None
        self._asking: threading.Event | None = None
        self._failure = SendFailed("transient", "still asking the receiver who Keel posts as")

    def get(self, token: str, learn: Callable[[], Who | SendFailed]) -> Who | SendFailed:
        digest = hashlib.sha256(token.encode()).digest()
        with self._lock:
            if self._known is not None and self._known[0] == digest:
                return self._known[1]
            asking = self._asking
            if asking is None:  # nobody is asking: this call does
                self._asking = threading.Event()
        if asking is not None:
            asking.wait(self.wait)
            with self._lock:
                known = self._known[1] if self._known is not None and self._known[0] == digest else None
                return known if known is not None else self._failure
        found: Who | SendFailed = self._failure
        try:
            found = learn()
            return found
        finally:
            with self._lock:
                if isinstance(found, SendFailed):
                    self._failure = found
                else:
                    self._known = (digest, found)
                event, self._asking = self._asking, None
            if event is not None:
                event.set()


def _unknown_identity(failure: SendFailed) -> SendFailed:
    """Reconciliation cannot take anything for Keel's without knowing who Keel is: never "delivered", wait."""
    kind: FailureKind = "rate_limited" if failure.kind == "rate_limited" else "transient"
    return SendFailed(kind, f"who Keel posts as is unknown: {failure.error}", failure.retry_after)


def _network_failure(exc: BaseException, where: str) -> SendFailed:
    """Before the request was written (refused, DNS) nothing happened; after, the receiver may have it. ``where``:
    the receiver's address as configured, so that the error says which setting to look at."""
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, ConnectionRefusedError | socket.gaierror) or isinstance(exc, httpx.ConnectError):
        return SendFailed("transient", f"connection to {where} failed: {type(reason).__name__}")
    return SendFailed("ambiguous", f"no response from {where}: {type(reason).__name__}: {reason}")


# --- Slack ------------------------------------------------------------------------------------------------------

# Slack says of these that some of the operation may have succeeded: after a send, the outcome is unknown.
_SLACK_MAYBE_APPLIED = {"internal_error", "fatal_error", "request_timeout"}
# Worth retrying, nothing applied. Every other Slack error (channel_not_found, not_in_channel, invalid_auth, …)
# is final.
_SLACK_TRANSIENT = {"service_unavailable", "team_added_to_org"}
_SLACK_RATE_LIMITS = {"ratelimited", "rate_limited", "message_limit_exceeded"}


class _Redacting(logging.Filter):
    """slack_sdk logs response bodies it cannot parse (a proxy's error page may echo the Authorization header)."""

    def __init__(self, *secrets: str) -> None:
        super().__init__()
        self.secrets = secrets

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = redact(record.getMessage(), *self.secrets)
        record.args = None
        return True


class SlackSender:
    def __init__(self, token: str, base_url: str, timeout: float) -> None:
        self.token = token
        sdk_log = logging.getLogger(f"keel.slack_sdk.{id(self)}")
        sdk_log.addFilter(_Redacting(token))
        # retry_handlers=[]: slack_sdk would otherwise re-send once on a connection error, behind our back.
        self.client = WebClient(
            token=token, base_url=base_url, timeout=int(max(1, timeout)), retry_handlers=[], logger=sdk_log
        )
        self._identity: Learnt[SlackIdentity] = Learnt(timeout)

    def identity(self) -> SlackIdentity | SendFailed:
        """Who Keel posts as, by ``auth.test`` (a bot token: its bot user and bot), once per token."""
        return self._identity.get(self.token, self._auth_test)

    def _auth_test(self) -> SlackIdentity | SendFailed:
        try:
            response = self.client.auth_test()
        except SlackApiError as exc:
            failure = self._api_failure(exc, sent=False)
            return failure if failure.kind != "ambiguous" else SendFailed("transient", failure.error)
        except (OSError, urllib.error.URLError, http.client.HTTPException) as exc:
            return self._scrub(SendFailed("transient", f"auth.test failed: {type(exc).__name__}"))
        user_id, bot_id = response.get("user_id"), response.get("bot_id")
        if not isinstance(user_id, str) or not user_id:
            return SendFailed("transient", "slack: auth.test named no user_id")
        return SlackIdentity(user_id, bot_id if isinstance(bot_id, str) and bot_id else None)

    def send(self, key: str, destination: str, payload: Mapping[str, Any]) -> Delivered | SendFailed:
        try:
            response = self.client.chat_postMessage(
                channel=destination,
                text=payload["text"],
                blocks=payload.get("blocks"),
                metadata={"event_type": METADATA_EVENT, "event_payload": {"key": key}},
            )
        except SlackApiError as exc:
            return self._api_failure(exc, sent=True)
        except (OSError, urllib.error.URLError, http.client.HTTPException) as exc:
            return self._scrub(_network_failure(exc, f"Slack at {self.client.base_url} (KEEL_SLACK_API_URL)"))
        return Delivered(str(response["ts"]), None)

    def find(self, key: str, destination: str, since: datetime, limit: ScanLimit) -> Lookup:
        identity = self.identity()
        if isinstance(identity, SendFailed):
            return Lookup(_unknown_identity(identity))
        planted: list[Planted] = []
        cursor: str | None = None
        pages = 0
        try:
            while True:
                if pages and (stop := limit.reached(pages)):
                    return Lookup(stop, tuple(planted))
                pages += 1
                page = self.client.conversations_history(
                    channel=destination,
                    oldest=f"{since.timestamp():.6f}",
                    limit=200,
                    include_all_metadata=True,
                    cursor=cursor,
                )
                messages: list[dict[str, Any]] = page.get("messages", [])
                for message in messages:
                    claim = identity.claim(message, key)
                    if claim == "keel":
                        return Lookup(Delivered(str(message["ts"]), None), tuple(planted))
                    if claim == "planted":
                        planted.append(Planted(str(message.get("ts")), identity.author(message)))
                cursor = (page.get("response_metadata") or {}).get("next_cursor") or None
                if not page.get("has_more") or not cursor:
                    return Lookup(None, tuple(planted))
        except SlackApiError as exc:
            failure = self._api_failure(exc, sent=False)
            return Lookup(failure if failure.kind != "ambiguous" else SendFailed("transient", failure.error))
        except (OSError, urllib.error.URLError, http.client.HTTPException) as exc:
            return Lookup(self._scrub(SendFailed("transient", f"history read failed: {type(exc).__name__}")))

    def _api_failure(self, exc: SlackApiError, *, sent: bool) -> SendFailed:
        response = exc.response
        code = response.get("error") if isinstance(response.data, dict) else None
        status = response.status_code
        unsure: FailureKind = "ambiguous" if sent else "transient"
        if status == 429 or code in _SLACK_RATE_LIMITS:
            retry_after = float(response.headers.get("Retry-After", response.headers.get("retry-after", 30)))
            return SendFailed("rate_limited", f"slack: {code or 429} (retry after {retry_after:g}s)", retry_after)
        if status >= 500 or code is None or code in _SLACK_MAYBE_APPLIED:  # no answer we can read: unknown
            return self._scrub(SendFailed(unsure, f"slack: HTTP {status} {code or 'unreadable response'}"))
        if code in _SLACK_TRANSIENT:
            return SendFailed("transient", f"slack: {code}")
        return self._scrub(SendFailed("permanent", f"slack: {code or f'HTTP {status}'}"))

    def _scrub(self, failure: SendFailed) -> SendFailed:
        return SendFailed(failure.kind, redact(failure.error, self.token), failure.retry_after)

    def close(self) -> None:
        """slack_sdk opens a connection per request: nothing to close."""


# --- GitHub -----------------------------------------------------------------------------------------------------

_GITHUB_DESTINATION = re.compile(r"^(?P<owner>[^/]+)/(?P<repo>[^#]+)#(?P<number>\d+)$")
_PERMANENT_STATUSES = {400, 401, 403, 404, 410, 422}


class GitHubSender:
    def __init__(self, token: str, base_url: str, timeout: float, transport: httpx.BaseTransport | None = None) -> None:
        self.token = token
        # httpx never retries on its own (no transport retries configured): the outbox owns retries.
        self.client = httpx.Client(
            base_url=base_url.rstrip("/"),
            timeout=timeout,
            transport=transport,
            headers={
                "Authorization": f"Bearer {token}",
                "Accept": "application/vnd.github+json",
                "X-GitHub-Api-Version": "2022-11-28",
                "User-Agent": "keel-outbox",
            },
        )
        self._identity: Learnt[GitHubIdentity] = Learnt(timeout)

    def identity(self) -> GitHubIdentity | SendFailed:
        """The account Keel comments as, by ``GET /user``, once per token. A GitHub App installation token cannot
        say (GitHub answers 403): it is refused, since no comment of Keel's could then be told from a planted one."""
        return self._identity.get(self.token, self._whoami)

    def _whoami(self) -> GitHubIdentity | SendFailed:
        try:
            response = self.client.get("/user")
        except httpx.TransportError as exc:
            return self._scrub(SendFailed("transient", f"GET /user failed: {type(exc).__name__}"))
        if response.status_code == 200:
            user = response.json()
            if isinstance(user, dict) and isinstance(user.get("id"), int):
                return GitHubIdentity(user["id"], str(user.get("login")))
            return SendFailed("transient", "github: GET /user named no account id")
        failure = self._http_failure(response, sent=False)
        if response.status_code == 403 and failure.kind == "permanent":
            return SendFailed(
                "permanent",
                f"{failure.error} (GET /user): this token cannot say which account it comments as, so Keel could not"
                " tell its own comments from planted ones; a GitHub App installation token is not supported: use a"
                " personal access token of the account Keel comments as",
            )
        return failure

    @staticmethod
    def _path(destination: str) -> str:
        match = _GITHUB_DESTINATION.fullmatch(destination)
        if match is None:
            raise ValueError(f"not a GitHub destination: {destination!r}")
        return f"/repos/{match['owner']}/{match['repo']}/issues/{match['number']}/comments"

    def send(self, key: str, destination: str, payload: Mapping[str, Any]) -> Delivered | SendFailed:
        identity = self.identity()  # a token whose comments could never be reconciled posts none
        if isinstance(identity, SendFailed):
            return identity
        body = f"{payload['body']}\n\n{marker(key)}"
        try:
            response = self.client.post(self._path(destination), json={"body": body})
        except httpx.TransportError as exc:
            return self._scrub(_network_failure(exc, f"GitHub at {self.client.base_url} (KEEL_GITHUB_API_URL)"))
        if response.status_code == 201:
            data = response.json()
            return Delivered(str(data["id"]), data.get("html_url"))
        return self._http_failure(response, sent=True)

    def find(self, key: str, destination: str, since: datetime, limit: ScanLimit) -> Lookup:
        identity = self.identity()
        if isinstance(identity, SendFailed):
            return Lookup(_unknown_identity(identity))
        planted: list[Planted] = []
        url: str | None = self._path(destination)
        params: dict[str, Any] | None = {"since": since.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "per_page": 100}
        pages = 0
        try:
            while url:
                if pages and (stop := limit.reached(pages)):
                    return Lookup(stop, tuple(planted))
                pages += 1
                response = self.client.get(url, params=params)
                if response.status_code != 200:
                    failure = self._http_failure(response, sent=False)
                    unsure = failure if failure.kind != "ambiguous" else SendFailed("transient", failure.error)
                    return Lookup(unsure, tuple(planted))
                for comment in response.json():
                    claim = identity.claim(comment, key)
                    if claim == "keel":
                        return Lookup(Delivered(str(comment["id"]), comment.get("html_url")), tuple(planted))
                    if claim == "planted":
                        planted.append(Planted(str(comment.get("id")), identity.author(comment)))
                next_link = response.links.get("next", {}).get("url")
                url, params = (next_link, None) if next_link else (None, None)
        except httpx.TransportError as exc:
            return Lookup(self._scrub(SendFailed("transient", f"comment listing failed: {type(exc).__name__}")))
        return Lookup(None, tuple(planted))

    def _http_failure(self, response: httpx.Response, *, sent: bool) -> SendFailed:
        status = response.status_code
        try:
            message = str(response.json().get("message", ""))
        except ValueError:
            message = ""
        remaining = response.headers.get("x-ratelimit-remaining")
        secondary = status == 403 and ("secondary rate limit" in message.lower() or "abuse" in message.lower())
        throttled = status == 403 and ("retry-after" in response.headers or remaining == "0")
        if status == 429 or secondary or throttled:
            retry_after = _github_retry_after(response)
            error = f"github: {status} rate limited{' (secondary)' if secondary else ''}, retry after {retry_after:g}s"
            return SendFailed("rate_limited", error, retry_after)
        if status >= 500:
            kind: FailureKind = "ambiguous" if sent else "transient"
            return self._scrub(SendFailed(kind, f"github: HTTP {status}"))
        if status in _PERMANENT_STATUSES:
            return self._scrub(SendFailed("permanent", f"github: HTTP {status} {message[:300]}".strip()))
        return self._scrub(SendFailed("transient", f"github: HTTP {status}"))

    def _scrub(self, failure: SendFailed) -> SendFailed:
        return SendFailed(failure.kind, redact(failure.error, self.token), failure.retry_after)

    def close(self) -> None:
        self.client.close()


def _server_now(response: httpx.Response) -> datetime:
    """The receiver's clock at the response (its ``Date`` header), or this host's if it sent none."""
    try:
        return parsedate_to_datetime(response.headers["date"])
    except (KeyError, TypeError, ValueError):
        return datetime.now(UTC)


def _github_retry_after(response: httpx.Response) -> float:
    if "retry-after" in response.headers:
        return max(0.0, float(response.headers["retry-after"]))
    if "x-ratelimit-reset" in response.headers:
        # Measured against the receiver's own clock (its Date header), not this host's.
        return max(1.0, float(response.headers["x-ratelimit-reset"]) - _server_now(response).timestamp())
    return 60.0  # GitHub's advice for a secondary limit without headers: wait at least a minute
