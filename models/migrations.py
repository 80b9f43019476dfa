"""Running the Alembic migrations from code (``keel db upgrade``, tests, the demo), and telling whether a database's
schema is the one this code was written for. The configuration is built from the ``keel_migrations`` package, so an
installed wheel migrates too (docs/explanation/storage-and-jobs.md#migrations-from-an-installed-wheel)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import sqlalchemy
from alembic.config import Config
from alembic.script import ScriptDirectory
from alembic.util import CommandError

from alembic import command
from models.audit_keys import AuditKeys
from models.errors import KeelError
from models.keepalives import tcp_options
from models.roles import RoleNames

MIGRATIONS_PACKAGE = "keel_migrations"
#: A checkout run without installing it (its folder on PYTHONPATH): the migrations are next to the code.
CHECKOUT_MIGRATIONS = Path(__file__).resolve().parent.parent / "alembic"


class UnknownRevision(KeelError):
    """No migration has this revision."""


class SchemaMismatch(KeelError):
    """The database's schema is missing, or is not the one this code was written for."""


class DowngradeRefused(KeelError):
    """A migration cannot be reverted on this database without losing or misreading what it holds."""


class UpgradeRefused(KeelError):
    """A migration cannot be applied to this database as it is: what is in the way is named, to be mended first."""


def script_location() -> Path:
    """The folder that holds ``env.py`` and ``versions/``: the installed ``keel_migrations`` package (a wheel, or the
    checkout's ``alembic/`` through an editable install), else the checkout's ``alembic/``."""
    spec = importlib.util.find_spec(MIGRATIONS_PACKAGE)
    places = [Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []
    for place in [*places, CHECKOUT_MIGRATIONS]:
        if (place / "env.py").is_file():
            return place
    raise KeelError(
        f"Keel's migrations are not installed (no package {MIGRATIONS_PACKAGE!r}): reinstall Keel"
        " (pip install keel, or pip install -e . in its checkout)"
    )


def alembic_config(url: str, roles: RoleNames | None = None, audit_keys: AuditKeys | None = None) -> Config:
    """An Alembic config for Keel's migrations, aimed at ``url``. With ``roles``, the migrations run as the owner
    role when it exists (and the application's and auditor's grants are brought up to date after them; see
    models/roles.py); without, as whoever ``url`` logs in as. ``audit_keys``: the key ring a migration that needs one
    uses (0015 seals the chains it finds), else the one the settings give."""
    config = Config()
    config.set_main_option("script_location", str(script_location()))
    config.set_main_option("path_separator", "os")
    config.attributes["url"] = url
    config.attributes["roles"] = roles
    config.attributes["audit_keys"] = audit_keys
    # Not set on the file's own logging: keep the caller's logging as it is.
    config.attributes["configure_logger"] = False
    return config


def _scripts() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config(""))


def revisions() -> list[str]:
    """This code's migrations, oldest first."""
    return [script.revision for script in reversed(list(_scripts().walk_revisions()))]


def head() -> str:
    """The revision this code's schema is at."""
    found = _scripts().get_current_head()
    assert found is not None, "no migrations"
    return found


def _run(action: str, url: str, revision: str, roles: RoleNames | None, audit_keys: AuditKeys | None = None) -> None:
    try:
        getattr(command, action)(alembic_config(url, roles, audit_keys), revision)
    except CommandError as exc:  # Alembic resolves both revisions before it changes anything
        at = revision_at(url)
        if at is not None and not set(at.split(", ")) <= set(revisions()):
            raise SchemaMismatch(_unknown_to_this_code(at)) from None  # the database's revision, not the target
        known = ", ".join(["base", *revisions(), "head"])
        reason = " ".join(str(exc).split())
        if reason.startswith("Can't locate revision"):
            reason = "no migration has this revision"
        raise UnknownRevision(f"cannot {action} to {revision!r}: {reason} (known revisions: {known})") from None


def upgrade(
    url: str, revision: str = "head", *, roles: RoleNames | None = None, audit_keys: AuditKeys | None = None
) -> None:
    """Migrate up to ``revision``. ``roles``: run as the owner role (see :func:`alembic_config`). ``audit_keys``: the
    journal's key ring (0015 seals the chains it finds with it); None: the one the ``KEEL_*`` settings give."""
    _run("upgrade", url, revision, roles, audit_keys)


def downgrade(url: str, revision: str, *, roles: RoleNames | None = None) -> None:
    _run("downgrade", url, revision, roles)


def check(url: str) -> None:
    """Raise if the database schema and models/tables.py differ (``alembic check``)."""
    command.check(alembic_config(url))


def database_revision(conn: sqlalchemy.Connection) -> str | None:
    """The migration the database is at (None: never migrated, or downgraded to base)."""
    if conn.execute(sqlalchemy.text("SELECT to_regclass('alembic_version') IS NOT NULL")).scalar_one() is not True:
        return None
    rows = conn.execute(sqlalchemy.text("SELECT version_num FROM alembic_version")).scalars().all()
    return ", ".join(sorted(rows)) or None


def revision_at(url: str) -> str | None:
    """The migration the database at ``url`` is at (None: never migrated, or downgraded to base)."""
    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool, connect_args=tcp_options(url))
    try:
        with engine.connect() as conn:
            return database_revision(conn)
    finally:
        engine.dispose()


def _unknown_to_this_code(at: str) -> str:
    return (
        f"database at {at}, which this code does not know (code at {head()}): it was migrated by a newer Keel;"
        " run that version, or downgrade the database with it"
    )


def schema_problem(engine: sqlalchemy.Engine) -> str | None:
    """What is wrong with the database's schema for this code, as one line saying what to do; None if it is this
    code's. Two small queries: run it when a command starts, not per transition."""
    with engine.connect() as conn:
        at = database_revision(conn)
    code = head()
    if at == code:
        return None
    if at is None:
        return f"the database has no Keel schema (code at {code}): run 'keel db upgrade'"
    if at in revisions():
        return f"database at {at}, code at {code}: run 'keel db upgrade'"
    return _unknown_to_this_code(at)


def prepare(url: str, *, migrate: bool, roles: RoleNames | None = None) -> str | None:
    """Make sure the database at ``url`` has this code's schema before a command starts processes on it.

    ``migrate``: upgrade it to head and return the line saying so (``database: migrated 0004 → 0006``; None when it
    was at head already). Otherwise refuse (:class:`SchemaMismatch`, one line: where the database is, where the code
    is, what to run) unless it is at head. A database a newer Keel migrated is refused either way."""
    at, code = revision_at(url), head()
    if at == code:
        return None
    if at is not None and not set(at.split(", ")) <= set(revisions()):
        raise SchemaMismatch(_unknown_to_this_code(at))
    if not migrate:
        behind = f"database at {at}, code at {code}" if at else f"the database has no Keel schema (code at {code})"
        raise SchemaMismatch(f"{behind}: run 'keel db upgrade' first, or pass --migrate")
    upgrade(url, roles=roles)
    return f"database: migrated {at or 'base'} → {code}"


def check_schema(engine: sqlalchemy.Engine) -> None:
    """Raise :class:`SchemaMismatch` (one line: where the database is, where the code is, what to run) unless the
    database's schema is this code's."""
    problem = schema_problem(engine)
    if problem is not None:
        raise SchemaMismatch(problem)
