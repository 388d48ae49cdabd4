"""Migrations build the schema of the ORM models, on SQLite and PostgreSQL; commands refuse a
database that is not at head; tokens are stored as hashes."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, select
from typer.testing import CliRunner

from rangeprof.cli import app as cli
from rangeprof.service.db import Database, make_engine
from rangeprof.service.migrate import alembic_config, head
from rangeprof.service.models import Base, Build, Evaluation, Run, Token
from rangeprof.workflows.requests import BuildRequest, EvaluateRequest, ProfileRequest

from service_fixtures import BACKENDS, database, environment_with, rangeprof, row_counts

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(params=BACKENDS)
def empty_db(request, tmp_path):
    with database(request.param, tmp_path) as url:
        yield url


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_builds_the_models_schema(empty_db):
    rangeprof("db", "upgrade", "--db", empty_db)
    assert _tables(empty_db) == set(Base.metadata.tables) | {"alembic_version"}
    assert set(row_counts(empty_db).values()) == {0}
    engine = make_engine(empty_db)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            assert context.get_current_revision() == head()
            assert compare_metadata(context, Base.metadata) == []
            if connection.dialect.name == "sqlite":  # tables copied since 0008 keep it
                for table in Base.metadata.sorted_tables:
                    ddl = connection.exec_driver_sql(
                        "SELECT sql FROM sqlite_master WHERE name = ?", (table.name,)
                    ).scalar()
                    autoincrement = table.dialect_options["sqlite"]["autoincrement"]
                    assert ("AUTOINCREMENT" in ddl) == autoincrement, table.name
    finally:
        engine.dispose()
    rangeprof("db", "upgrade", "--db", empty_db)  # at head already: nothing to do


def test_alembic_from_the_repository_root_and_back(empty_db):
    env = environment_with(RANGEPROF_DB=empty_db)
    upgrade = [sys.executable, "-m", "alembic", "upgrade", "head"]
    subprocess.run(upgrade, cwd=REPO, env=env, check=True, capture_output=True)
    assert set(Base.metadata.tables) <= _tables(empty_db)
    command.downgrade(alembic_config(empty_db), "base")
    assert _tables(empty_db) == {"alembic_version"}


@pytest.mark.parametrize(
    "command", [["token", "create", "me"], ["worker"], ["serve", "--port", "1"]]
)
def test_commands_refuse_a_database_not_at_head(tmp_path, command):
    url = f"sqlite:///{tmp_path / 'new.db'}"
    result = CliRunner().invoke(cli, [*command, "--db", url])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "rangeprof db upgrade" in lines[0], result.stderr


def test_unreachable_database_is_one_line(tmp_path):
    result = CliRunner().invoke(
        cli, ["db", "upgrade", "--db", "postgresql://nobody@127.0.0.1:1/none"]
    )
    assert result.exit_code == 2
    assert "cannot open the database" in result.stderr and "Traceback" not in result.output


def test_token_is_printed_once_and_stored_as_a_hash(empty_db):
    rangeprof("db", "upgrade", "--db", empty_db)
    token = rangeprof("token", "create", "alice", "--db", empty_db).strip()
    assert token.startswith("rp_") and len(token) > 40
    engine = make_engine(empty_db)
    try:
        with engine.connect() as connection:
            stored = connection.execute(select(Token.name, Token.token_hash)).all()
    finally:
        engine.dispose()
    assert stored == [("alice", hashlib.sha256(token.encode()).hexdigest())]
    again = CliRunner().invoke(cli, ["token", "create", "alice", "--db", empty_db])
    assert again.exit_code == 2 and "exists already" in again.stderr


# Rows as the schema of revision 0006 takes them (before the migrations that copy tables on
# SQLite, and before 0009 made the options of runs, builds and evaluations their request).
_ROWS_AT_0006 = {
    "token": ["(id, name, token_hash, created_at) VALUES (1, 'a', 'h', '2026-01-01')"],
    "model": [
        "(id, owner_id, name, sha256, size, opset, input_shapes, inputs, stages, created_at) "
        """VALUES (1, 1, 'm', 's', 1, 13, '{"x": [1, 4]}', '[]', '[]', '2026-01-01')"""
    ],
    "layer": [
        "(model_id, position, profile_id, kind, op, dtype) VALUES (1, 0, 'p', 'k', 'o', 'f')"
    ],
    "run": [
        "(id, model_id, status, data_kind, data_name, data_key, data_sha256, bins, samples, seed, "
        "progress, samples_done, created_at) "
        "VALUES (1, 1, 'done', 'npz', 'calib.npz', 'calib', 'c', 8, 4, 3, 1.0, 4, '2026-01-01')"
    ],
    "tensor_stat": [
        "(run_id, position, profile_id, kind, op, dtype, static, stats) "
        "VALUES (1, 0, 'p', 'k', 'o', 'f', false, '{}')"
    ],
    "qparams": ["(run_id, options, document, created_at) VALUES (1, '{}', '{}', '2026-01-01')"],
    "build": [
        "(model_id, run_id, target, method, percentile, weight_bits, status, created_at, progress) "
        "VALUES (1, 1, 'npu', 'percentile', 99.9, 7, 'done', '2026-01-01', 1.0)"
    ],
    "evaluation": [
        # Computed by the service, its labels an array of its data file.
        "(run_id, source, status, method, target, percentile, samples, weight_bits, data_name, "
        "data_key, data_sha256, labels_name, labels_key, labels_sha256, progress, created_at) "
        "VALUES (1, 'service', 'done', 'mse', 'x86', 99.99, 2, 8, 'eval.npz', 'x', 'e', "
        "'eval.npz', 'y', 'e', 1.0, '2026-01-01')",
        # An uploaded report: its options are the report's.
        "(run_id, source, status, method, target, samples, weight_bits, progress, created_at, "
        """report) VALUES (1, 'report', 'done', 'max', 'npu', 5, 8, 1.0, '2026-01-01', """
        """'{"method": "max", "target": "npu", "samples": 5}')""",
    ],
}
# The requests 0009 makes of those rows.
_REQUESTS_AT_0009 = {
    Run: ProfileRequest(
        model="m.onnx",
        data="calib.npz:calib",
        input_shapes={"x": (1, 4)},
        bins=8,
        samples=4,
        seed=3,
    ),
    Build: BuildRequest(
        model="m.onnx",
        out="artifact",
        target="npu",
        profile="profile.json",
        method="percentile",
        percentile=99.9,
        input_shapes={"x": (1, 4)},
        weight_bits=7,
    ),
    Evaluation: EvaluateRequest(
        model="m.onnx",
        profile="profile.json",
        method="mse",
        input_shapes={"x": (1, 4)},
        data="eval.npz:x",
        labels="eval.npz:y",
        samples=2,
        weight_bits=8,  # its column's: the default then
    ),
}


def _rows(url: str) -> dict[str, list[dict]]:
    """Every row of every table, by id."""
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return {
                name: [
                    dict(row._mapping)
                    for row in connection.exec_driver_sql(f"SELECT * FROM {name} ORDER BY id")
                ]
                for name in Base.metadata.tables
            }
    finally:
        engine.dispose()


def _rows_at_0006(url: str) -> None:
    """The database at revision 0006 holding :data:`_ROWS_AT_0006`."""
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            config = alembic_config(url)
            config.attributes["connection"] = connection
            command.upgrade(config, "0006")
            connection.commit()
        with engine.begin() as connection:
            for table, rows in _ROWS_AT_0006.items():
                for values in rows:
                    connection.exec_driver_sql(f"INSERT INTO {table} {values}")
    finally:
        engine.dispose()


def test_migrations_keep_every_row_both_ways(empty_db):
    """Migrations that copy a table (SQLite) must not cascade-delete the rows referring to it;
    0009 turns the option columns into requests and back."""
    _rows_at_0006(empty_db)
    counts = {table: len(rows) for table, rows in _ROWS_AT_0006.items()}
    before = _rows(empty_db)
    assert row_counts(empty_db) == counts
    rangeprof("db", "upgrade", "--db", empty_db)
    assert row_counts(empty_db) == counts
    db = Database(empty_db)
    try:
        with db.read() as session:  # reading validates each request
            for table, request in _REQUESTS_AT_0009.items():
                job = session.scalars(select(table).order_by(table.id)).first()
                assert job.request == request, table
            assert session.get(Run, 1).data_sha256 == "c"
            evaluation, report = session.scalars(select(Evaluation).order_by(Evaluation.id))
            assert (evaluation.data_sha256, evaluation.labels_sha256) == ("e", "e")
            assert report.request is None
    finally:
        db.dispose()
    command.downgrade(alembic_config(empty_db), "0006")
    assert _rows(empty_db) == before


def test_ids_of_deleted_objects_are_never_reused(empty_db):
    rangeprof("db", "upgrade", "--db", empty_db)
    db = Database(empty_db)
    try:
        ids = []
        for name in ("first", "second"):
            with db.session() as session:
                token = Token(name=name, token_hash=name)
                session.add(token)
                session.flush()
                ids.append(token.id)
                session.delete(token)
        assert ids[1] > ids[0]
    finally:
        db.dispose()


def test_bias_correction_on_data_becomes_measured_and_back(empty_db):
    """0010: a request that held its calibration data in ``bias_correction`` holds
    ``measured`` there and the data in ``calibration_data``; a downgrade moves it back."""
    spec = "calibration/calib.npz:calib"
    build = sa.table("build", sa.column("id"), sa.column("request", sa.JSON))
    _rows_at_0006(empty_db)
    command.upgrade(alembic_config(empty_db), "0009")
    engine = make_engine(empty_db)
    try:
        with engine.begin() as connection:
            request = connection.execute(select(build.c.request)).scalar()
            changed = {**request, "bias_correction": spec}
            connection.execute(build.update().values(request=changed))
    finally:
        engine.dispose()
    rangeprof("db", "upgrade", "--db", empty_db)
    db = Database(empty_db)
    try:
        with db.read() as session:
            upgraded = session.get(Build, 1).request
            assert (upgraded.bias_correction, upgraded.calibration_data) == ("measured", spec)
            evaluation = session.scalars(select(Evaluation).order_by(Evaluation.id)).first()
            assert evaluation.request.bias_correction is None
    finally:
        db.dispose()
    command.downgrade(alembic_config(empty_db), "0009")
    engine = make_engine(empty_db)
    try:
        with engine.connect() as connection:
            downgraded = connection.execute(select(build.c.request)).scalar()
    finally:
        engine.dispose()
    assert downgraded == changed
