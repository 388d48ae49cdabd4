"""Tokens expire and can be revoked: ``token.expires_at`` and ``token.revoked_at``.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Tokens made before never expire and are not revoked.
    for name in ("expires_at", "revoked_at"):
        op.add_column("token", sa.Column(name, sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("token") as batch:
        batch.drop_column("revoked_at")
        batch.drop_column("expires_at")
