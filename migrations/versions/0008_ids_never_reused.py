"""SQLite never reuses the id of a deleted model, run, build, evaluation, qparams set or token
(``AUTOINCREMENT``), as PostgreSQL's sequences never do: a stale link finds nothing rather than
another token's newer object.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TABLES = ("token", "model", "run", "qparams", "build", "evaluation")  # ids in URLs


def _autoincrement(on: bool) -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    for table in _TABLES:
        # The flag is part of CREATE TABLE: the table is copied (env.py turns foreign keys off).
        kwargs = {"sqlite_autoincrement": on}
        with op.batch_alter_table(table, recreate="always", table_kwargs=kwargs):
            pass


def upgrade() -> None:
    _autoincrement(True)


def downgrade() -> None:
    _autoincrement(False)
