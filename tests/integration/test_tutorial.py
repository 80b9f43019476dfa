"""The tutorial (docs/tutorial.md) as a newcomer follows it: a fresh virtual environment, every command and file as
written, in one shell, on the embedded servers, with its "terminals" as processes of their own; the outputs it
shows; the answer, the approval and the Slack message delivered once. What differs: HOME (a directory of the
test's), and the ports (free ones: ``keel dev slack``'s in every block, ``keel up``'s as options), so that it can
run beside other tests. Its Docker Compose section is checked, not run (no Docker engine here)."""

from __future__ import annotations

import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.support.ports import free_port
from tests.unit.test_doc_examples import parse

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "docs" / "tutorial.md"
MARKED = re.compile(
    r"<!-- tutorial:(?P<kind>[\w-]+)(?P<args>[^>]*?)\s*-->\s*\n```(?P<lang>\w*)\n(?P<body>.*?)\n```", re.S
)


@dataclass
class Block:
    kind: str
    args: dict[str, str]
    body: str
    line: int
    output: str | None = None  # the output shown after it (a ``tutorial:output`` block)

    def __str__(self) -> str:
        return f"docs/tutorial.md:{self.line} ({self.kind})"


def tutorial_blocks() -> list[Block]:
    text = TUTORIAL.read_text()
    found: list[Block] = []
    for m in MARKED.finditer(text):
        words = shlex.split(m["args"])
        args = dict(w.split("=", 1) if "=" in w else ("name", w) for w in words)
        block = Block(m["kind"], args, m["body"], text.count("\n", 0, m.start()) + 1)
        if block.kind == "output":
            assert found and found[-1].kind == "run", f"{block}: output follows no command"
            found[-1].output = block.body
        else:
            found.append(block)
    return found


class Lines:
    """A process's output, a line at a time, read by a thread: waited for without blocking the test."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.seen: list[str] = []
        self.queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.seen.append(line.rstrip("\n"))
            self.queue.put(line.rstrip("\n"))
        self.queue.put(None)

    def until(self, found: str, timeout: float) -> list[str]:
        """The lines up to and including the first that contains ``found``."""
        got: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no {found!r} within {timeout:g}s; the output so far:\n" + "\n".join(got)
                ) from None
            if line is None:
                raise AssertionError(f"the process ended before {found!r}:\n" + "\n".join(got))
            got.append(line)
            if found in line:
                return got


@dataclass
class Session:
    """The reader's machine: one shell for the first terminal, a process group per other terminal."""

    env: dict[str, str]
    home: Path
    ports: dict[str, int]
    terminals: list[tuple[subprocess.Popen[str], Lines]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.shell = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
            cwd=ROOT,  # the reader starts in their Keel checkout
            start_new_session=True,
        )
        self.lines = Lines(self.shell)

    def as_here(self, text: str) -> str:
        """``text`` with this session's ports: the Slack stand-in's, and keel up's given as options."""
        text = text.replace("9100", str(self.ports["slack"]))
        options = " ".join(f"--{name}-port {self.ports[name]}" for name in ("api", "flower"))
        options += " " + " ".join(f"--{n}-metrics-port {self.ports[n + '-metrics']}" for n in ("api", "worker", "beat"))
        text = re.sub(r"^keel dev slack$", f"keel dev slack --port {self.ports['slack']}", text, flags=re.M)
        return re.sub(r"^keel up$", f"keel up {options}", text, flags=re.M)

    def run(self, line: str, timeout: float = 600) -> tuple[int, str]:
        """One command line in the first terminal's shell: its exit status and its output."""
        marker = f"__done_{uuid.uuid4().hex}__"
        assert self.shell.stdin is not None
        self.shell.stdin.write(f"{self.as_here(line)}\necho {marker} $?\n")
        self.shell.stdin.flush()
        got = self.lines.until(marker, timeout)
        status = int(got[-1].split(marker, 1)[1])
        return status, "\n".join(got[:-1])

    def terminal(self, block: Block, timeout: float = 300) -> Lines:
        proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc", "-c", self.as_here(block.body)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
            cwd=ROOT,
            start_new_session=True,  # its own process group: Ctrl-C reaches all of it, as in a terminal
        )
        lines = Lines(proc)
        self.terminals.append((proc, lines))
        lines.until(block.args["ready"], timeout)
        return lines

    def close(self) -> None:
        """Ctrl-C in every terminal (keel up stops what it started), then the shell; a group that lingers is
        killed. The embedded servers are stopped by the tutorial's last command, or here if it never ran."""
        for proc, _ in reversed(self.terminals):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        for proc, _ in self.terminals:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        keel = self.home / "keel-tutorial" / ".venv" / "bin" / "keel"
        if keel.exists():
            subprocess.run([str(keel), "dev", "stop"], cwd=self.home / "keel-tutorial", env=self.env, timeout=120)
        if self.shell.poll() is None:
            os.killpg(self.shell.pid, signal.SIGKILL)
            self.shell.wait()
        for proc in [self.shell, *(p for p, _ in self.terminals)]:
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()


@pytest.fixture
def session() -> Iterator[Session]:
    home = Path(tempfile.mkdtemp(prefix="kt-"))  # short: the embedded servers' sockets live under it
    here_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(name, None)
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != here_bin)
    env["PIP_CACHE_DIR"] = os.environ.get("PIP_CACHE_DIR") or str(Path.home() / ".cache" / "pip")
    env["HOME"] = str(home)
    ports = {name: free_port() for name in ("slack", "api", "flower", "api-metrics", "worker-metrics", "beat-metrics")}
    made = Session(env, home, ports)
    try:
        yield made
    finally:
        made.close()
        shutil.rmtree(home, ignore_errors=True)


def shown_lines(output: str) -> list[str]:
    return [line.rstrip() for line in output.splitlines() if line.strip()]


def test_the_tutorial_runs_as_written(session: Session) -> None:
    blocks = tutorial_blocks()
    kinds = [b.kind for b in blocks]
    assert kinds.count("run") >= 10 and kinds.count("terminal") == 2 and kinds.count("file") == 3, kinds
    tutorial_dir = session.home / "keel-tutorial"
    slack: Lines | None = None
    for block in blocks:
        if block.kind == "file":
            (tutorial_dir / block.args["name"]).write_text(session.as_here(block.body) + "\n")
        elif block.kind == "terminal":
            lines = session.terminal(block)
            slack = slack or lines  # the first terminal the tutorial opens is the Slack stand-in's
        elif block.kind == "run":
            commands = [line for line in block.body.splitlines() if line.strip()]
            attempts = int(block.args.get("retry", "1"))
            for i, line in enumerate(commands):
                expected = int(block.args.get("exit", "0")) if i == len(commands) - 1 else 0
                status, output = session.run(line)
                assert status == expected, f"{block}: `{line}` exited {status}, not {expected}:\n{output}"
            if block.output is not None:
                missing = [want for want in shown_lines(block.output) if want not in shown_lines(output)]
                for _ in range(attempts - 1):  # a block the page says to run again once something happened
                    if not missing:
                        break
                    time.sleep(1)
                    output = session.run(commands[-1])[1]
                    missing = [want for want in shown_lines(block.output) if want not in shown_lines(output)]
                assert not missing, f"{block}: the page shows lines the command did not print: {missing}\n{output}"
    # The page went to the Slack stand-in once, as the tutorial says it shows it.
    assert slack is not None
    paged = [line for line in slack.seen if line.startswith("slack ")]
    assert paged == ["slack C0ONCALL: PAGE: Database down in eu-west"], slack.seen
    assert "slack C0ONCALL: PAGE: Database down in eu-west" in TUTORIAL.read_text()


def test_the_tutorials_compose_section_fits_compose_yaml_and_the_image() -> None:
    """Not run (no Docker engine here): its override mounts the module into every service that imports KEEL_IMPORTS,
    at the image's working directory (where a KEEL_IMPORTS module is found), and its keel commands exist."""
    blocks = tutorial_blocks()
    [override] = [b for b in blocks if b.kind == "compose-override"]
    [commands] = [b for b in blocks if b.kind == "compose"]
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    importing = {n for n, s in compose["services"].items() if "KEEL_IMPORTS" in (s.get("environment") or {})}
    services = yaml.safe_load(override.body)["services"]
    assert set(services) == importing
    workdir = re.findall(r"^WORKDIR (\S+)$", (ROOT / "Dockerfile").read_text(), re.M)[-1]
    for name, service in services.items():
        mounts = [v.split(":") for v in service["volumes"]]
        assert [("./oncall.py", f"{workdir}/oncall.py")] == [(m[0], m[1]) for m in mounts], name
    ran = 0
    for line in commands.body.splitlines():
        words = shlex.split(line)
        assert words[:2] == ["docker", "compose"], line
        if words[2] == "exec":
            assert words[3] in compose["services"] and words[4] == "keel", line
            parse(words[5:])
            ran += 1
    assert ran == 2
