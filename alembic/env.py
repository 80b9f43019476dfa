"""Alembic environment: the URL comes from Keel's settings unless the caller put one in the config."""

from __future__ import annotations

from typing import Any

from sqlalchemy import create_engine, pool

from alembic import context
from models.embedded import database_url_for
from models.settings import Settings
from models.tables import AUDIT_SCHEMA, metadata

config = context.config
OWN_SCHEMAS = {None, "public", AUDIT_SCHEMA}


def _url() -> str:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    return str(url) if url else database_url_for(Settings())


def _include_object(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    if type_ == "table":
        return getattr(obj, "schema", None) in OWN_SCHEMAS
    return True


def _include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    if type_ == "schema":
        return name in OWN_SCHEMAS
    return True


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=metadata, literal_binds=True, include_schemas=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=metadata,
            include_schemas=True,
            include_name=_include_name,
            include_object=_include_object,
            compare_type=True,
            compare_server_default=True,
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
