"""Profile documents in and out of the database, byte for byte, and exports of them as files.

A run stores its document minus the tensors (``run.document``, where ``tensors`` is kept as an
empty list so the keys keep their order) and one ``tensor_stat`` row per tensor entry: the
identity fields as columns, the statistics as the document has them. Reading reassembles the
same document: same keys, same order, same numbers.
"""

from __future__ import annotations

import io
import zipfile

from sqlalchemy import select
from sqlalchemy.orm import Session

from .models import Run, TensorStat

# The tensor entry's identity fields, in the document's order; the rest are statistics.
IDENTITY = (
    "profile_id",
    "source_node",
    "source_op",
    "source_tensor",
    "kind",
    "op",
    "shape",
    "dtype",
    "static",
)


def store_profile(session: Session, run: Run, doc: dict) -> None:
    run.document = {**doc, "tensors": []}
    for position, entry in enumerate(doc["tensors"]):
        stats = {k: v for k, v in entry.items() if k not in IDENTITY}
        session.add(
            TensorStat(
                run_id=run.id,
                position=position,
                **{k: entry[k] for k in IDENTITY},
                min=stats["min"],
                max=stats["max"],
                stats=stats,
            )
        )


def tensor_rows(session: Session, run_id: int) -> list[TensorStat]:
    query = select(TensorStat).where(TensorStat.run_id == run_id).order_by(TensorStat.position)
    return list(session.scalars(query))


def load_profile(session: Session, run: Run) -> dict:
    tensors = [
        {**{k: getattr(row, k) for k in IDENTITY}, **row.stats}
        for row in tensor_rows(session, run.id)
    ]
    return {**run.document, "tensors": tensors}


def zipped(files: dict[str, str]) -> bytes:
    """Files of an export (Model Explorer overlays) in a zip, in their order, dated 1980: the
    same files give the same bytes."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in files.items():
            archive.writestr(zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0)), text)
    return buffer.getvalue()
