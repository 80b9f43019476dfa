"""An HTTP/1.1 proxy in front of a real ``keel serve`` that a test scripts faults into, request by request.

It parses each request (h11, the HTTP/1.1 state machine httpx itself is built on), then, if a fault is queued for
that request's method and path, acts it out instead of a plain forward:

- ``reset``: the connection is reset before the request is forwarded (the server never sees it);
- ``lose``: the request is forwarded and the server's whole answer read, then the connection is closed without a
  byte of it reaching the client (the server applied it; the client cannot know);
- ``503``: a 503 problem answer from the proxy itself, without forwarding (a load balancer with no backend);
  ``500``: the same with 500 (a server error before the upstream saw it);
- ``stall``: the request is forwarded and the answer read, then nothing is sent back until the client gives up
  (its read times out) or 30 s pass: a timeout after the server applied the request;
- ``hold``: the request is not forwarded and nothing is answered until the client gives up or 30 s pass (a
  request that never reached the server, its client left waiting).

Everything else is forwarded as it comes, streams included (Server-Sent Events go through chunk by chunk), and
``cut()`` closes every open client connection, as a network that drops does. ``seen`` records each request: its
method, path and what happened (the upstream status — "201 lost" when its answer was dropped — or the fault)."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import h11
import httpx

# Hop-by-hop headers, and those the forwarding itself sets again.
_DROP_REQUEST = {b"host", b"connection", b"keep-alive", b"transfer-encoding", b"content-length"}
_DROP_RESPONSE = {b"connection", b"keep-alive", b"transfer-encoding"}
FAULTS = ("reset", "lose", "503", "500", "stall", "hold")


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    outcome: str  # the upstream status ("201"), or the fault acted out


class FaultyProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = httpx.Client(base_url=upstream, timeout=httpx.Timeout(30, read=None))
        self.seen: list[Seen] = []
        self._faults: deque[tuple[str, str, str]] = deque()
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def fail(self, method: str, path: str, *faults: str) -> None:
        """Act out ``faults`` in turn on the next requests whose method is ``method`` and path starts with
        ``path`` (the query string aside)."""
        unknown = set(faults) - set(FAULTS)
        assert not unknown, f"unknown faults {unknown}: one of {FAULTS}"
        with self._lock:
            self._faults.extend((method, path, fault) for fault in faults)

    def pending_faults(self) -> int:
        with self._lock:
            return len(self._faults)

    def outcomes(self, method: str, path: str) -> list[str]:
        """What happened to each request of ``method`` whose path (query aside) is ``path``, in order."""
        return [s.outcome for s in self.seen if s.method == method and s.path.split("?")[0] == path]

    def cut(self) -> None:
        """Close every open client connection (a stream in progress ends mid-way)."""
        with self._lock:
            sockets, self._open = self._open, set()
        for sock in sockets:
            _reset(sock)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.close()
        self.cut()
        self.upstream.close()

    def __enter__(self) -> FaultyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                self._open.add(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _fault_for(self, method: str, path: str) -> str | None:
        with self._lock:
            for queued in self._faults:
                if queued[0] == method and path.split("?")[0].startswith(queued[1]):
                    self._faults.remove(queued)
                    return queued[2]
        return None

    def _note(self, method: str, path: str, outcome: str) -> None:
        with self._lock:
            self.seen.append(Seen(method, path, outcome))

    def _serve(self, client: socket.socket) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request, body = _read_request(conn, client)
                if request is None:
                    return
                method, path = request.method.decode(), request.target.decode()
                fault = self._fault_for(method, path)
                if fault in ("reset", "503", "500", "hold"):
                    self._note(method, path, fault)
                if fault == "reset":
                    return
                if fault == "hold":
                    _wait_for_close(client)
                    return
                if fault in ("503", "500"):
                    headers = [(b"content-type", b"application/problem+json"), _length(_UNAVAILABLE)]
                    _send(conn, client, int(fault), headers, [_UNAVAILABLE])
                else:
                    self._forward(conn, client, request, body, lose=fault in ("lose", "stall"))
                    if fault == "stall":
                        _wait_for_close(client)
                    if fault in ("lose", "stall"):
                        return
                if conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (OSError, h11.ProtocolError, httpx.TransportError):
            return
        finally:
            with self._lock:
                self._open.discard(client)
            _reset(client)

    def _forward(
        self, conn: h11.Connection, client: socket.socket, request: h11.Request, body: bytes, *, lose: bool
    ) -> None:
        method, path = request.method.decode(), request.target.decode()
        headers = [(k.decode(), v.decode()) for k, v in request.headers if k.lower() not in _DROP_REQUEST]
        response = self.upstream.send(
            self.upstream.build_request(method, path, headers=headers, content=body), stream=True
        )
        try:
            if lose:
                response.read()
                self._note(method, path, f"{response.status_code} lost")
                return
            self._note(method, path, str(response.status_code))  # a stream is noted when it starts
            kept = [(k, v) for k, v in response.headers.raw if k.lower() not in _DROP_RESPONSE]
            _send(conn, client, response.status_code, kept, response.iter_raw())
        finally:
            response.close()


_UNAVAILABLE = json.dumps(
    {"type": "/problems/unavailable", "title": "Service unavailable", "status": 503, "detail": "no backend (proxy)"}
).encode()


def _read_request(conn: h11.Connection, client: socket.socket) -> tuple[h11.Request | None, bytes]:
    request: h11.Request | None = None
    body = b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(client.recv(65536))
        elif isinstance(event, h11.Request):
            request = event
            if conn.they_are_waiting_for_100_continue:  # S3 clients send Expect: 100-continue with a body
                client.sendall(conn.send(h11.InformationalResponse(status_code=100, headers=[])) or b"")
        elif isinstance(event, h11.Data):
            body += bytes(event.data)
        elif isinstance(event, h11.EndOfMessage):
            return request, body
        else:  # ConnectionClosed, or PAUSED after a close
            return None, b""


def _length(body: bytes) -> tuple[bytes, bytes]:
    return b"content-length", str(len(body)).encode()


def _send(
    conn: h11.Connection,
    client: socket.socket,
    status: int,
    headers: list[tuple[bytes, bytes]],
    chunks: Iterable[bytes],
) -> None:
    """One response to the client; a stream's chunks are passed on as they come."""
    client.sendall(conn.send(h11.Response(status_code=status, headers=headers)) or b"")
    for chunk in chunks:
        if chunk:
            client.sendall(conn.send(h11.Data(data=chunk)) or b"")
    client.sendall(conn.send(h11.EndOfMessage()) or b"")


def _wait_for_close(client: socket.socket) -> None:
    client.settimeout(30)
    with contextlib.suppress(OSError):
        while client.recv(65536):  # until the client closes its end (or dies)
            pass


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset (linger 0), as a dropped connection looks to the other side."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()
