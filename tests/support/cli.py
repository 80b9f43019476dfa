"""Running the `keel` command as a user would: a process of its own with a clean environment, a directory of its own
and its own stdin, stdout and stderr.

The process is a fork of the test's, which has Keel imported already, so a command costs milliseconds instead of an
interpreter start (a second of CPU: the CLI tests ran hundreds). The command's code, arguments, environment and exit
are the real ones; the console script itself is run by tests/integration/test_wheel.py and the chaos tests."""

from __future__ import annotations

import atexit
import copy
import faulthandler
import gc
import importlib
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.support.audit import TEST_ENV

KEEL = str(Path(sys.executable).parent / "keel")
PROMPT = '{"prompt": "hi"}'
SCRATCH = tempfile.mkdtemp(prefix="keel-cli-")
#: The one time format every ``keel`` output uses.
RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")


class Forked:
    """A command running in a forked process: the part of :class:`subprocess.Popen` the tests use."""

    def __init__(self, pid: int, argv: list[str]) -> None:
        self.pid, self.args = pid, argv
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def fork_keel(
    args: Sequence[str | bytes],
    env: dict[str, str],
    cwd: str | Path,
    *,
    stdin: int,
    stdout: int,
    stderr: int,
    new_session: bool = False,
    close: Sequence[int] = (),
) -> Forked:
    """Start ``keel ARGS`` in a forked process with exactly ``env`` in ``cwd``, on the given descriptors."""
    argv = ["keel", *(os.fsdecode(arg) for arg in args)]
    pid = os.fork()
    if pid == 0:  # the command's process: never returns into the test
        _child(argv, env, cwd, (stdin, stdout, stderr), tuple(close), new_session)
    return Forked(pid, argv)


def run_keel(
    args: Sequence[str | bytes],
    env: dict[str, str],
    cwd: str | Path = SCRATCH,
    *,
    input: str | None = None,
    timeout: float = 180,
) -> subprocess.CompletedProcess[str]:
    """``keel ARGS`` in a forked process with exactly ``env`` in ``cwd``; what it printed and its exit status."""
    stdin_r, stdin_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    proc = fork_keel(args, env, cwd, stdin=stdin_r, stdout=out_w, stderr=err_w, close=(stdin_w, out_r, err_r))
    for fd in (stdin_r, out_w, err_w):
        os.close(fd)
    output: dict[int, bytes] = {}
    readers = [threading.Thread(target=_read_all, args=(fd, output), daemon=True) for fd in (out_r, err_r)]
    for reader in readers:
        reader.start()
    with os.fdopen(stdin_w, "wb") as stdin:
        try:
            stdin.write((input or "").encode())
        except BrokenPipeError:  # the command did not read its input
            pass
    try:
        status = proc.wait(timeout)
    except BaseException:  # a timeout, or the test interrupted: the command does not outlive it
        proc.kill()
        proc.wait()
        raise
    for reader in readers:
        reader.join()
    return subprocess.CompletedProcess(
        proc.args, status, output[out_r].decode(errors="replace"), output[err_r].decode(errors="replace")
    )


def _child(
    argv: list[str],
    env: dict[str, str],
    cwd: str | Path,
    stdio: tuple[int, int, int],
    close: tuple[int, ...],
    new_session: bool,
) -> None:
    atexit._clear()  # first: the test's exit handlers are not the command's, even if what follows fails
    gc.freeze()  # the test's garbage (pooled connections among it) is never finalized here
    status = 1
    try:
        for fd in close:
            os.close(fd)
        if new_session:
            os.setsid()
        _die_with_the_test()
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
        for fd in set(stdio) - {0, 1, 2}:
            os.close(fd)
        # The test's stdio objects are pytest's captures: the command gets its own, on its own descriptors.
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), "utf-8")
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), "utf-8", line_buffering=True)
        err_stream = io.FileIO(2, "w", closefd=False)
        sys.stderr = io.TextIOWrapper(err_stream, "utf-8", "backslashreplace", line_buffering=True)
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = argv
        _as_a_fresh_process(env)
        from agents.cli import main

        main()
        status = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            status = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
        finally:
            os._exit(status)


#: What a fresh ``keel`` process has registered before it reads KEEL_IMPORTS (taken by tests/conftest.py before
#: any test module registers its own tools and handlers).
_BUILT_IN: dict[str, Any] = {}


def remember_built_ins() -> None:
    from agents.jobs.handlers import registry
    from agents.runtime import tools

    _BUILT_IN["modules"] = set(sys.modules)
    _BUILT_IN["tools"] = dict(tools._TOOLS)
    _BUILT_IN["handlers"] = {name: copy.copy(value) for name, value in vars(registry).items()}


def _as_a_fresh_process(env: dict[str, str]) -> None:
    """Undo what the test process holds that a fresh ``keel`` would not: tests' tools and handlers, secrets others
    registered for redaction, pytest's warning filters and hooks, a cached temporary directory."""
    from agents.core import redaction
    from agents.jobs.handlers import registry
    from agents.runtime import tools

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    threading.excepthook = threading.__excepthook__
    sys.unraisablehook = sys.__unraisablehook__
    faulthandler.disable()
    warnings.resetwarnings()
    for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    importlib.reload(warnings)  # warnings are printed again, not recorded for pytest
    tempfile.tempdir = None
    redaction.clear_secrets()
    assert _BUILT_IN, "tests/conftest.py calls remember_built_ins() first"
    tools._TOOLS.clear()
    tools._TOOLS.update(_BUILT_IN["tools"])
    vars(registry).update({name: copy.copy(value) for name, value in _BUILT_IN["handlers"].items()})
    # Keel's and the tests' modules imported since (the demo's tools, KEEL_IMPORTS' handlers) are imported again
    # where the command needs them, and register themselves again.
    ours = ("agents.", "tasks.", "models.", "tests.", "keel_migrations.")
    for name in [m for m in sys.modules if m not in _BUILT_IN["modules"] and m.startswith(ours)]:
        del sys.modules[name]
    for module in json.loads(env.get("KEEL_IMPORTS") or "[]"):
        for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
            del sys.modules[name]
    # Registered once per process at import (the trace exporter's flush): this process's exit needs them too.
    atexit.register(logging.shutdown)
    tracing = sys.modules.get("agents.observability.tracing")
    if tracing is not None:
        atexit.register(tracing._shutdown_at_exit)


def _die_with_the_test() -> None:
    """SIGKILL from the kernel when the test process ends, however it ends (Linux)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


def _read_all(fd: int, into: dict[int, bytes]) -> None:
    with os.fdopen(fd, "rb") as stream:
        into[fd] = stream.read()


def keel_env(db_url: str | None = None, **more: str) -> dict[str, str]:
    """The environment a test's ``keel`` runs with: the test process's, less any Keel or OpenTelemetry setting, plus
    the journal's test key, ``KEEL_DATABASE_URL`` and ``more``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KEEL_", "OTEL_"))} | TEST_ENV | more
    if db_url is not None:
        env["KEEL_DATABASE_URL"] = db_url
    return env


def keel(
    db_url: str, *args: str, check: bool = True, broker: str | None = None, **more: str
) -> subprocess.CompletedProcess[str]:
    """``keel ARGS`` on the database at ``db_url``; with ``check``, it must exit 0."""
    env = keel_env(db_url, **more)
    if broker:
        env["KEEL_BROKER_URL"] = broker
    # In a directory of its own: a developer's .env must not leak into the test.
    result = run_keel(args, env)
    if check:
        assert result.returncode == 0, result.stderr
    return result
