"""Builds record the policy's weight bits (7: vpmaddubsw on x86 without VNNI).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Builds queued before were built with 8-bit weights.
    op.add_column(
        "build", sa.Column("weight_bits", sa.Integer(), nullable=False, server_default="8")
    )


def downgrade() -> None:
    with op.batch_alter_table("build") as batch:
        batch.drop_column("weight_bits")
