"""Running the Alembic migrations from code (``keel db upgrade``, tests, the demo)."""

from __future__ import annotations

from pathlib import Path

from alembic.config import Config

from alembic import command

ROOT = Path(__file__).resolve().parent.parent
ALEMBIC_INI = ROOT / "alembic.ini"


def alembic_config(url: str) -> Config:
    """An Alembic config for the checkout's migrations, aimed at ``url``."""
    if not ALEMBIC_INI.exists():
        raise FileNotFoundError(f"{ALEMBIC_INI} is missing: run Keel from its checkout (pip install -e .)")
    config = Config(str(ALEMBIC_INI))
    config.attributes["url"] = url
    # Not set on the file's own logging: keep the caller's logging as it is.
    config.attributes["configure_logger"] = False
    return config


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def check(url: str) -> None:
    """Raise if the database schema and models/tables.py differ (``alembic check``)."""
    command.check(alembic_config(url))
