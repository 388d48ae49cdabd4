"""Evaluations: FP32 vs INT8 error of a run's ranges, computed by the worker or uploaded.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _when(name: str, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "evaluation",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("method", sa.String(16), nullable=False),
        sa.Column("target", sa.String(16), nullable=False),
        sa.Column("percentile", sa.Float(), nullable=True),
        sa.Column("samples", sa.Integer(), nullable=True),
        sa.Column("data_name", sa.String(255), nullable=True),
        sa.Column("data_key", sa.Text(), nullable=True),
        sa.Column("data_sha256", sa.String(64), nullable=True),
        sa.Column("labels_name", sa.String(255), nullable=True),
        sa.Column("labels_key", sa.Text(), nullable=True),
        sa.Column("labels_sha256", sa.String(64), nullable=True),
        sa.Column("progress", sa.Float(), nullable=False),
        sa.Column("phase", sa.String(64), nullable=True),
        sa.Column("worker", sa.String(255), nullable=True),
        _when("heartbeat_at"),
        _when("created_at", nullable=False),
        _when("started_at"),
        _when("finished_at"),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("report", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_evaluation"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["run.id"], name="fk_evaluation_run_id_run", ondelete="CASCADE"
        ),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'done', 'failed')", name="ck_evaluation_status"
        ),
        sa.CheckConstraint("source IN ('service', 'report')", name="ck_evaluation_source"),
    )
    op.create_index("ix_evaluation_run_id", "evaluation", ["run_id"])
    op.create_index("ix_evaluation_status", "evaluation", ["status"])
    op.create_index("ix_evaluation_data_sha256", "evaluation", ["data_sha256"])
    op.create_index("ix_evaluation_labels_sha256", "evaluation", ["labels_sha256"])


def downgrade() -> None:
    op.drop_table("evaluation")  # its indexes go with it
