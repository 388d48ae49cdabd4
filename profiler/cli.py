"""The ``rangeprof`` command line.

User errors (:class:`~profiler.errors.RangeprofError`) print one line on stderr and exit with
code 2; the JSON printed by ``--json`` goes to stdout alone so it can be piped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from .errors import RangeprofError

app = typer.Typer(
    help="Tensor-range profiling with IR tracking for INT8 quantization on Apache TVM.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
_err = Console(stderr=True)

InputShapes = Annotated[
    list[str] | None,
    typer.Option(
        "--input-shape",
        help="Static shape of an input, NAME=DIMS (e.g. x=1x3x48x192); repeatable.",
    ),
]


def _fail(err: RangeprofError) -> typer.Exit:
    _err.print(f"error: {err}", markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(code=2)


def _shapes(values: list[str] | None) -> dict[str, tuple[int, ...]]:
    from .onnx_load import parse_input_shape

    return dict(parse_input_shape(v) for v in values or [])


@app.callback()
def _main() -> None:
    """rangeprof: profile FP32 tensor ranges by profileID, then quantize from the profile."""


@app.command()
def inspect(
    model: Annotated[Path, typer.Argument(help="ONNX model file.")],
    input_shape: InputShapes = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Show the model's layers with their profileIDs and the lineage after every stage."""
    from .tracking import track_model

    try:
        with _err.status("importing and tracking stages...", spinner="dots"):
            tracked = track_model(model, _shapes(input_shape))
    except RangeprofError as err:
        raise _fail(err) from None
    doc = tracked.to_json()
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
