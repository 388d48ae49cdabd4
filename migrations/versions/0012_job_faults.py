"""Jobs count their attempts: ``run``, ``evaluation`` and ``build`` get ``attempts`` (a worker's
claim adds one; a job whose worker died is queued again while it has retries left). Existing rows
get 0: a job running from before the upgrade is failed as before if its worker is gone.

Revision ID: 0012
Revises: 0011
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JOBS = ("run", "evaluation", "build")
# SQLite drops a column by copying the table: the copy keeps AUTOINCREMENT (revision 0008).
_KEEP = {"table_kwargs": {"sqlite_autoincrement": True}}


def upgrade() -> None:
    for table in _JOBS:
        op.add_column(
            table, sa.Column("attempts", sa.Integer(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    for table in _JOBS:
        with op.batch_alter_table(table, **_KEEP) as batch:
            batch.drop_column("attempts")
