"""Service tables: tokens, models and layers, runs and tensor statistics, qparams, builds.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_STATUS = "status IN ('queued', 'running', 'done', 'failed')"


def _when(name: str, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _id(table: str) -> tuple[sa.Column, sa.PrimaryKeyConstraint]:
    return sa.Column("id", sa.Integer(), nullable=False), sa.PrimaryKeyConstraint(
        "id", name=f"pk_{table}"
    )


def _parent(table: str, column: str, parent: str, on_delete: str, nullable: bool = False):
    return sa.Column(column, sa.Integer(), nullable=nullable), sa.ForeignKeyConstraint(
        [column], [f"{parent}.id"], name=f"fk_{table}_{column}_{parent}", ondelete=on_delete
    )


def upgrade() -> None:
    op.create_table(
        "token",
        *_id("token"),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        _when("created_at", nullable=False),
        sa.UniqueConstraint("name", name="uq_token_name"),
        sa.UniqueConstraint("token_hash", name="uq_token_token_hash"),
    )
    op.create_table(
        "model",
        *_id("model"),
        *_parent("model", "owner_id", "token", "CASCADE"),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("opset", sa.Integer(), nullable=False),
        sa.Column("input_shapes", sa.JSON(), nullable=False),
        sa.Column("inputs", sa.JSON(), nullable=False),
        sa.Column("stages", sa.JSON(), nullable=False),
        _when("created_at", nullable=False),
    )
    op.create_index("ix_model_owner_id", "model", ["owner_id"])
    op.create_index("ix_model_sha256", "model", ["sha256"])
    op.create_table(
        "layer",
        *_id("layer"),
        *_parent("layer", "model_id", "model", "CASCADE"),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("profile_id", sa.Text(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("op", sa.String(100), nullable=False),
        sa.Column("source_node", sa.Text(), nullable=True),
        sa.Column("source_op", sa.String(100), nullable=True),
        sa.Column("source_tensor", sa.Text(), nullable=True),
        sa.Column("shape", sa.JSON(), nullable=True),
        sa.Column("dtype", sa.String(32), nullable=False),
        sa.UniqueConstraint("model_id", "position", name="uq_layer_model_id_position"),
        sa.UniqueConstraint("model_id", "profile_id", name="uq_layer_model_id_profile_id"),
    )
    op.create_table(
        "run",
        *_id("run"),
        *_parent("run", "model_id", "model", "CASCADE"),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("data_kind", sa.String(16), nullable=False),
        sa.Column("data_name", sa.String(255), nullable=True),
        sa.Column("data_key", sa.Text(), nullable=True),
        sa.Column("data_sha256", sa.String(64), nullable=True),
        sa.Column("bins", sa.Integer(), nullable=False),
        sa.Column("batch_size", sa.Integer(), nullable=True),
        sa.Column("samples", sa.Integer(), nullable=True),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("progress", sa.Float(), nullable=False),
        sa.Column("samples_done", sa.Integer(), nullable=False),
        sa.Column("samples_total", sa.Integer(), nullable=True),
        sa.Column("worker", sa.String(255), nullable=True),
        _when("heartbeat_at"),
        _when("created_at", nullable=False),
        _when("started_at"),
        _when("finished_at"),
        sa.Column("timings", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("document", sa.JSON(), nullable=True),
        sa.CheckConstraint(_STATUS, name="ck_run_status"),
        sa.CheckConstraint("data_kind IN ('npz', 'random')", name="ck_run_data_kind"),
    )
    op.create_index("ix_run_model_id", "run", ["model_id"])
    op.create_index("ix_run_status", "run", ["status"])
    op.create_index("ix_run_data_sha256", "run", ["data_sha256"])
    op.create_table(
        "tensor_stat",
        *_id("tensor_stat"),
        *_parent("tensor_stat", "run_id", "run", "CASCADE"),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("profile_id", sa.Text(), nullable=False),
        sa.Column("source_node", sa.Text(), nullable=True),
        sa.Column("source_op", sa.String(100), nullable=True),
        sa.Column("source_tensor", sa.Text(), nullable=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("op", sa.String(100), nullable=False),
        sa.Column("shape", sa.JSON(), nullable=True),
        sa.Column("dtype", sa.String(32), nullable=False),
        sa.Column("static", sa.Boolean(), nullable=False),
        sa.Column("min", sa.Float(), nullable=True),
        sa.Column("max", sa.Float(), nullable=True),
        sa.Column("stats", sa.JSON(), nullable=False),
        sa.UniqueConstraint("run_id", "position", name="uq_tensor_stat_run_id_position"),
        sa.UniqueConstraint("run_id", "profile_id", name="uq_tensor_stat_run_id_profile_id"),
    )
    op.create_table(
        "qparams",
        *_id("qparams"),
        *_parent("qparams", "run_id", "run", "CASCADE"),
        sa.Column("options", sa.JSON(), nullable=False),
        sa.Column("document", sa.JSON(), nullable=False),
        _when("created_at", nullable=False),
    )
    op.create_index("ix_qparams_run_id", "qparams", ["run_id"])
    op.create_table(
        "build",
        *_id("build"),
        *_parent("build", "model_id", "model", "CASCADE"),
        *_parent("build", "run_id", "run", "SET NULL", nullable=True),
        *_parent("build", "qparams_id", "qparams", "SET NULL", nullable=True),
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("artifact_path", sa.Text(), nullable=True),
        sa.Column("artifact_sha256", sa.String(64), nullable=True),
        sa.Column("timings", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        _when("created_at", nullable=False),
        _when("started_at"),
        _when("finished_at"),
        sa.CheckConstraint(_STATUS, name="ck_build_status"),
    )
    op.create_index("ix_build_model_id", "build", ["model_id"])
    op.create_index("ix_build_artifact_sha256", "build", ["artifact_sha256"])


def downgrade() -> None:
    for table in ("build", "qparams", "tensor_stat", "run", "layer", "model", "token"):
        op.drop_table(table)  # indexes go with their tables
