"""Jobs can be cancelled: ``cancelled`` joins the statuses of runs, evaluations and builds.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TABLES = ("run", "evaluation", "build")
_BEFORE = ("queued", "running", "done", "failed")
_AFTER = (*_BEFORE, "cancelled")


def _statuses(statuses: tuple[str, ...]) -> None:
    allowed = ", ".join(f"'{s}'" for s in statuses)
    for table in _TABLES:
        # SQLite changes a CHECK constraint by copying the table (batch mode), PostgreSQL in place.
        with op.batch_alter_table(table) as batch:
            batch.drop_constraint(f"ck_{table}_status", type_="check")
            batch.create_check_constraint(f"ck_{table}_status", f"status IN ({allowed})")


def upgrade() -> None:
    _statuses(_AFTER)


def downgrade() -> None:
    for table in _TABLES:  # the older schema knows no cancelled job
        op.execute(f"UPDATE {table} SET status = 'failed' WHERE status = 'cancelled'")
    _statuses(_BEFORE)
