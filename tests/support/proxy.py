"""A TCP forwarder a test can cut: processes reach PostgreSQL (or Redis) through it, and ``down()`` makes the server
vanish for them (connections reset, new ones refused) while the test itself still reaches it directly. With a
``delay``, every reply waits that long before it is passed on: a server far away, or slow to answer."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

from sqlalchemy.engine import make_url


class Proxy:
    def __init__(self, connect: Callable[[], socket.socket], *, delay: float = 0.0) -> None:
        self.connect = connect
        self.delay = delay
        self.port = 0
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()

    def up(self) -> Proxy:
        """Listen (on the same port as before, if it listened before) and forward every connection."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def down(self) -> None:
        """Refuse new connections and reset every open one, as a database that went away does."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            sockets, self._open = self._open, set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by down()
            try:
                server = self.connect()
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:  # went down meanwhile
                    client.close()
                    server.close()
                    return
                self._open |= {client, server}
            for source, sink, delay in ((client, server, 0.0), (server, client, self.delay)):
                threading.Thread(target=self._pipe, args=(source, sink, delay), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, delay: float) -> None:
        try:
            while data := source.recv(65536):
                if delay:
                    time.sleep(delay)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open -= {source, sink}
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


def database_behind(db_url: str) -> tuple[Proxy, str]:
    """A proxy (up) in front of the PostgreSQL of ``db_url``, and the URL that reaches the database through it."""
    url = make_url(db_url)
    socket_dir = url.query.get("host")
    if isinstance(socket_dir, str) and socket_dir.startswith("/"):  # the embedded server listens on a Unix socket
        path = f"{socket_dir}/.s.PGSQL.{url.port or 5432}"

        def connect() -> socket.socket:
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(path)
            return sock

    else:
        target = (url.host or "127.0.0.1", url.port or 5432)

        def connect() -> socket.socket:
            return socket.create_connection(target)

    proxy = Proxy(connect).up()
    through = url.difference_update_query(["host"]).set(host="127.0.0.1", port=proxy.port)
    return proxy, through.render_as_string(hide_password=False)


def redis_behind(redis_url: str, *, delay: float = 0.0) -> tuple[Proxy, str]:
    """A proxy (up) in front of the Redis server of ``redis_url`` (TCP), and the URL that reaches it through it."""
    parts = urlsplit(redis_url)
    target = (parts.hostname or "127.0.0.1", parts.port or 6379)
    proxy = Proxy(lambda: socket.create_connection(target), delay=delay).up()
    netloc = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    return proxy, urlunsplit(parts._replace(netloc=f"{netloc}127.0.0.1:{proxy.port}"))
