"""Alembic environment: the service's metadata, on the connection ``rangeprof.service.migrate``
passes in, or on the URL of ``alembic.ini``'s ``sqlalchemy.url``, ``RANGEPROF_DB`` or the default
database."""

from logging.config import fileConfig

from alembic import context

from rangeprof.service.db import database_url, make_engine
from rangeprof.service.models import Base

config = context.config
if config.config_file_name is not None:
    fileConfig(config.config_file_name)


def _configure(**kwargs) -> None:
    context.configure(target_metadata=Base.metadata, compare_type=True, **kwargs)


def _url() -> str:
    return config.get_main_option("sqlalchemy.url") or database_url()


def _online(connection) -> None:
    sqlite = connection.dialect.name == "sqlite"
    if sqlite:
        # SQLite alters a table by copying it and dropping the old one ("batch" mode); with
        # foreign keys on, that drop deletes every row referring to it (ON DELETE CASCADE).
        # The pragma only takes effect outside a transaction, hence the driver connection.
        connection.connection.driver_connection.execute("PRAGMA foreign_keys=OFF")
    _configure(connection=connection, render_as_batch=sqlite)
    with context.begin_transaction():
        context.run_migrations()
        if sqlite and connection.exec_driver_sql("PRAGMA foreign_key_check").first():
            raise RuntimeError("the migration left rows whose foreign keys point nowhere")
    if sqlite:
        connection.connection.driver_connection.execute("PRAGMA foreign_keys=ON")


if context.is_offline_mode():
    _configure(url=_url(), literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
elif "connection" in config.attributes:
    _online(config.attributes["connection"])
else:
    engine = make_engine(_url())
    with engine.connect() as connection:
        _online(connection)
    engine.dispose()
