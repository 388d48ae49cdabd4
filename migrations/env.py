"""Alembic environment: the service's metadata, on the connection ``api.migrate`` passes in, or
on the URL of ``alembic.ini``'s ``sqlalchemy.url``, ``RANGEPROF_DB`` or the default database."""

from logging.config import fileConfig

from alembic import context

from api.db import database_url, make_engine
from api.models import Base

config = context.config
if config.config_file_name is not None:
    fileConfig(config.config_file_name)


def _configure(**kwargs) -> None:
    context.configure(target_metadata=Base.metadata, compare_type=True, **kwargs)


def _url() -> str:
    return config.get_main_option("sqlalchemy.url") or database_url()


def _online(connection) -> None:
    # SQLite alters tables by copying them ("batch" mode).
    _configure(connection=connection, render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


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
