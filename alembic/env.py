"""Alembic environment: the URL comes from Keel's settings unless the caller put one in the config. With roles (the
caller's ``roles`` attribute; run by hand, the configured names) and the owner role in the cluster, the migrations
run as the owner (``SET ROLE``) and end by bringing the grants up to date in the same transaction (models/roles.py)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import create_engine, pool

from alembic import context
from models import roles
from models.embedded import migration_url_for
from models.keepalives import tcp_options
from models.settings import Settings
from models.tables import AUDIT_SCHEMA, JOURNAL_PARTITION, metadata

config = context.config
OWN_SCHEMAS = {None, "public", AUDIT_SCHEMA}


def _url() -> str:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    return str(url) if url else migration_url_for(Settings())


def _roles() -> roles.RoleNames | None:
    if "roles" in config.attributes:  # Keel's own callers say (None: as whoever the URL logs in as)
        found = config.attributes["roles"]
        assert found is None or isinstance(found, roles.RoleNames)
        return found
    return roles.RoleNames.of(Settings())


def _include_object(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    if type_ == "table":
        schema = getattr(obj, "schema", None)
        # The journal's partitions are the parent's (migration 0017): the model describes the parent only.
        if reflected and schema == AUDIT_SCHEMA and JOURNAL_PARTITION.match(str(name)):
            return False
        return schema in OWN_SCHEMAS
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
    url = _url()
    # A migration can wait long on a lock or an index build: keepalives, so a vanished server is given up on.
    engine = create_engine(url, poolclass=pool.NullPool, connect_args=tcp_options(url))
    names = _roles()
    with engine.connect() as connection:
        driver = connection.connection.driver_connection
        as_owner = names is not None and roles.become_owner(driver, names)
        driver.commit()  # a SET ROLE holds for the session once committed
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
            if as_owner:
                assert names is not None
                roles.apply_grants(driver, names)
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
