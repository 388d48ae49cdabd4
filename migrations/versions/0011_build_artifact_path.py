"""A build's artifact is found by its ``artifact_sha256`` alone (the store names blobs by hash):
the ``artifact_path`` column, which nothing read, goes; a downgrade brings it back, filled in
from the hash as the store lays blobs out.

Revision ID: 0011
Revises: 0010
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# SQLite drops a column by copying the table: the copy keeps AUTOINCREMENT (revision 0008).
_KEEP = {"table_kwargs": {"sqlite_autoincrement": True}}


def upgrade() -> None:
    with op.batch_alter_table("build", **_KEEP) as batch:
        batch.drop_column("artifact_path")


def downgrade() -> None:
    with op.batch_alter_table("build", **_KEEP) as batch:
        batch.add_column(sa.Column("artifact_path", sa.Text(), nullable=True))
    build = sa.table(
        "build", sa.column("artifact_sha256", sa.Text), sa.column("artifact_path", sa.Text)
    )
    sha256 = build.c.artifact_sha256
    # BlobStore.path: the blob under its hash's first two digits, with the artifact's suffix
    path = sa.func.substr(sha256, 1, 2, type_=sa.Text) + "/" + sha256 + ".zip"
    op.execute(build.update().where(sha256.is_not(None)).values(artifact_path=path))
