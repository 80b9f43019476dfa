"""What ``keel up`` runs on: child processes in process groups of their own, their output relayed line by line, a
start that counts once each child shows it is ready, a stop on any termination signal (forwarded, waited for, then
SIGKILL), and a watch on the servers that gives up after a bounded outage. Which signal does what:
docs/explanation/clients.md#stopping-keel-up."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import IO
from urllib.parse import parse_qs, urlsplit

import httpx

from agents.core.errors import KeelError

#: The signals that stop ``keel up``, and what each child's process group is sent for it. SIGHUP is not passed on:
#: to a Celery worker it means "restart", not "stop".
STOP_SIGNALS: dict[signal.Signals, signal.Signals] = {
    signal.SIGINT: signal.SIGTERM,
    signal.SIGTERM: signal.SIGTERM,
    signal.SIGHUP: signal.SIGTERM,
    signal.SIGQUIT: signal.SIGQUIT,
}


#: Set in a supervised child's environment to the supervisor's pid: the child asks Linux to SIGTERM it when the
#: supervisor dies, however it dies (SIGKILL and OOM kills included), so nothing is left orphaned.
PARENT_ENV = "_KEEL_SUPERVISOR_PID"


def supervised_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a child that must not outlive this process (see :func:`die_with_parent`)."""
    return {**env, PARENT_ENV: str(os.getpid())}


def die_with_parent() -> None:
    """In a child started with :func:`supervised_env`: have the kernel send SIGTERM (a Celery warm shutdown) when
    the supervisor exits. Linux only (``prctl(PR_SET_PDEATHSIG)``); elsewhere the supervisor's own signal handling
    is all there is. Called first thing in ``python -m agents``."""
    parent = os.environ.pop(PARENT_ENV, None)  # not for the grandchildren this child starts
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    threading.Thread(target=_end_when_orphaned, args=(int(parent),), daemon=True, name="keel-orphan-watch").start()
    if os.getppid() != int(parent):  # the supervisor died before the request above was made
        os.kill(os.getpid(), signal.SIGTERM)


#: How long a child whose supervisor died may take over the stop that SIGTERM starts before it kills itself.
ORPHAN_GRACE_SECONDS = 10.0


def _end_when_orphaned(parent: int, grace: float = ORPHAN_GRACE_SECONDS) -> None:
    """A warm shutdown waits for the jobs running (a model call may take minutes) and nobody is left to cut it short:
    once orphaned, SIGKILL this process's group (its pool processes too) after ``grace``; unfinished jobs are retried
    when their leases lapse."""
    while os.getppid() == parent:
        time.sleep(0.5)
    time.sleep(grace)
    if os.getpgrp() == os.getpid():  # a group of its own, as supervisors start their children
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


#: The exit status of a child that asks to be started again (a worker carrying too many threads past their limits).
REPLACE_ME = os.EX_SOFTWARE


class StartFailed(KeelError):
    """A child exited, or did not show it was ready in time, while the stack started."""

    def __init__(self, message: str, *, exited: Child | None = None) -> None:
        self.exited = exited  # the child that exited, if one did
        super().__init__(message)


def say(line: str, stream: IO[str] | None = None) -> None:
    """Print one line; a closed terminal (SIGHUP) or a reader gone away must not stop the shutdown."""
    try:
        print(line, file=stream or sys.stdout, flush=True)
    except (OSError, ValueError):
        pass


def where(url: str) -> str:
    """``host:port/db`` of a server URL, never its user or password (the Unix socket's directory for a socket)."""
    parts = urlsplit(url)
    socket_dir = parse_qs(parts.query).get("host", [""])[0]
    if parts.hostname is None and socket_dir.startswith("/"):
        return f"{parts.path.lstrip('/')} on the socket in {socket_dir}"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.hostname or 'localhost'}{port}{parts.path}"


def local_url(host: str, port: int) -> str:
    """Where this machine reaches a server listening on ``host:port`` (on every address: the loopback one)."""
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def api_ready(url: str) -> bool:
    """Whether the HTTP API at ``url`` says it can serve: ``/readyz`` answers 200 (database reachable and
    migrated, broker reachable)."""
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Child:
    """One supervised process. It is ready once a line of its output passes ``ready_line`` and ``probe`` answers
    True (each only if given). ``quit_as``: what it is sent when ``keel up`` gets SIGQUIT (Celery's cold shutdown
    for Celery's processes; a stop signal the child handles for the others)."""

    name: str
    argv: list[str]
    ready_line: Callable[[str], bool] | None
    probe: Callable[[], bool] | None = None
    quit_as: signal.Signals = signal.SIGQUIT
    #: Started again when it exits with :data:`REPLACE_ME` (a worker), instead of stopping the stack.
    replaceable: bool = False
    #: The name of the child it is started after, once that one is ready (None: at once).
    after: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    relay: threading.Thread | None = None
    saw_ready_line: threading.Event = field(default_factory=threading.Event)
    last_lines: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=5))

    @property
    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def ready(self) -> bool:
        seen = self.ready_line is None or self.saw_ready_line.is_set()
        return seen and (self.probe is None or self.probe())

    def why_exited(self) -> str:
        """``beat was killed by SIGKILL``; ``worker exited with status 1 (its last line was: …)``. The last line is
        quoted only for a failure status: after a signal from outside, or a clean exit, it says nothing of why."""
        assert self.proc is not None
        status = self.proc.returncode
        if status < 0:
            try:
                name = signal.Signals(-status).name
            except ValueError:
                name = f"signal {-status}"
            return f"{self.name} was killed by {name}"
        last = next((line.strip() for line in reversed(self.last_lines) if line.strip()), "")
        quoted = f" (its last line was: {last})" if status != 0 and last else ""
        return f"{self.name} exited with status {status}{quoted}"


class Supervisor:
    """Starts ``children`` with ``env`` and stops them on any of :data:`STOP_SIGNALS` or on :meth:`stop`."""

    def __init__(self, children: list[Child], env: dict[str, str], stop_timeout: float) -> None:
        self.children = children
        self.env = env
        self.stop_timeout = stop_timeout
        self.received: signal.Signals | None = None
        self.wake = threading.Event()
        self._stopping = False

    # --- signals ----------------------------------------------------------------------------------------------

    @contextmanager
    def signals_handled(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is not None and self._stopping:
            for child in self.children:  # asked twice: no more waiting (stop() reaps them)
                if child.proc is not None:
                    _signal_group(child.proc.pid, signal.SIGKILL)
        self.received = signal.Signals(signum)
        self.wake.set()

    # --- start ------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the children that wait for no other; :meth:`wait_ready` starts the others in their turn."""
        for child in self.children:
            if child.after is None:
                self._start(child)

    def _start(self, child: Child) -> None:
        child.proc = subprocess.Popen(
            child.argv,
            env=supervised_env(self.env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the terminal's signals reach only us
        )
        child.relay = threading.Thread(target=self._relay, args=(child,), daemon=True, name=f"relay-{child.name}")
        child.relay.start()

    def replace(self, child: Child) -> None:
        """Start ``child`` again: it exited asking to be replaced (:data:`REPLACE_ME`). What is left of its group
        (threads past their limits are gone with it) is killed first."""
        assert child.proc is not None
        _signal_group(child.proc.pid, signal.SIGKILL)
        if child.relay is not None:
            child.relay.join(timeout=2)
        child.saw_ready_line.clear()
        self._start(child)

    def _relay(self, child: Child) -> None:
        """Copy the child's output to ours, prefixed with its name, and watch it for the ready line. Keeps reading
        after our stdout is gone (a closed terminal), so the child never blocks on a full pipe."""
        assert child.proc is not None and child.proc.stdout is not None
        with child.proc.stdout:
            for raw in child.proc.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                child.last_lines.append(line)
                if child.ready_line is not None and not child.saw_ready_line.is_set() and child.ready_line(line):
                    child.saw_ready_line.set()
                say(f"{child.name:<6} | {line}")

    def wait_ready(self, timeout: float) -> bool:
        """Wait until every child is ready, starting each that waits for another (``after``) once that one is; False
        if a stop signal came first. Raises :class:`StartFailed`."""
        deadline = time.monotonic() + timeout
        waiting = list(self.children)
        while waiting:
            if self.received is not None:
                return False
            for child in waiting:
                if child.exited:
                    raise StartFailed(child.why_exited(), exited=child)
            waiting = [child for child in waiting if child.proc is None or not child.ready()]
            ready = {child.name for child in self.children} - {child.name for child in waiting}
            for child in waiting:
                if child.proc is None and child.after in ready:
                    self._start(child)
            if waiting and time.monotonic() > deadline:
                names = ", ".join(child.name for child in waiting)
                raise StartFailed(f"{names} did not show it was ready within {timeout:.0f}s")
            self.wake.wait(0.2)
        return True

    # --- run and stop -----------------------------------------------------------------------------------------

    def first_exited(self) -> Child | None:
        return next((child for child in self.children if child.exited), None)

    def replaced(self, child: Child) -> bool:
        """Start ``child`` again if it exited asking for it; False if it exited otherwise."""
        assert child.proc is not None
        if child.proc.returncode != REPLACE_ME or not child.replaceable:
            return False
        say(f"keel up: {child.name} exited to be replaced (status {REPLACE_ME}); starting it again")
        self.replace(child)
        return True

    def stop(self) -> None:
        """Send each child's group its stop signal, wait up to ``stop_timeout`` for all, then SIGKILL the groups
        (whatever is left in a group too: a worker's pool processes that outlived it)."""
        self._stopping = True
        forward = STOP_SIGNALS.get(self.received, signal.SIGTERM) if self.received else signal.SIGTERM
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                _signal_group(child.proc.pid, child.quit_as if forward == signal.SIGQUIT else forward)
        deadline = time.monotonic() + self.stop_timeout
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                say(f"keel up: {child.name} did not stop within {self.stop_timeout:.0f}s; killing it", sys.stderr)
        self._kill_all()
        for child in self.children:  # their last lines (how they stopped) before ours
            if child.relay is not None:
                child.relay.join(timeout=2)

    def _kill_all(self) -> None:
        for child in self.children:
            if child.proc is not None:
                _signal_group(child.proc.pid, signal.SIGKILL)
                try:
                    child.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:  # (a process stuck in the kernel: nothing more we can do)
                    pass


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # the group is empty: everyone in it has exited
        pass


# --- the servers ------------------------------------------------------------------------------------------------


@dataclass
class ServerHealth:
    """Whether one server answers, as ``keel up`` sees it: one line when it stops answering, one when it is back,
    and :meth:`gave_up` once it has not answered for ``give_up_after`` seconds in a row."""

    name: str
    url: str
    give_up_after: float
    down_since: float | None = None

    def observe(self, now: float, problem: str | None) -> str | None:
        """Record a probe's outcome (``problem`` is None when it answered); return the line to print, if any."""
        if problem is None:
            if self.down_since is None:
                return None
            down = now - self.down_since
            self.down_since = None
            return f"keel up: {self.name} at {where(self.url)} answers again (after {down:.0f}s)"
        if self.down_since is not None:
            return None
        self.down_since = now
        return (
            f"keel up: {self.name} at {where(self.url)} is unreachable ({problem}); the worker and beat keep "
            f"retrying; giving up in {self.give_up_after:.0f}s unless it answers"
        )

    @property
    def where(self) -> str:
        return where(self.url)

    def gave_up(self, now: float) -> bool:
        return self.down_since is not None and now - self.down_since >= self.give_up_after


class ServerWatch:
    """Probes each server every ``every`` seconds in a thread of its own; :attr:`given_up` names the first one that
    stayed unreachable past its limit."""

    def __init__(
        self, probes: list[tuple[ServerHealth, Callable[[], str | None]]], every: float, wake: threading.Event
    ) -> None:
        self.probes = probes
        self.every = every
        self.wake = wake
        self.given_up: ServerHealth | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="server-watch")

    def __enter__(self) -> ServerWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()

    def _run(self) -> None:
        while not self._done.wait(self.every):
            for health, probe in self.probes:
                problem = probe()
                now = time.monotonic()
                line = health.observe(now, problem)
                if line:
                    say(line, sys.stderr)
                if health.gave_up(now) and self.given_up is None:
                    self.given_up = health
                    self.wake.set()
