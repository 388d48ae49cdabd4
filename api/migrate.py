"""Schema migrations (Alembic): upgrade a database to head, or check that it is there.

The scripts are the package ``rangeprof.migrations`` (the repository's ``migrations/``, where
``alembic upgrade head`` from the repository root finds them through ``alembic.ini``).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from rangeprof.profiler.errors import RangeprofError

from .db import Database, database_url, make_engine

SCRIPTS = Path(str(resources.files("rangeprof.migrations")))  # installed with the package


class SchemaError(RangeprofError):
    """The database is unreachable, or not at the schema this version of rangeprof expects."""


def _unreachable(engine: Engine, err: OperationalError) -> SchemaError:
    reason = next(iter(str(err.orig).strip().splitlines()), type(err.orig).__name__)
    return SchemaError(f"cannot open the database {engine.url.render_as_string()}: {reason}")


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(SCRIPTS))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))  # configparser escaping
    return config


def upgrade(url: str) -> str:
    """Migrate the database at ``url`` to the newest revision; return that revision."""
    engine = make_engine(url)
    try:
        with engine.connect() as connection:  # the migrations begin their own transaction
            config = alembic_config(url)
            config.attributes["connection"] = connection
            command.upgrade(config, "head")
    except OperationalError as err:
        raise _unreachable(engine, err) from None
    finally:
        engine.dispose()
    return head()


def head() -> str:
    return ScriptDirectory.from_config(alembic_config("")).get_current_head()


def require_head(engine: Engine) -> None:
    """Raise :class:`SchemaError` unless the database is at the newest revision."""
    try:
        with engine.connect() as connection:
            current = MigrationContext.configure(connection).get_current_revision()
    except OperationalError as err:
        raise _unreachable(engine, err) from None
    if current != head():
        state = "has no rangeprof tables" if current is None else f"is at revision {current}"
        raise SchemaError(
            f"the database {engine.url.render_as_string()} {state}, this rangeprof needs "
            f"{head()}: run `rangeprof db upgrade`"
        )


def open_database(db_url: str | None = None) -> Database:
    """The database at ``db_url`` (or the default), checked to be at head."""
    db = Database(database_url(db_url))
    require_head(db.engine)
    return db
