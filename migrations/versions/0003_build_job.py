"""Builds as worker jobs: calibration method, progress, heartbeat and the artifact's manifest.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = ("method", "percentile", "progress", "phase", "worker", "heartbeat_at", "manifest")


def upgrade() -> None:
    # Plain ADD COLUMNs (SQLite has them too); the server default fills rows written before.
    op.add_column("build", sa.Column("method", sa.String(16), nullable=True))
    op.add_column("build", sa.Column("percentile", sa.Float(), nullable=True))
    op.add_column(
        "build", sa.Column("progress", sa.Float(), nullable=False, server_default=sa.text("0"))
    )
    op.add_column("build", sa.Column("phase", sa.String(64), nullable=True))
    op.add_column("build", sa.Column("worker", sa.String(255), nullable=True))
    op.add_column("build", sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("build", sa.Column("manifest", sa.JSON(), nullable=True))
    op.create_index("ix_build_status", "build", ["status"])


def downgrade() -> None:
    op.drop_index("ix_build_status", "build")
    # SQLite drops columns by copying the table.
    with op.batch_alter_table("build") as batch:
        for column in _COLUMNS:
            batch.drop_column(column)
