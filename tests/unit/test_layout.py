"""The rooms stay rooms: every module under agents/, tasks/ and models/ imports only what its row of the layout
table (ARCHITECTURE.md) allows, and nothing of Keel's is imported inside a function to dodge a cycle.

The CLI (agents/cli/, and tasks/cli.py, the ``keel worker|beat|flower`` commands it plugs in) is the one exception
to the second rule: it imports what a command needs inside the command, so ``keel --help`` stays fast.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agents", "tasks", "models")

AGENT_ROOMS = {
    "core",
    "jobs",
    "runtime",
    "outbox",
    "ingress",
    "observability",
    "audit",
    "demo",
    "cli",
    "client",
    "integrations",
    "agents",  # agents/__init__.py itself
}

#: room -> the rooms it may import (itself always). Third-party packages are not policed here.
MAY_IMPORT: dict[str, set[str]] = {
    "models": set(),
    "core": {"models"},
    "jobs": {"core", "models"},
    "outbox": {"core", "models"},
    "runtime": {"core", "jobs", "outbox", "models"},
    "client": {"core", "jobs", "outbox", "runtime", "models"},
    "ingress": {"client", "core", "models"},
    "observability": {"core", "models"},
    "audit": {"core", "models"},
    "integrations": {"runtime", "jobs", "core", "models"},
    # The CLI and the demo sit on top of agents/; neither may import tasks/ (the Celery side plugs into the CLI
    # through the keel.commands entry points instead).
    "cli": AGENT_ROOMS | {"models"},
    "demo": AGENT_ROOMS | {"models"},
    "agents": set(),
    # tasks/ is the Celery glue over the product: anything but the demo.
    "tasks": (AGENT_ROOMS - {"demo"}) | {"models"},
}

#: Modules that may import Keel's modules inside functions: the CLI's commands (lazy, for a fast ``--help``).
LAZY_OK = ("agents.cli", "agents.__main__", "tasks.cli")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def room_of(module: str) -> str | None:
    """The room a dotted module name belongs to, or None if it is not Keel's."""
    parts = module.split(".")
    if parts[0] in ("models", "tasks"):
        return parts[0]
    if parts[0] != "agents":
        return None
    if len(parts) == 1:
        return "agents"
    if parts[1] == "__main__":
        return "cli"  # ``python -m agents`` is the keel command
    return parts[1] if parts[1] in AGENT_ROOMS - {"agents"} else None  # a module of no room: see the test below


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


KNOWN = {module_name(p) for p in sources()}


def imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> Iterator[str]:
    """The dotted names of the modules an import statement loads (``from agents.core import journal`` loads
    ``agents.core.journal``; ``from agents.core.journal import verify`` loads ``agents.core.journal``)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    base = node.module or ""
    if node.level:  # relative: resolve against this module's package
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, *([base] if base else [])])
    for alias in node.names:
        candidate = f"{base}.{alias.name}"
        yield candidate if candidate in KNOWN else base


def imports_of(module: str, source: str, is_package: bool) -> Iterator[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for every import in ``source``, the text of ``module``."""

    def walk(node: ast.AST, in_function: bool) -> Iterator[tuple[str, int, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                for name in imported(child, module, is_package):
                    yield name, child.lineno, in_function
            inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            yield from walk(child, inner)

    yield from walk(ast.parse(source), False)


def violations(path: Path, source: str) -> list[str]:
    """What in ``source`` (the text of ``path``) breaks the layout, each naming the module and the import."""
    module = module_name(path)
    room = room_of(module)
    assert room is not None, module
    allowed = MAY_IMPORT[room] | {room}
    where = path.relative_to(ROOT)
    found = []
    for name, line, in_function in imports_of(module, source, path.name == "__init__.py"):
        target = room_of(name)
        if target is None:
            continue
        if target not in allowed:
            others = ", ".join(sorted(allowed - {room})) or "nothing of Keel"
            found.append(
                f"{where}:{line}: {module} ({room}) imports {name} ({target}); {room} may import only {others}"
            )
        if in_function and not any(module == lazy or module.startswith(f"{lazy}.") for lazy in LAZY_OK):
            found.append(
                f"{where}:{line}: {module} imports {name} inside a function: import it at the top"
                " (a cycle means the code that forces it lives in the wrong room)"
            )
    return found


def test_every_module_has_a_room() -> None:
    homeless = sorted(m for m in KNOWN if room_of(m) is None)
    assert homeless == [], f"modules in no room of the layout (give each a folder of agents/): {homeless}"


def test_imports_point_down_only() -> None:
    found = [v for path in sources() for v in violations(path, path.read_text())]
    assert found == [], "imports that break the layout (ARCHITECTURE.md):\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("path", "bad_import", "message"),
    [
        ("agents/core/phases.py", "from agents.jobs.handlers import handler", "core may import only models"),
        ("agents/core/journal/verification.py", "from agents import client", "core may import only models"),
        ("agents/jobs/runner.py", "from agents.runtime import loop", "jobs may import only core, models"),
        ("agents/jobs/runner.py", "from agents.outbox.relay import Relay", "jobs may import only core, models"),
        ("agents/outbox/relay.py", "from agents.jobs import runner", "outbox may import only core, models"),
        ("agents/runtime/loop.py", "from agents.client import Client", "runtime may import only core, jobs, models"),
        ("agents/runtime/tools.py", "from agents.cli.common import emit", "runtime may import only"),
        ("agents/client/base.py", "from agents.demo import run", "client may import only"),
        ("models/db.py", "from agents.core import errors", "models may import only nothing of Keel"),
        ("models/db.py", "import tasks.app", "models may import only nothing of Keel"),
        ("agents/cli/db.py", "import tasks.app", "cli may import only"),
        ("agents/demo/run.py", "from tasks.app import publisher", "demo may import only"),
        ("tasks/jobs.py", "from agents.demo.fake_servers import FakeSlack", "tasks may import only"),
        ("agents/jobs/schedules.py", "def later() -> None:\n    from models import db", "inside a function"),
        (
            "agents/client/base.py",
            "class C:\n    def m(self) -> None:\n        import agents.runtime.loop",
            "inside a function",
        ),
    ],
)
def test_a_bad_import_is_named(path: str, bad_import: str, message: str) -> None:
    """The check itself: a module given one bad import fails, naming the module and the import."""
    source = (ROOT / path).read_text() + "\n" + bad_import + "\n"
    found = violations(ROOT / path, source)
    assert any(message in v and path in v for v in found), found
