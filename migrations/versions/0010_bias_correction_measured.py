"""Bias correction on calibration data is named ``measured``: the requests of evaluations and
builds that held the data's spec in ``bias_correction`` hold ``"measured"`` there and the spec
in ``calibration_data`` (``rangeprof.workflows.requests.QuantizeRequest``); a downgrade moves
it back.

Revision ID: 0010
Revises: 0009
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_MEASURED, _STORED = "measured", "stored"
_TABLES = [
    sa.table(name, sa.column("id"), sa.column("request", sa.JSON))
    for name in ("evaluation", "build")
]


def _rewrite(change) -> None:
    connection = op.get_bind()
    for table in _TABLES:
        for row_id, request in connection.execute(sa.select(table.c.id, table.c.request)).all():
            if request is None:
                continue
            changed = change(dict(request))
            if changed is not None:
                connection.execute(
                    table.update().where(table.c.id == row_id).values(request=changed)
                )


def _measured(request: dict) -> dict | None:
    spec = request.get("bias_correction")
    if spec in (None, _STORED):
        return None
    return {**request, "bias_correction": _MEASURED, "calibration_data": spec}


def _spec(request: dict) -> dict | None:
    data = request.pop("calibration_data", None)
    if request.get("bias_correction") == _MEASURED:
        request["bias_correction"] = data
    return request


def upgrade() -> None:
    _rewrite(_measured)


def downgrade() -> None:
    _rewrite(_spec)
