"""What the wheel holds: every folder of code, and the migrations under a name that does not shadow Alembic."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _setuptools() -> dict[str, object]:
    config: dict[str, object] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return config


def test_every_folder_of_code_is_a_listed_package() -> None:
    config = _setuptools()
    on_disk = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for top in ("agents", "tasks", "models")
        for path in (ROOT / top).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    migrations = {"keel_migrations", "keel_migrations.versions"}
    assert set(config["packages"]) == on_disk | migrations  # type: ignore[call-overload]
    assert config["package-dir"] == {"keel_migrations": "alembic"}


def test_the_migrations_folder_stays_a_plain_folder() -> None:
    """An ``alembic/__init__.py`` would make ``import alembic`` in the checkout (on sys.path when tests or
    ``python -m`` run there) find the migrations instead of the Alembic library."""
    assert (ROOT / "alembic" / "env.py").is_file()
    assert not (ROOT / "alembic" / "__init__.py").exists()
    assert not (ROOT / "alembic" / "versions" / "__init__.py").exists()


def test_the_consoles_templates_and_static_files_are_package_data() -> None:
    """Every file the console serves is matched by a package-data pattern, so the wheel carries it."""
    config = _setuptools()
    patterns = config["package-data"]["agents.ingress.console"]  # type: ignore[index]
    console = ROOT / "agents" / "ingress" / "console"
    files = [p for folder in ("templates", "static") for p in (console / folder).iterdir() if p.is_file()]
    assert any(p.suffix == ".html" for p in files) and any(p.suffix == ".js" for p in files)
    unmatched = [
        str(p.relative_to(console)) for p in files if not any(p.relative_to(console).match(g) for g in patterns)
    ]
    assert not unmatched, f"add to [tool.setuptools.package-data] in pyproject.toml: {unmatched}"
