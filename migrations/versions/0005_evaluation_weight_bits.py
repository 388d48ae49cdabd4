"""Evaluations record the policy's weight bits, as builds do (0004).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Evaluations queued or uploaded before were made with 8-bit weights.
    op.add_column(
        "evaluation", sa.Column("weight_bits", sa.Integer(), nullable=False, server_default="8")
    )


def downgrade() -> None:
    with op.batch_alter_table("evaluation") as batch:
        batch.drop_column("weight_bits")
