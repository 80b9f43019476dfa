"""Local Slack, GitHub and chat-completions sinks in the real wire formats, with fault injection (tests, demo): they
record every message they accept, with its key, in arrival order, inject the fault a ``faults`` function picks per
request (``apply_then_timeout``, ``apply_then_drop``, ``429``, ``403_secondary``, ``500``, ``slow``, ``echo_token_500``:
docs/explanation/runtime-outbox-and-workers.md#the-fake-servers) and can ``plant`` a key in someone else's message.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

Faults = Callable[[str, str, int], str | None]  # (destination, key, attempt at this server) -> fault or None

MARKER = re.compile(r"<!-- keel:(?P<key>[^ ]+) -->")


@dataclass
class Accepted:
    destination: str
    key: str | None
    external_id: str


@dataclass
class FakeBase:
    token: str
    faults: Faults = field(default=lambda destination, key, attempt: None)
    timeout_delay: float = 2.0
    retry_after: float = 1.0
    accepted: list[Accepted] = field(default_factory=list)
    attempts: Counter[str] = field(default_factory=Counter)
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: ThreadingHTTPServer | None = None
    #: The port to listen on (0: any free one).
    port: int = 0
    #: Told of each message accepted (its destination and text): ``keel dev slack`` prints them.
    on_accept: Callable[[str, str], None] | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> FakeBase:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                fake._handle(self, "GET")

            def do_POST(self) -> None:
                fake._handle(self, "POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def delivered_keys(self) -> Counter[str]:
        with self.lock:
            return Counter(a.key for a in self.accepted if a.key)

    def order(self, destination: str) -> list[str]:
        with self.lock:
            return [a.key for a in self.accepted if a.destination == destination and a.key]

    # --- plumbing ---

    def _handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        with self.lock:
            self.requests += 1
        try:
            length = int(request.headers.get("Content-Length") or 0)
            raw = request.rfile.read(length) if length else b""
            self.route(request, method, raw)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (a timeout fault): nothing to answer

    def route(self, request: BaseHTTPRequestHandler, method: str, raw: bytes) -> None:
        raise NotImplementedError

    @staticmethod
    def reply(request: BaseHTTPRequestHandler, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json; charset=utf-8")
        request.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            request.send_header(name, value)
        request.end_headers()
        request.wfile.write(data)

    def fault_for(self, destination: str, key: str | None) -> str | None:
        if key is None:
            return None
        with self.lock:
            self.attempts[key] += 1
            attempt = self.attempts[key]
        return self.faults(destination, key, attempt)

    def finish_after_apply(
        self, request: BaseHTTPRequestHandler, fault: str | None, respond: Callable[[], None]
    ) -> None:
        if fault == "apply_then_drop":
            request.close_connection = True
            request.connection.shutdown(2)
            return
        if fault == "apply_then_timeout":
            time.sleep(self.timeout_delay)
        if fault == "slow":
            time.sleep(self.timeout_delay / 4)
        respond()


@dataclass
class FakeSlack(FakeBase):
    """``POST /api/chat.postMessage``, ``GET /api/conversations.history`` (with metadata and cursors) and
    ``POST /api/auth.test``. The token is a bot token (``bot_id``) of app ``app_id`` whose bot user is ``user_id``;
    ``auth_error`` makes ``auth.test`` answer with that error (e.g. ``internal_error``)."""

    channels: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    ts_counter: int = 0
    team_id: str = "T0KEEL0001"
    user_id: str = "U0KEELBOT1"
    bot_id: str = "B0KEELBOT1"
    app_id: str = "A0KEELAPP1"
    auth_error: str | None = None
    auth_tests: int = 0

    def route(self, request: BaseHTTPRequestHandler, method: str, raw: bytes) -> None:
        url = urlparse(request.path)
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return self.reply(request, 200, {"ok": False, "error": "invalid_auth"})
        if url.path == "/api/chat.postMessage" and method == "POST":
            return self.post_message(request, json.loads(raw or b"{}"))
        if url.path == "/api/auth.test":
            return self.auth_test(request)
        if url.path == "/api/conversations.history":
            # Slack takes arguments in the query string or as a form body (slack_sdk sends the latter).
            args = {k: v[0] for k, v in parse_qs(url.query).items()}
            args.update({k: v[0] for k, v in parse_qs(raw.decode()).items()})
            return self.history(request, args)
        return self.reply(request, 404, {"ok": False, "error": "unknown_method"})

    def post_message(self, request: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        channel = body.get("channel", "")
        metadata = body.get("metadata") or {}
        key = (metadata.get("event_payload") or {}).get("key")
        if channel.startswith("CMISSING"):
            return self.reply(request, 200, {"ok": False, "error": "channel_not_found"})
        if channel.startswith("COUTSIDE"):
            return self.reply(request, 200, {"ok": False, "error": "not_in_channel"})
        fault = self.fault_for(channel, key)
        if fault == "429":
            return self.reply(
                request, 429, {"ok": False, "error": "ratelimited"}, {"Retry-After": f"{self.retry_after:g}"}
            )
        if fault == "500":
            return self.reply(request, 500, {"ok": False, "error": "internal_error"})
        if fault == "echo_token_500":
            return self.reply(request, 500, {"ok": False, "error": f"upstream {request.headers.get('Authorization')}"})
        with self.lock:
            self.ts_counter += 1
            ts = f"{int(time.time())}.{self.ts_counter:06d}"
            message = self.authored(
                {"type": "message", "ts": ts, "text": body.get("text"), "metadata": metadata},
                self.user_id,
                self.bot_id,
                self.app_id,
            )
            self.channels.setdefault(channel, []).append(message)
            self.accepted.append(Accepted(channel, key, ts))
        if self.on_accept is not None:
            self.on_accept(channel, str(body.get("text") or ""))
        if fault == "apply_then_internal_error":  # Slack: "some aspect of the operation may have succeeded"
            return self.reply(request, 200, {"ok": False, "error": "internal_error"})
        self.finish_after_apply(
            request,
            fault,
            lambda: self.reply(request, 200, {"ok": True, "channel": channel, "ts": ts, "message": message}),
        )

    def authored(self, message: dict[str, Any], user: str, bot_id: str, app_id: str) -> dict[str, Any]:
        """``message`` as an app's bot posts it (Slack stamps the bot user, the bot and its app)."""
        profile = {"id": bot_id, "app_id": app_id, "name": "keel", "deleted": False, "team_id": self.team_id}
        return {
            **message,
            "user": user,
            "bot_id": bot_id,
            "app_id": app_id,
            "team": self.team_id,
            "bot_profile": profile,
        }

    def auth_test(self, request: BaseHTTPRequestHandler) -> None:
        with self.lock:
            self.auth_tests += 1
        if self.auth_error is not None:
            return self.reply(request, 200, {"ok": False, "error": self.auth_error})
        self.reply(
            request,
            200,
            {
                "ok": True,
                "url": "https://keel-test.slack.com/",
                "team": "Keel Test",
                "user": "keel",
                "team_id": self.team_id,
                "user_id": self.user_id,
                "bot_id": self.bot_id,
                "is_enterprise_install": False,
            },
        )

    def plant(self, channel: str, key: str, *, user: str = "U0OTHERBOT", bot_id: str = "B0OTHERBOT") -> str:
        """Another app's bot in ``channel`` posts a message whose metadata carries ``key`` (not counted as
        accepted: Keel did not send it). Its ts."""
        with self.lock:
            self.ts_counter += 1
            ts = f"{int(time.time())}.{self.ts_counter:06d}"
            metadata = {"event_type": "keel_outbox", "event_payload": {"key": key}}
            message = {"type": "message", "ts": ts, "text": "not from Keel", "metadata": metadata}
            self.channels.setdefault(channel, []).append(self.authored(message, user, bot_id, "A0OTHERAPP"))
        return ts

    def history(self, request: BaseHTTPRequestHandler, query: dict[str, str]) -> None:
        channel = query.get("channel", "")
        oldest = float(query.get("oldest", "0"))
        limit = min(int(query.get("limit", "100")), 200)
        offset = int(query.get("cursor") or 0)
        with_metadata = query.get("include_all_metadata") in ("1", "true", "True")
        with self.lock:
            newest_first = [m for m in reversed(self.channels.get(channel, [])) if float(m["ts"]) >= oldest]
        page = newest_first[offset : offset + limit]
        messages = [m if with_metadata else {k: v for k, v in m.items() if k != "metadata"} for m in page]
        more = offset + limit < len(newest_first)
        self.reply(
            request,
            200,
            {
                "ok": True,
                "messages": messages,
                "has_more": more,
                "response_metadata": {"next_cursor": str(offset + limit) if more else ""},
            },
        )


@dataclass
class FakeGitHub(FakeBase):
    """``POST``/``GET /repos/{owner}/{repo}/issues/{number}/comments`` (``since``, ``per_page``, ``page``) and
    ``GET /user`` (answering ``user_status`` if set). The token is ``login``'s (``user_id``), or with ``installation``
    an App installation token, which ``GET /user`` refuses and whose comments are the app's bot's."""

    comments: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    next_id: int = 1000
    login: str = "keel-bot"
    user_id: int = 4242
    installation: bool = False
    user_status: int | None = None
    user_requests: int = 0

    PATH = re.compile(r"^/repos/(?P<owner>[^/]+)/(?P<repo>[^/]+)/issues/(?P<number>\d+)/comments$")

    def route(self, request: BaseHTTPRequestHandler, method: str, raw: bytes) -> None:
        url = urlparse(request.path)
        if request.headers.get("Authorization") not in (f"Bearer {self.token}", f"token {self.token}"):
            return self.reply(request, 401, {"message": "Bad credentials", "documentation_url": "https://docs"})
        if url.path == "/user" and method == "GET":
            return self.user(request)
        match = self.PATH.match(url.path)
        if match is None or match["repo"].startswith("missing"):
            return self.reply(request, 404, {"message": "Not Found"})
        destination = f"{match['owner']}/{match['repo']}#{match['number']}"
        if method == "POST":
            return self.create(request, destination, json.loads(raw or b"{}"))
        return self.list(request, destination, {k: v[0] for k, v in parse_qs(url.query).items()})

    def create(self, request: BaseHTTPRequestHandler, destination: str, body: dict[str, Any]) -> None:
        text = body.get("body") or ""
        if not text.strip() or "[reject-422]" in text:
            return self.reply(request, 422, {"message": "Validation Failed", "errors": [{"field": "body"}]})
        found = MARKER.search(text)
        key = found["key"] if found else None
        fault = self.fault_for(destination, key)
        if fault == "429":
            return self.reply(request, 429, {"message": "Too Many Requests"}, {"Retry-After": f"{self.retry_after:g}"})
        if fault == "403_secondary":
            return self.reply(
                request,
                403,
                {"message": "You have exceeded a secondary rate limit. Please wait a few minutes."},
                {"Retry-After": f"{self.retry_after:g}"},
            )
        if fault == "500":
            return self.reply(request, 500, {"message": "Server Error"})
        if self.installation:  # an installation token posts as the app's bot user
            author, app = self.account("keel-app[bot]", 9_000_001, "Bot"), {"id": 77, "slug": "keel-app"}
        else:
            author, app = self.account(self.login, self.user_id, "User"), None
        with self.lock:
            comment = self.add_comment(destination, text, author, app)
            self.accepted.append(Accepted(destination, key, str(comment["id"])))
        self.finish_after_apply(request, fault, lambda: self.reply(request, 201, comment))

    @staticmethod
    def account(login: str, user_id: int, kind: str) -> dict[str, Any]:
        return {"login": login, "id": user_id, "node_id": f"U_{user_id}", "type": kind, "site_admin": False}

    def add_comment(
        self, destination: str, text: str, author: dict[str, Any], app: dict[str, Any] | None
    ) -> dict[str, Any]:
        """A comment on ``destination`` by ``author`` (call holding the lock)."""
        self.next_id += 1
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        comment = {
            "id": self.next_id,
            "body": text,
            "user": author,
            "author_association": "NONE",
            "performed_via_github_app": app,
            "html_url": f"{self.url}/{destination.replace('#', '/issues/')}#issuecomment-{self.next_id}",
            "created_at": now,
            "updated_at": now,
        }
        self.comments.setdefault(destination, []).append(comment)
        return comment

    def plant(self, destination: str, key: str, *, login: str = "mallory", user_id: int = 6666) -> int:
        """Another user comments on the issue with Keel's marker for ``key`` (not counted as accepted: Keel did
        not send it). The comment's id."""
        with self.lock:
            comment = self.add_comment(
                destination, f"first!\n\n<!-- keel:{key} -->", self.account(login, user_id, "User"), None
            )
        return int(comment["id"])

    def user(self, request: BaseHTTPRequestHandler) -> None:
        with self.lock:
            self.user_requests += 1
        if self.user_status is not None:
            return self.reply(request, self.user_status, {"message": "Server Error"})
        if self.installation:
            docs = "https://docs.github.com/rest/users/users#get-the-authenticated-user"
            body = {"message": "Resource not accessible by integration", "documentation_url": docs, "status": "403"}
            return self.reply(request, 403, body)
        profile = self.account(self.login, self.user_id, "User")
        self.reply(request, 200, {**profile, "html_url": f"https://github.com/{self.login}", "name": "Keel"})

    def list(self, request: BaseHTTPRequestHandler, destination: str, query: dict[str, str]) -> None:
        since = query.get("since", "")
        per_page = min(int(query.get("per_page", "30")), 100)
        page = int(query.get("page", "1"))
        with self.lock:
            selected = [c for c in self.comments.get(destination, []) if c["updated_at"] >= since]
        chunk = selected[(page - 1) * per_page : page * per_page]
        headers = {}
        if page * per_page < len(selected):
            path = urlparse(request.path).path
            headers["Link"] = f'<{self.url}{path}?since={since}&per_page={per_page}&page={page + 1}>; rel="next"'
        self.reply(request, 200, chunk, headers)


@dataclass
class FakeLLM(FakeBase):
    """``POST /v1/chat/completions`` in OpenAI's wire format, replying by the conversation's turn so a retried call
    gets the same reply. ``fault``: ``429``, ``500``, ``timeout``, ``context`` or ``401``; ``slow_turns`` delays those
    turns; ``completed`` counts answers actually delivered per turn."""

    replies: list[dict[str, Any]] = field(default_factory=list)
    fault: str | None = None
    slow_turns: set[int] = field(default_factory=set)
    requests_seen: list[dict[str, Any]] = field(default_factory=list)
    completed: Counter[int] = field(default_factory=Counter)
    custom: tuple[int, Any, dict[str, str]] | None = None  # answer every call with (status, body, headers)

    def route(self, request: BaseHTTPRequestHandler, method: str, raw: bytes) -> None:
        if urlparse(request.path).path != "/v1/chat/completions" or method != "POST":
            return self.reply(request, 404, {"error": {"message": "not found"}})
        if self.fault == "401" or request.headers.get("Authorization") != f"Bearer {self.token}":
            return self.reply(
                request, 401, {"error": {"message": "Incorrect API key provided", "code": "invalid_api_key"}}
            )
        body = json.loads(raw or b"{}")
        with self.lock:
            self.requests_seen.append(body)
        if self.custom is not None:
            status, payload, headers = self.custom
            return self.reply(request, status, payload, headers)
        if self.fault == "429":
            return self.reply(request, 429, {"error": {"message": "Rate limit reached"}}, {"retry-after": "3"})
        if self.fault == "500":
            return self.reply(request, 500, {"error": {"message": "The server had an error"}})
        if self.fault == "context":
            error = {"message": "This model's maximum context length is 8192 tokens", "code": "context_length_exceeded"}
            return self.reply(request, 400, {"error": error})
        turn = sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")
        if self.fault == "timeout" or turn in self.slow_turns:
            time.sleep(self.timeout_delay)
        planned: dict[str, Any] = self.replies[turn] if turn < len(self.replies) else {"content": "done"}
        prompt, completion = planned.get("usage", (10, 5))
        message: dict[str, Any] = {"role": "assistant", "content": planned.get("content")}
        if planned.get("tool_calls"):
            message["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in planned["tool_calls"]
            ]
        self.reply(
            request,
            200,
            {
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "finish_reason": "tool_calls" if planned.get("tool_calls") else "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "total_tokens": prompt + completion,
                },
            },
        )
        with self.lock:
            self.completed[turn] += 1
