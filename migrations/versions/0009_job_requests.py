"""A job's options are its workflow request: ``run``, ``evaluation`` and ``build`` get a JSON
column ``request`` (``ProfileRequest`` / ``EvaluateRequest`` / ``BuildRequest`` of
``rangeprof.workflows.requests``, ``model_dump(mode="json")``, paths as the names of the files
in the job's folder) that replaces their option columns; builds get the blob columns of an
accuracy budget's evaluation data and labels.

Existing rows get the request their columns describe, and a downgrade writes the columns back
from it (options the older schema has no column for, such as an accuracy budget, are lost).
An uploaded report's evaluation has no request: its options are in the report.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26
"""

from collections.abc import Iterable, Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# What the job's folder holds, as the service's worker lays it out.
_PROFILE, _QPARAMS, _ARTIFACT, _RANDOM = "profile.json", "qparams.json", "artifact", "random"
# Tables copied on SQLite keep AUTOINCREMENT (0008).
_KEEP = {"table_kwargs": {"sqlite_autoincrement": True}}

_RUN_OPTIONS = ("data_name", "data_key", "bins", "batch_size", "samples", "seed")
_EVALUATION_OPTIONS = (
    "method", "target", "weight_bits", "percentile", "samples",
    "data_name", "data_key", "labels_name", "labels_key",
)  # fmt: skip
_BUILD_OPTIONS = ("target", "method", "percentile", "weight_bits")
_BUILD_BLOBS = ("data_sha256", "labels_sha256")


def _table(name: str, *columns: str, json: Iterable[str] = ()) -> sa.TableClause:
    return sa.table(name, *map(sa.column, columns), *(sa.column(c, sa.JSON) for c in json))


_MODEL = _table("model", "id", "name", json=["input_shapes"])
_RUN = _table("run", "id", "model_id", "data_kind", *_RUN_OPTIONS, json=["request"])
_EVALUATION = _table(
    "evaluation", "id", "run_id", "source", *_EVALUATION_OPTIONS, json=["request", "report"]
)
_BUILD = _table("build", "id", "model_id", "qparams_id", *_BUILD_OPTIONS, json=["request"])


def _spec(name: str | None, key: str | None) -> str | None:
    """The data option of a file in the job's folder (``rangeprof.service.uploads.data_spec``)."""
    if name is None:
        return None
    return f"{name}:{key}" if key else name


def _bits(weight_bits: int | None) -> int:
    """A request's weight bits as the columns held them: null (the target's choice, per layer,
    added later) was then 8."""
    return 8 if weight_bits is None else weight_bits


def _split(spec: str | None) -> tuple[str | None, str | None]:
    """``FILE.npz:KEY`` -> (FILE.npz, KEY), as the profiler reads a data option."""
    if spec is None:
        return None, None
    head, sep, tail = spec.rpartition(":")
    return (head, tail) if sep and head.lower().endswith(".npz") else (spec, None)


def _quantize_request(model, values: dict) -> dict:
    """A QuantizeRequest as ``model_dump(mode="json")`` writes it, from ``values`` over the
    defaults."""
    return {
        "model": f"{model.name}.onnx",
        "target": "x86",
        "qparams": None,
        "profile": _PROFILE,
        "method": "max",
        "percentile": 99.99,
        "input_shapes": model.input_shapes,
        "fp32_fallback": False,
        "accuracy_budget": None,
        "data": None,
        "labels": None,
        "samples": None,
        "weight_bits": 8,
        **values,
    }


def _write(table: sa.TableClause, updates: list[dict]) -> None:
    """Set each ``{"id": ID, column: value, ...}`` of ``updates`` (one statement per row: the
    rows of one table may set different columns)."""
    for update in updates:
        values = {k: v for k, v in update.items() if k != "id"}
        op.get_bind().execute(table.update().where(table.c.id == update["id"]).values(**values))


def _models():
    return {m.id: m for m in op.get_bind().execute(sa.select(_MODEL))}


def _fill_requests() -> None:
    bind, models = op.get_bind(), _models()
    _write(
        _RUN,
        [
            {
                "id": run.id,
                "request": {
                    "model": f"{models[run.model_id].name}.onnx",
                    "data": _spec(run.data_name, run.data_key) or _RANDOM,
                    "input_shapes": models[run.model_id].input_shapes,
                    "bins": run.bins,
                    "batch_size": run.batch_size,
                    "samples": run.samples,
                    "seed": run.seed,
                    "constant_inputs": [],
                    "preprocess": None,
                    "ray": None,
                    "workers": None,
                    "shards": None,
                },
            }
            for run in bind.execute(sa.select(_RUN))
        ],
    )
    model_of_run = dict(bind.execute(sa.select(_RUN.c.id, _RUN.c.model_id)).all())
    service = sa.select(_EVALUATION).where(_EVALUATION.c.source == "service")
    _write(
        _EVALUATION,
        [
            {
                "id": e.id,
                "request": _quantize_request(
                    models[model_of_run[e.run_id]],
                    {
                        "target": e.target,
                        "method": e.method,
                        "percentile": 99.99 if e.percentile is None else e.percentile,
                        "data": _spec(e.data_name, e.data_key),
                        "labels": _spec(e.labels_name, e.labels_key),
                        "samples": e.samples,
                        "weight_bits": e.weight_bits,
                    },
                ),
            }
            for e in bind.execute(service)
        ],
    )
    _write(
        _BUILD,
        [
            {
                "id": b.id,
                "request": _quantize_request(
                    models[b.model_id],
                    {
                        "target": b.target,
                        # Without its qparams set the job process took the profile with max.
                        "qparams": _QPARAMS if b.qparams_id is not None else None,
                        "profile": None if b.qparams_id is not None else _PROFILE,
                        "method": b.method or "max",
                        "percentile": 99.99 if b.percentile is None else b.percentile,
                        "weight_bits": b.weight_bits,
                        "out": _ARTIFACT,
                    },
                ),
            }
            for b in bind.execute(sa.select(_BUILD))
        ],
    )


def _check_constraint(table: str, column: str) -> str:
    """The name of ``table``'s CHECK on ``column`` (SQLite's copies have renamed it)."""
    checks = sa.inspect(op.get_bind()).get_check_constraints(table)
    return next(c["name"] for c in checks if column in c["sqltext"])


def upgrade() -> None:
    for table in ("run", "evaluation", "build"):
        op.add_column(table, sa.Column("request", sa.JSON(), nullable=True))
    for column in _BUILD_BLOBS:
        op.add_column("build", sa.Column(column, sa.String(64), nullable=True))
        op.create_index(f"ix_build_{column}", "build", [column])
    _fill_requests()
    data_kind = _check_constraint("run", "data_kind")
    with op.batch_alter_table("run", **_KEEP) as batch:
        batch.alter_column("request", existing_type=sa.JSON(), nullable=False)
        batch.drop_constraint(op.f(data_kind), type_="check")
        for column in ("data_kind", *_RUN_OPTIONS):
            batch.drop_column(column)
    with op.batch_alter_table("evaluation", **_KEEP) as batch:
        for column in _EVALUATION_OPTIONS:
            batch.drop_column(column)
    with op.batch_alter_table("build", **_KEEP) as batch:
        batch.alter_column("request", existing_type=sa.JSON(), nullable=False)
        for column in _BUILD_OPTIONS:
            batch.drop_column(column)


def _fill_columns() -> None:
    bind = op.get_bind()
    updates = []
    for run in bind.execute(sa.select(_RUN.c.id, _RUN.c.request)):
        request = run.request
        name, key = (None, None) if request["data"] == _RANDOM else _split(request["data"])
        updates.append(
            {
                "id": run.id,
                "data_kind": "random" if name is None else "npz",
                "data_name": name,
                "data_key": key,
                **{k: request[k] for k in ("bins", "batch_size", "samples", "seed")},
            }
        )
    _write(_RUN, updates)
    updates = []
    for e in bind.execute(sa.select(_EVALUATION.c.id, _EVALUATION.c.request, _EVALUATION.c.report)):
        if e.request is None:  # an uploaded report: what 0008 copied from it
            options = {k: e.report[k] for k in ("method", "target", "samples")}
            updates.append(
                {"id": e.id, **options, "weight_bits": _bits(e.report.get("weight_bits", 8))}
            )
            continue
        request = e.request
        data_name, data_key = _split(request["data"])
        labels_name, labels_key = _split(request["labels"])
        options = ("method", "target", "weight_bits", "percentile", "samples")
        updates.append(
            {
                "id": e.id,
                **{k: request[k] for k in options},
                "weight_bits": _bits(request["weight_bits"]),
                "data_name": data_name,
                "data_key": data_key,
                "labels_name": labels_name,
                "labels_key": labels_key,
            }
        )
    _write(_EVALUATION, updates)
    updates = []
    for b in bind.execute(sa.select(_BUILD.c.id, _BUILD.c.request)):
        request = b.request
        derived = request["qparams"] is None
        updates.append(
            {
                "id": b.id,
                "target": request["target"],
                "method": request["method"] if derived else None,
                "percentile": request["percentile"] if derived else None,
                "weight_bits": _bits(request["weight_bits"]),
            }
        )
    _write(_BUILD, updates)


def downgrade() -> None:
    text = sa.Text()
    eight = {"nullable": False, "server_default": "8"}  # 0004, 0005
    columns = {
        "run": [
            sa.Column("data_kind", sa.String(16)),
            sa.Column("data_name", sa.String(255)),
            sa.Column("data_key", text),
            sa.Column("bins", sa.Integer()),
            sa.Column("batch_size", sa.Integer()),
            sa.Column("samples", sa.Integer()),
            sa.Column("seed", sa.Integer()),
        ],
        "evaluation": [
            sa.Column("method", sa.String(16)),
            sa.Column("target", sa.String(16)),
            sa.Column("weight_bits", sa.Integer(), **eight),
            sa.Column("percentile", sa.Float()),
            sa.Column("samples", sa.Integer()),
            sa.Column("data_name", sa.String(255)),
            sa.Column("data_key", text),
            sa.Column("labels_name", sa.String(255)),
            sa.Column("labels_key", text),
        ],
        "build": [
            sa.Column("target", text),
            sa.Column("method", sa.String(16)),
            sa.Column("percentile", sa.Float()),
            sa.Column("weight_bits", sa.Integer(), **eight),
        ],
    }
    for table, added in columns.items():
        for column in added:
            op.add_column(table, column)
    _fill_columns()
    with op.batch_alter_table("run", **_KEEP) as batch:
        for column, kind in (
            ("data_kind", sa.String(16)),
            ("bins", sa.Integer()),
            ("seed", sa.Integer()),
        ):
            batch.alter_column(column, existing_type=kind, nullable=False)
        batch.create_check_constraint("data_kind", "data_kind IN ('npz', 'random')")
        batch.drop_column("request")
    with op.batch_alter_table("evaluation", **_KEEP) as batch:
        for column in ("method", "target"):
            batch.alter_column(column, existing_type=sa.String(16), nullable=False)
        batch.drop_column("request")
    for column in _BUILD_BLOBS:
        op.drop_index(f"ix_build_{column}", "build")
    with op.batch_alter_table("build", **_KEEP) as batch:
        batch.alter_column("target", existing_type=text, nullable=False)
        for column in ("request", *_BUILD_BLOBS):
            batch.drop_column(column)
