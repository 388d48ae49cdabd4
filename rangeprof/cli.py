"""The ``rangeprof`` command line.

User errors (:class:`~rangeprof.profiler.errors.RangeprofError`) print one line on stderr and exit
with code 2; the JSON printed by ``--json`` goes to stdout alone so it can be piped."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from rangeprof.profiler.errors import RangeprofError
from rangeprof.workflows.options import CalibrationOptions, ProfileOptions, QuantizeOptions

from .cli_options import with_options

if TYPE_CHECKING:
    from rangeprof.byoc.reports import EvaluationReport

app = typer.Typer(
    help="Tensor-range profiling with IR tracking for INT8 quantization on Apache TVM.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
_err = Console(stderr=True, soft_wrap=True)  # a long path is not wrapped in a log
_out = Console()

InputShapes = Annotated[
    list[str] | None,
    typer.Option(
        "--input-shape",
        help="Static shape of an input, NAME=DIMS (e.g. x=1x3x48x192); repeatable.",
    ),
]
Equalize = Annotated[
    bool,
    typer.Option(
        "--equalize",
        help="Cross-layer equalization first (conv/dense pairs; builds of the profile repeat it).",
    ),
]


def _fail(err: RangeprofError) -> typer.Exit:
    _err.print(f"error: {err}", markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(code=2)


def _check_out(out: Path) -> None:
    """Before the work: the folder a result file goes to must exist."""
    if not out.parent.is_dir():
        raise RangeprofError(f"{out}: folder {out.parent} does not exist")


def _write(out: Path, text: str) -> None:
    """Write a command's result file; a path that cannot be written is a one-line error."""
    try:
        out.write_text(text)
    except OSError as err:
        raise _fail(RangeprofError(f"{out}: cannot write: {err.strerror}")) from None


def _shapes(values: list[str] | None) -> dict[str, tuple[int, ...]]:
    from rangeprof.profiler.ir.onnx_load import parse_input_shape

    return dict(parse_input_shape(v) for v in values or [])


def _version(value: bool) -> None:
    if value:
        from importlib import metadata

        print(f"rangeprof {metadata.version('rangeprof')}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """rangeprof: profile FP32 tensor ranges by profileID, then quantize from the profile."""


def _needs_service() -> None:
    """The service's commands need the ``service`` extra: without it, one line, exit 2."""
    try:
        import alembic  # noqa: F401
        import fastapi  # noqa: F401
        import sqlalchemy  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise _fail(
            RangeprofError(
                f"this command needs rangeprof's service extra ({err.name} is not installed): "
                "pip install 'rangeprof[service]'"
            )
        ) from None


@app.command()
def inspect(
    model: Annotated[Path, typer.Argument(help="ONNX model file.")],
    input_shape: InputShapes = None,
    target: Annotated[str, typer.Option(help="Whose partition: x86 | aarch64 | npu")] = "x86",
    equalize: Equalize = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Show the model's layers with their profileIDs and the lineage after every stage."""
    from rangeprof.workflows import profiling

    try:
        request = _request(
            "InspectRequest",
            model=model,
            input_shapes=_shapes(input_shape),
            target=target,
            equalize=equalize,
        )
        with _err.status("importing and tracking stages...", spinner="dots"):
            doc = profiling.inspect(request)
    except RangeprofError as err:
        raise _fail(err) from None
    if as_json:
        typer.echo(json.dumps(doc, indent=1))
        return
    out = Console(width=max(Console().width, 160))
    info = doc["model"]
    out.print(
        f"[bold]{info['name']}[/bold]  sha256 {info['sha256'][:16]}…  inputs {info['inputs']}"
    )
    layers = Table("profile_id", "op", "source_op", "source_tensor", "shape", "dtype")
    for column in layers.columns:
        column.overflow = "fold"
    for layer in doc["layers"]:
        layers.add_row(
            layer["profile_id"],
            layer["op"],
            layer["source_op"] or layer["kind"],
            layer["source_tensor"] or "",
            "x".join(map(str, layer["shape"])) if layer["shape"] is not None else "",
            layer["dtype"],
        )
    out.print(layers)
    stages = Table("stage", "bindings", "tracked", "fates")
    for stage in doc["stages"]:
        stages.add_row(
            stage["name"], str(stage["bindings"]), str(stage["tracked"]), str(len(stage["fates"]))
        )
    out.print(stages)


@app.command()
@with_options(ProfileOptions)
def profile(
    model: Annotated[Path, typer.Argument(help="ONNX model file.")],
    data: Annotated[
        str,
        typer.Option(
            help="Calibration data: FILE.npz[:KEY[,KEY...]], FILE.npy, a folder of images, "
            "or 'random'."
        ),
    ],
    out: Annotated[Path, typer.Option(help="Where to write the profile JSON.")],
    input_shape: InputShapes = None,
    constant_input: Annotated[
        list[str] | None,
        typer.Option(
            "--constant-input",
            metavar="NAME",
            help="An input fed whole in every run (a state, mask or length: its array has the "
            "input's full shape, no sample axis); repeatable. Scalar inputs always are.",
        ),
    ] = None,
    preprocess: Annotated[
        str | None,
        typer.Option(
            help="Image preprocessing, e.g. 'size=48x192,mean=0.5,0.5,0.5,std=0.5,0.5,0.5'."
        ),
    ] = None,
    ray: Annotated[
        str | None,
        typer.Option(
            "--ray",
            metavar="ADDRESS|local",
            help="Profile shards of the data on a Ray cluster: 'local' starts one on this "
            "machine, else its address (needs rangeprof[ray]).",
        ),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(min=1, help="Ray workers (with --ray; default 2), each with its CPU share."),
    ] = None,
    shards: Annotated[
        int | None,
        typer.Option(min=1, help="Shards of the data (with --ray; default 4 per worker)."),
    ] = None,
    *,
    options: dict,
) -> None:
    """Run calibration data through the instrumented FP32 model and write the profile."""
    from rangeprof.profiler.profiling.document import nonfinite_summary
    from rangeprof.workflows import profiling

    try:
        _check_out(out)
        request = _request(
            "ProfileRequest",
            model=model,
            data=data,
            input_shapes=_shapes(input_shape),
            constant_inputs=tuple(constant_input or ()),
            preprocess=preprocess,
            ray=ray,
            workers=workers,
            shards=shards,
            **options,
        )
        with _progress() as advance:
            doc = profiling.profile(request, lambda done, total: advance("profiling", done, total))
    except RangeprofError as err:
        raise _fail(err) from None
    _write(out, doc.dumps())
    run = doc.run
    _err.print(
        f"profiled {len(doc.tensors)} tensors on {run.samples} samples "
        f"in {run.timings['total_s']:.1f}s -> {out}",
        highlight=False,
    )
    for line in nonfinite_summary(doc.to_json()):  # overflow warnings, counts of non-finite data
        _err.print(line, markup=False, highlight=False)


@app.command()
@with_options(CalibrationOptions)
def calibrate(
    profile_path: Annotated[Path, typer.Argument(metavar="PROFILE", help="Profile JSON.")],
    out: Annotated[Path, typer.Option(help="Where to write the QPARAMS JSON.")],
    *,
    options: dict,
) -> None:
    """Derive quantization parameters per profileID from a stored profile, with the target's
    policy where an option is not given (the qparams a build for that target derives)."""
    from rangeprof.workflows import profiling

    try:
        _check_out(out)
        request = _request("CalibrateRequest", profile=profile_path, **options)
        doc = profiling.calibrate(request)
    except RangeprofError as err:
        raise _fail(err) from None
    _write(out, doc.dumps())
    chosen = doc.options
    _err.print(
        f"{len(doc.qparams)} tensors calibrated ({chosen.method}, {request.target}: "
        f"{chosen.scheme} {chosen.dtype}) -> {out}",
        highlight=False,
    )


@app.command("import-qparams")
def import_qparams(
    model: Annotated[Path, typer.Argument(help="QDQ ONNX model file.")],
    out: Annotated[Path, typer.Option(help="Where to write the QPARAMS JSON.")],
    input_shape: InputShapes = None,
) -> None:
    """Read a QDQ model's embedded scales as a QPARAMS document, by profileID, for `build`."""
    from rangeprof.profiler.calibrate.imported import import_qparams as read

    try:
        _check_out(out)
        doc = read(model, _shapes(input_shape))
    except RangeprofError as err:
        raise _fail(err) from None
    _write(out, json.dumps(doc, indent=1))
    kinds = [e["kind"] for e in doc["qparams"]]
    _err.print(
        f"{len(kinds) - kinds.count('weight')} tensors and {kinds.count('weight')} weights "
        f"({doc['options']['scheme']} {doc['options']['dtype']}) -> {out}",
        highlight=False,
    )


@app.command()
@with_options(CalibrationOptions)
def export(
    profile_path: Annotated[Path, typer.Argument(metavar="PROFILE", help="Profile JSON.")],
    fmt: Annotated[
        str,
        typer.Option("--format", help="aimet | ort | ort-json | tensorrt | qdq | model-explorer"),
    ],
    out: Annotated[
        Path,
        typer.Option(
            help="Where to write the export (model-explorer: a folder, a JSON file per figure)."
        ),
    ],
    model: Annotated[
        Path | None,
        typer.Option(help="The profiled ONNX model (qdq, model-explorer)."),
    ] = None,
    evaluation: Annotated[
        Path | None,
        typer.Option(
            help="The JSON of `rangeprof evaluate --json` on this profile: the SQNR and kept-FP32 "
            "figures of model-explorer."
        ),
    ] = None,
    *,
    options: dict,
) -> None:
    """Write the profile's ranges in another tool's format: a calibration table, a QDQ ONNX
    model (qdq: activations as the target's policy or scheme and dtype say, weights symmetric
    int8), or Model Explorer node-data overlays (model-explorer)."""
    from rangeprof.workflows import profiling

    try:
        _check_out(out)
        request = _request(
            "ExportRequest",
            profile=profile_path,
            format=fmt,
            model=model,
            evaluation=evaluation,
            **options,
        )
        profiling.write_export(out, profiling.export(request))
    except RangeprofError as err:
        raise _fail(err) from None
    _err.print(f"{fmt} export -> {out}", highlight=False)


@app.command()
def report(
    profile_path: Annotated[Path, typer.Argument(metavar="PROFILE", help="Profile JSON.")],
    out: Annotated[Path, typer.Option(help="Where to write the HTML file.")],
    evaluation: Annotated[
        Path | None,
        typer.Option(help="The JSON of `rangeprof evaluate --json` on this profile."),
    ] = None,
    target: Annotated[
        str | None,
        typer.Option(
            help="x86 | aarch64 | npu: whose grid the scales are on (default: the evaluation's "
            "target, else x86)."
        ),
    ] = None,
) -> None:
    """One static HTML file, openable offline: the per-layer table with the scales the target
    uses, histograms with each calibration method's clipping range, and the per-layer error of
    an evaluation."""
    from rangeprof.profiler.profiling.records import ProfileDocument
    from rangeprof.workflows.profiling import evaluation_report, report_html

    try:
        _check_out(out)
        doc = ProfileDocument.from_json(profile_path)
        measured = None if evaluation is None else evaluation_report(evaluation)
        html = report_html(doc, measured, target)
    except RangeprofError as err:
        raise _fail(err) from None
    _write(out, html)
    _err.print(f"report of {len(doc.tensors)} tensors -> {out}", highlight=False)


# INT8 builds and their evaluation (`rangeprof.byoc`).

QparamsFile = Annotated[
    Path | None, typer.Option("--qparams", help="QPARAMS JSON (from `rangeprof calibrate`).")
]
ProfileFile = Annotated[
    Path | None,
    typer.Option("--profile", help="Profile JSON: qparams derived with the target's policy."),
]
Labels = Annotated[str | None, typer.Option(help="Labels for top-1, FILE.npz:KEY.")]
CalibrationData = Annotated[
    str | None,
    typer.Option(help="Calibration data of --bias-correction measured, FILE.npz:KEY."),
]


@app.command()
@with_options(QuantizeOptions)
def build(
    model: Annotated[Path, typer.Argument(help="ONNX model file.")],
    out: Annotated[Path, typer.Option(help="Folder for model.so and manifest.json.")],
    qparams: QparamsFile = None,
    profile: ProfileFile = None,
    input_shape: InputShapes = None,
    data: Annotated[
        str | None, typer.Option(help="Evaluation data of --accuracy-budget, FILE.npz:KEY.")
    ] = None,
    labels: Labels = None,
    calibration_data: CalibrationData = None,
    *,
    options: dict,
) -> None:
    """Compile the model with INT8 regions for a target into a deployable artifact."""
    from rangeprof.workflows import quantize

    try:
        request = _request(
            "BuildRequest",
            model=model,
            out=out,
            qparams=qparams,
            profile=profile,
            input_shapes=_shapes(input_shape),
            data=data,
            labels=labels,
            calibration_data=calibration_data,
            **options,
        )
        with _progress() as advance:
            manifest = quantize.build(request, advance)
    except RangeprofError as err:
        raise _fail(err) from None
    int8 = sum(r.mode == "int8" for r in manifest.regions)
    _err.print(
        f"{request.target}: {int8} of {len(manifest.regions)} regions INT8"
        + (f", int16: {', '.join(manifest.kept_int16)}" if manifest.kept_int16 else "")
        + (f", kept FP32: {', '.join(manifest.kept_fp32)}" if manifest.kept_fp32 else "")
        + f" -> {out / manifest.library}",
        highlight=False,
    )


def _request(kind: str, **fields):
    """A workflow request; a value it refuses is one line naming the option."""
    from pydantic import ValidationError

    from rangeprof.workflows import requests
    from rangeprof.workflows.options import refusal

    try:
        return getattr(requests, kind)(**fields)
    except ValidationError as err:
        raise refusal(err) from None


_PLAIN_EVERY_S = 5.0  # at most one progress line this often in a pipe or a log
_PLAIN_AFTER_S = 2.0  # and none before


@contextmanager
def _progress():
    """``advance(what, done, total)`` for a job's progress on stderr: a bar on a terminal; in
    a pipe or a log, after the first seconds, a plain line when the phase changes, when it
    ends, and every few seconds."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    if _err.is_terminal:
        columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        with Progress(*columns, console=_err, transient=True) as progress:
            task = progress.add_task("compiling", total=None)

            def advance(what: str, done: int, total: int | None) -> None:
                progress.update(task, description=what, completed=done, total=total)

            yield advance
        return
    start, last = time.monotonic(), {"what": None, "at": float("-inf")}

    def advance(what: str, done: int, total: int | None) -> None:
        now = time.monotonic()
        if now - start < _PLAIN_AFTER_S:
            return  # a quick command, or one failing at once, prints its result or error alone
        if what != last["what"] or done == total or now - last["at"] >= _PLAIN_EVERY_S:
            _err.print(f"{what}: {done}/{'?' if total is None else total}", highlight=False)
            last.update(what=what, at=now)

    yield advance


def _evaluation_table(report: EvaluationReport) -> Table:
    table = Table(title="per layer, worst isolated SQNR first")
    columns = ("profileID", "pattern", "mode", "weight bits", "isolated dB", "accumulated dB")
    for column in (*columns, "rmse/scale"):
        table.add_column(column)

    def db(value):
        return "exact" if value is None else f"{value:.2f}"

    for layer in report.layers:
        table.add_row(
            layer.profile_id,
            layer.pattern.split(".", 1)[-1],
            layer.mode,
            "" if layer.weight_bits is None else str(layer.weight_bits),
            db(layer.isolated_sqnr_db),
            db(layer.accumulated_sqnr_db),
            f"{layer.isolated_rmse_per_scale:.2f} / {layer.accumulated_rmse_per_scale:.2f}",
        )
    return table


@app.command()
@with_options(QuantizeOptions)
def evaluate(
    model: Annotated[Path, typer.Argument(help="ONNX model file.")],
    data: Annotated[str, typer.Option(help="Evaluation data, FILE.npz:KEY.")],
    labels: Labels = None,
    qparams: QparamsFile = None,
    profile: ProfileFile = None,
    input_shape: InputShapes = None,
    calibration_data: CalibrationData = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    *,
    options: dict,
) -> None:
    """FP32 vs INT8: top-1, agreement, output SQNR and per-layer error by profileID."""
    from rangeprof.workflows import quantize

    try:
        request = _request(
            "EvaluateRequest",
            model=model,
            data=data,
            labels=labels,
            qparams=qparams,
            profile=profile,
            input_shapes=_shapes(input_shape),
            calibration_data=calibration_data,
            **options,
        )
        with _progress() as advance:
            report = quantize.evaluate(request, advance)
    except RangeprofError as err:
        raise _fail(err) from None
    best_method = report.method
    if as_json:
        print(report.dumps())
        return
    top1 = (
        f"top-1 FP32 {report.fp32_top1:.2f}% INT8 {report.int8_top1:.2f}%, "
        if report.fp32_top1 is not None
        else ""
    )
    if request.metric == "bpc" and report.int8_metric is not None:  # stored as -bpc
        fp32, int8 = -report.fp32_metric, -report.int8_metric
        top1 = f"bpc FP32 {fp32:.4f} INT8 {int8:.4f} ({100 * (int8 / fp32 - 1):+.2f}%), "
    _out.print(
        f"{request.target}, {report.samples} samples, method {best_method}: {top1}"
        f"agreement {report.agreement:.2f}%, output SQNR {report.output_sqnr_db} dB",
        highlight=False,
    )
    if len(report.methods or ()) > 1:
        for row in report.methods:
            _out.print(
                f"  {row.method:<10} SQNR {row.output_sqnr_db} dB, agreement "
                f"{row.agreement:.2f}%"
                + (f", INT8 top-1 {row.int8_top1:.2f}%" if row.int8_top1 is not None else ""),
                highlight=False,
            )
    if report.kept_int16:
        _out.print(f"int16 for the budget: {', '.join(report.kept_int16)}", highlight=False)
    if report.kept_fp32:
        _out.print(f"kept FP32 for the budget: {', '.join(report.kept_fp32)}", highlight=False)
    if report.kept_int8:
        _out.print(f"8-bit for the budget: {', '.join(report.kept_int8)}", highlight=False)
    if report.plan:  # what `build` takes to run the same
        plan = " ".join(f"--layer-modes '{entry}'" for entry in report.plan)
        _out.print(f"plan: {plan}", highlight=False, soft_wrap=True)
    Console(width=max(_out.width, 140)).print(_evaluation_table(report))


# The service (the `api` package); imported inside the commands so the others stay fast.

Db = Annotated[
    str | None,
    typer.Option(
        "--db",
        envvar="RANGEPROF_DB",
        help="Database URL (sqlite:///FILE or postgresql://USER@HOST/DB); default: SQLite in "
        "the user's data folder.",
    ),
]
Storage = Annotated[
    str | None,
    typer.Option(
        envvar="RANGEPROF_STORAGE",
        help="Folder for uploaded files; default: FILE-blobs next to an SQLite FILE.",
    ),
]
Jobs = Annotated[int, typer.Option(min=0, help="Runs executed at a time.")]

db_app = typer.Typer(help="The service's database.", no_args_is_help=True)
token_app = typer.Typer(help="API tokens.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(token_app, name="token")


@app.command()
def serve(
    db: Db = None,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    storage: Storage = None,
    jobs: Annotated[
        int, typer.Option(min=0, help="Runs executed at a time in this process (0: none).")
    ] = 1,
    max_model_mb: Annotated[float, typer.Option(help="Largest model upload.")] = 1024,
    max_data_mb: Annotated[float, typer.Option(help="Largest .npz upload.")] = 1024,
    max_job_minutes: Annotated[
        float, typer.Option(min=0, help="Wall time of a run, evaluation or build; then it fails.")
    ] = 60,
    max_upload_mb: Annotated[
        float,
        typer.Option(
            min=1,
            help="File bytes received at once (each upload's Content-Length, else its route's "
            "limit); more are told to retry (503).",
        ),
    ] = 2048,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            help="Server processes on the one database and storage, each with its --jobs and "
            "--max-upload-mb.",
        ),
    ] = 1,
) -> None:
    """Run the REST API, with a worker for its runs unless --jobs 0."""
    _needs_service()
    import logging
    import socket

    import uvicorn

    from rangeprof.service.app import create_app, processes_app
    from rangeprof.service.limits import MB, Limits

    limits = Limits(
        int(max_model_mb * MB),
        int(max_data_mb * MB),
        max_job_seconds=60 * max_job_minutes,
        max_upload_bytes=int(max_upload_mb * MB),
    )
    options = {
        "storage": storage,
        "jobs": jobs,
        "worker_name": f"serve@{socket.gethostname()}:{port}",
        "limits": limits,
    }
    try:
        service = create_app(db, **options)  # with --workers too: a bad setting fails here
    except RangeprofError as err:
        raise _fail(err) from None
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s %(message)s")
    if workers == 1:
        uvicorn.run(service, host=host, port=port)
        return
    service.state.service.db.dispose()
    factory = processes_app(db, **options)
    uvicorn.run(factory, factory=True, workers=workers, host=host, port=port)


@app.command()
def worker(
    db: Db = None,
    storage: Storage = None,
    jobs: Jobs = 1,
    name: Annotated[
        str | None, typer.Option(help="Worker name in the run rows (default HOST:PID).")
    ] = None,
) -> None:
    """Execute queued runs (beside a server started with --jobs 0), until SIGINT or SIGTERM."""
    _needs_service()
    import logging

    from rangeprof.service.jobs import run_worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        run_worker(db, storage, jobs=jobs, name=name)
    except RangeprofError as err:
        raise _fail(err) from None


@db_app.command("upgrade")
def db_upgrade(db: Db = None) -> None:
    """Create the database, or migrate it to the current schema."""
    _needs_service()
    from rangeprof.service.db import database_url
    from rangeprof.service.migrate import upgrade

    url = database_url(db)
    try:
        revision = upgrade(url)
    except RangeprofError as err:
        raise _fail(err) from None
    _err.print(f"database at revision {revision}", highlight=False)


@token_app.command("create")
def token_create(
    name: Annotated[str, typer.Argument(help="Who or what the token is for.")],
    db: Db = None,
    expires_days: Annotated[
        float | None, typer.Option(help="Valid this many days (default: until revoked).")
    ] = None,
) -> None:
    """Create an API token and print it; it is shown only this once (only its hash is kept)."""
    _needs_service()
    from datetime import timedelta

    from rangeprof.service.auth import create_token

    expires = None if expires_days is None else timedelta(days=expires_days)
    typer.echo(_with_database(db, lambda database: create_token(database, name, expires)))


@token_app.command("list")
def token_list(db: Db = None) -> None:
    """The tokens: name, created, expires, state (valid, expired, revoked)."""
    _needs_service()
    from rangeprof.service.auth import list_tokens

    tokens = _with_database(db, list_tokens)
    table = Table(title="API tokens")
    for column in ("name", "created", "expires", "state"):
        table.add_column(column)
    for t in tokens:
        expires = "never" if t["expires_at"] is None else f"{t['expires_at']:%Y-%m-%d %H:%M}"
        table.add_row(t["name"], f"{t['created_at']:%Y-%m-%d %H:%M}", expires, t["state"])
    _out.print(table)


@token_app.command("revoke")
def token_revoke(
    name: Annotated[str, typer.Argument(help="The token's name.")], db: Db = None
) -> None:
    """Revoke a token now: the API refuses it from then on (401)."""
    _needs_service()
    from rangeprof.service.auth import revoke_token

    _with_database(db, lambda database: revoke_token(database, name))
    _err.print(f"token {name!r} revoked", highlight=False)


@app.command()
def cancel(
    kind: Annotated[str, typer.Argument(help="run | evaluation | build")],
    job_id: Annotated[int, typer.Argument(metavar="ID", help="Its id.")],
    db: Db = None,
) -> None:
    """Cancel a queued or running job of the service: it ends cancelled, its process stopped."""
    _needs_service()
    from rangeprof.service.jobs import cancel_job

    _with_database(db, lambda database: cancel_job(database, kind, job_id))
    _err.print(f"{kind} {job_id} cancelled", highlight=False)


def _with_database(db: str | None, work):
    """``work(database)`` on the migrated database; its errors are one line, exit 2."""
    from rangeprof.service.migrate import open_database

    try:
        database = open_database(db)
    except RangeprofError as err:
        raise _fail(err) from None
    try:
        return work(database)
    except RangeprofError as err:
        raise _fail(err) from None
    finally:
        database.dispose()
