"""A profile (and optionally an evaluation) as one self-contained, static HTML page.

``rangeprof report PROFILE.json [--evaluation E.json] [--target T] --out report.html`` writes
what :func:`render_report` returns: a header with the model and run, a per-layer table of ranges
and of the scale each calibration method (:mod:`rangeprof.profiler.calibrate.methods`) gives on
the grid the target uses, an inline SVG histogram per tensor that has one with each method's
clip range drawn on it, and, given the JSON of ``rangeprof evaluate --json``, the per-layer
quantization error.

**The target's scales.** Activations are calibrated with the options of the target's policy
(``rangeprof.byoc.plugin.get_plugin(target).policy.calibration(method, percentile)``: every
target has asymmetric uint8 activations), passed in by the caller, as this package does not
know the targets; weights (and other static tensors) take the policy's weight grid
(``.weight_calibration()``: symmetric int8 per output channel from each channel's max),
whatever the method: one scale range per weight. A build quantizes the weights after batch
norms fold into them, so a weight's scale here is that of the profiled initializer.

The page is **self-contained**: inline CSS and inline SVG only, no script, no server, no
network, no fonts or stylesheets from a CDN. A report is an artifact to attach to a ticket, mail,
or archive next to a model, and it must open the same way offline, on an air-gapped machine, or
years later. For the same reason the output is deterministic: the same documents give the same
bytes (no timestamps, fixed number formatting, tensors in profile order), so reports can be diffed
and cached.

All text from the documents (profileIDs hold ``/``, ``#``, ``:``; node names may hold ``<``) is
HTML-escaped. The calibration data is named by its file name (and keys), not the path it had on
the machine that profiled. A report of a large model stays small (ppocr_cls, 663 tensors: under
1 MB): histograms are drawn with at most :data:`MAX_BARS` bars (adjacent bins summed), bar heights
``log10(count + 1)`` on :data:`LEVELS` integer levels, one run-length path per histogram in bar
units, integer coordinates, colours from the stylesheet; the full histograms stay in the
profile JSON.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace
from html import escape
from pathlib import PureWindowsPath

import numpy as np

from rangeprof.profiler.calibrate.methods import METHODS, CalibrationOptions, is_static, qparams_for
from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.profiling.statistics import TensorStats

__all__ = ["render_report"]

MAX_BARS = 128
LEVELS = 100  # bar heights are whole hundredths of the tallest
PERCENTILE = 99.99
TARGET = "x86"
# The x86 policy's grids (get_plugin("x86").policy.calibration() and .weight_calibration()),
# when the caller gives none.
X86_ACTIVATIONS = CalibrationOptions(scheme="asym", dtype="uint8", granularity="per-channel")
X86_WEIGHTS = CalibrationOptions(scheme="sym", dtype="int8", granularity="per-channel")
DASH = "\u2014"  # shown where a value is missing or a method does not apply

# One colour and dash pattern per method (the stylesheet's ``m-<method>``), so that coinciding
# clip lines stay distinguishable.
_STYLE = {
    "max": ("#d62728", "none"),
    "percentile": ("#1f77b4", "6 3"),
    "entropy": ("#2ca02c", "2 2"),
    "mse": ("#9467bd", "8 3 2 3"),
}
_LABEL = {
    "max": "max",
    "percentile": f"percentile {PERCENTILE:g}",
    "entropy": "entropy",
    "mse": "mse",
}
# The legend's underline for each dash pattern.
_BORDER = {"none": "solid", "6 3": "dashed", "2 2": "dotted", "8 3 2 3": "dashed"}

# SVG geometry (user units).
_W, _H = 640, 182
_PLOT_X0, _PLOT_X1 = 56, 610
_PLOT_Y0, _PLOT_Y1 = 12, 160  # top, baseline

_CSS = (
    """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.5em;margin:0 0 .3em}h2{font-size:1.2em;margin:1.6em 0 .5em}
dl.meta{display:grid;grid-template-columns:max-content auto;gap:.1em 1em;margin:.5em 0}
dl.meta dt{color:#555}dl.meta dd{margin:0;font-family:ui-monospace,monospace}
.scroll{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;font-size:12.5px}
th,td{border:1px solid #ddd;padding:2px 6px;text-align:right;white-space:nowrap}
thead th{background:#f3f3f3;position:sticky;top:0}
td.t,th.t,#tensors td:is(:nth-child(3),:nth-child(4),:nth-child(5),:nth-child(7)){text-align:left}
td.pid{text-align:left;font-family:ui-monospace,monospace}
td.na{color:#999;text-align:center}td.fb{color:#a60}td.w{text-align:center}
td.bad{background:#fdd}td.warn{background:#fec}td.exact{color:#070}
tr.weight td{color:#445}
figure{margin:1em 0;border-top:1px solid #eee;padding-top:.4em}
figcaption{font-family:ui-monospace,monospace;font-size:12.5px}
svg{display:block;width:"""
    + str(_W)
    + """px;max-width:100%;height:auto}
svg text{font:11px ui-monospace,monospace;fill:#333}
text.s{text-anchor:start}text.m{text-anchor:middle}text.e{text-anchor:end}
p.legend span{font-family:ui-monospace,monospace;margin-right:1.5em;padding-bottom:2px}
.bars{fill:#9bb7d4;stroke:none}.axis{stroke:#444;stroke-width:1;fill:none}
.zero{stroke:#aaa;stroke-dasharray:1 3}.clip{stroke-width:1.6;fill:none}
p.note{color:#555;font-size:12.5px;max-width:75em}
"""
    + "".join(
        f".clip.m-{m}{{stroke:{colour};stroke-dasharray:{dash}}}"
        f"p.legend .m-{m}{{color:{colour};border-bottom:2px {_BORDER[dash]} {colour}}}"
        for m, (colour, dash) in _STYLE.items()
    )
    + "\n"
)


def render_report(
    profile: dict,
    evaluation: dict | None = None,
    *,
    target: str = TARGET,
    activations: CalibrationOptions | None = None,
    weights: CalibrationOptions | None = None,
) -> str:
    """The HTML report of a profile document, as one self-contained page.

    ``profile`` is a profile document (``rangeprof profile``'s JSON); ``evaluation``, if given,
    the object ``rangeprof evaluate --json`` prints. Scales are those ``target`` uses, from its
    policy's options, required for a target other than x86: ``activations``
    (``get_plugin(target).policy.calibration()``; the scheme, dtype and power-of-two rounding
    are read), one per-tensor scale per calibration method (percentile at 99.99), and
    ``weights`` (``.weight_calibration()``), the same for every method. A method that does not
    apply to a tensor (no histogram: profiled with ``--bins 0``) shows an em dash.
    Deterministic: equal documents give equal strings.
    """
    if activations is None or weights is None:
        if target != TARGET:
            raise ValueError(f"the calibration options of target {target!r} are needed")
        activations = activations or X86_ACTIVATIONS
        weights = weights or X86_WEIGHTS
    tensors = list(profile.get("tensors") or [])
    rows = [_Row(i, entry, activations, weights) for i, entry in enumerate(tensors)]
    errors = _ranked_layers(evaluation) if evaluation is not None else None
    by_id: dict[str, dict] = {}
    for layer in errors or ():
        by_id.setdefault(layer.get("profile_id"), layer)

    model = profile.get("model") or {}
    title = f"rangeprof report: {model.get('name', '?')}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        '<meta name="generator" content="rangeprof report">',
        f"<title>{_e(title)}</title>",
        f"<style>{_CSS}</style>",
        "</head>",
        "<body>",
        _header(profile, rows, _grid_text(target, activations, weights)),
    ]
    if evaluation is not None:
        rows_by_id = {r.pid: r.index for r in reversed(rows)}  # the first row of a profileID
        parts.append(_evaluation_section(evaluation, errors, rows_by_id))
    parts.append(
        _tensor_table(rows, by_id if evaluation is not None else None, activations, weights)
    )
    parts.append(_histogram_section(rows))
    parts += ["</body>", "</html>", ""]
    return "\n".join(parts)


def _grid_text(target: str, activations: CalibrationOptions, weights: CalibrationOptions) -> str:
    """What the scales are for: the target, its activation and weight grids."""
    rounding = ", power-of-two scales" if activations.power_of_two else ""
    per = weights.granularity.replace("-", " ")
    return (
        f"{target}: activations {activations.scheme} {activations.dtype} per tensor{rounding}; "
        f"weights {weights.scheme} {weights.dtype} {per} (max)"
    )


class _Row:
    """One tensor entry with its statistics and its quantization parameters: a weight's on the
    weight grid, an activation's for each method on the target's activation grid."""

    def __init__(
        self, index: int, entry: dict, activations: CalibrationOptions, weights: CalibrationOptions
    ):
        self.index = index
        self.entry = entry
        self.pid = str(entry.get("profile_id"))
        self.stats = TensorStats.from_json(entry)
        self.weight = is_static(entry)
        self.qparams: dict[str, dict | None] = {}
        if self.weight:
            self.qparams["max"] = qparams_for(entry, replace(weights, method="max")).to_json()
            return
        for method in METHODS:
            options = replace(
                activations, method=method, percentile=PERCENTILE, granularity="per-tensor"
            )
            try:
                self.qparams[method] = qparams_for(entry, options).to_json()
            except RangeprofError:
                self.qparams[method] = None

    @property
    def anchor(self) -> str:
        return f"hist-{self.index}"

    @property
    def has_histogram(self) -> bool:
        h = self.stats.histogram
        return h is not None and len(h.counts) > 0 and int(h.counts.sum()) > 0

    def clip_ranges(self) -> dict[str, tuple[float, float]]:
        """Each method's clip range (a weight's: the widest of its channels)."""
        ranges = {}
        for method, q in self.qparams.items():
            if q is not None:
                lo, hi = q["range"]
                if q["axis"] is not None:
                    lo, hi = min(lo), max(hi)
                ranges[method] = (float(lo), float(hi))
        return ranges


# --- formatting -------------------------------------------------------------------------------


def _e(value: object) -> str:
    """HTML-escaped text (quotes too: the same helper serves attribute values)."""
    return escape(str(value), quote=True)


def _num(value: object, digits: int = 6) -> str:
    if value is None:
        return DASH
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"{value:.{digits}g}"
    return str(value)


def _db(value: float | None) -> str:
    return "exact" if value is None else f"{value:.2f}"


def _db_class(value: float | None) -> str:
    if value is None:
        return "exact"
    return "bad" if value < 20 else "warn" if value < 30 else ""


def _td(text: str, cls: str = "", title: str = "") -> str:
    attrs = (f' class="{cls}"' if cls else "") + (f' title="{_e(title)}"' if title else "")
    return f"<td{attrs}>{_e(text)}</td>"


def _shape(shape: object) -> str:
    if shape is None:
        return DASH
    if isinstance(shape, list | tuple):
        return "\u00d7".join(str(d) for d in shape) if shape else "scalar"
    return str(shape)


def _flatten(prefix: str, value: object) -> Iterable[tuple[str, str]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flatten(f"{prefix}.{key}" if prefix else str(key), item)
    elif isinstance(value, list | tuple):
        yield prefix, ", ".join(_num(v) for v in value) if value else DASH
    else:
        yield prefix, _num(value)


# --- header -----------------------------------------------------------------------------------


def _data_name(spec: object) -> str:
    """A ``--data`` spec by its file name: ``FILE.npz:KEY`` → ``name.npz:KEY``, a folder or
    ``.npy`` by its last component (either separator); ``random`` and in-memory arrays as they
    are."""
    text = str(spec)
    head, sep, keys = text.rpartition(":")
    if sep and head.lower().endswith(".npz"):
        return f"{PureWindowsPath(head).name}:{keys}"
    return PureWindowsPath(text).name or text


def _header(profile: dict, rows: list[_Row], grid: str) -> str:
    model = profile.get("model") or {}
    run = profile.get("run") or {}
    options = run.get("options") or {}
    sha = str(model.get("sha256") or "")
    with_hist = sum(r.has_histogram for r in rows)
    items = [
        ("model", str(model.get("name", DASH))),
        ("sha256", sha[:12] or DASH),
        ("scales for", grid),
        ("tensors", f"{len(rows)} ({with_hist} with a histogram)"),
        ("samples", _num(run.get("samples"))),
        ("data", _data_name(run["data"]) if run.get("data") else DASH),
        ("bins", _num(options.get("bins"))),
        ("TVM", str(run.get("tvm_version") or DASH)),
    ]
    if "opset" in model:
        items.append(("opset", _num(model["opset"])))
    for name, shape in (model.get("inputs") or {}).items():
        items.append((f"input {name}", _shape(shape)))
    skip = {"samples", "data", "tvm_version", "options.bins"}
    items += [(f"run.{k}", v) for k, v in _flatten("", run) if k not in skip]
    meta = "".join(
        f'<dt>{_e(k)}</dt><dd title="{_e(sha)}">{_e(v)}</dd>'
        if k == "sha256"
        else f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>"
        for k, v in items
    )
    return (
        f"<header>\n<h1>{_e(model.get('name', 'profile'))}</h1>\n"
        '<p class="note">rangeprof tensor-range profile, schema '
        f"{_e(profile.get('schema_version', '?'))}</p>\n"
        f'<dl class="meta">{meta}</dl>\n</header>'
    )


# --- per-layer table --------------------------------------------------------------------------


def _tensor_table(
    rows: list[_Row],
    by_id: dict[str, dict] | None,
    activations: CalibrationOptions,
    weights: CalibrationOptions,
) -> str:
    head = ["#", "profileID", "kind", "op", "source node", "shape", "dtype"]
    head += ["min", "max", "mean", "std"]
    head += [f"scale {_LABEL[m]}" for m in METHODS]
    if by_id is not None:
        head += ["isolated dB", "accumulated dB"]
    left = {"profileID", "kind", "op", "source node", "dtype"}
    cells = "".join(
        f'<th class="t">{_e(h)}</th>' if h in left else f"<th>{_e(h)}</th>" for h in head
    )
    body = [_tensor_row(r, by_id) for r in rows]
    grid = f"{activations.scheme} {activations.dtype}"
    formula = "s = (hi \u2212 lo) / 255" if activations.scheme == "asym" else "s = \u03b1 / 127"
    return (
        '<section id="layers">\n<h2>Per-layer ranges and scales</h2>\n'
        f'<p class="note">Activations: {_e(grid)}, per tensor (<code>{_e(formula)}</code> for '
        "8 bits), one scale per method, as <code>rangeprof calibrate</code> computes them with "
        "the target's options; hover a scale for its clip range and zero point. Weights: "
        f"{_e(weights.scheme)} {_e(weights.dtype)} {_e(weights.granularity)} from the max "
        "(per channel: the smallest and largest channel scale), as the build quantizes them "
        "once batch norms are folded in. "
        f"{_e(DASH)}: the method needs a histogram (profiled with <code>--bins 0</code>). "
        "Orange: the method fell back to another one (hover for why).</p>\n"
        '<div class="scroll">\n<table id="tensors">\n'
        f"<thead><tr>{cells}</tr></thead>\n<tbody>\n" + "\n".join(body) + "\n</tbody>\n</table>\n"
        "</div>\n</section>"
    )


def _range_text(q: dict) -> str:
    lo, hi = q["range"]
    return f"[{_num(lo, 5)}, {_num(hi, 5)}] z {q['zero_point']}"


def _weight_cell(q: dict) -> str:
    """A weight's scales across the four method columns: they do not depend on the method."""
    if q["axis"] is None:
        text, title = _num(q["scale"], 5), f"per tensor: {_range_text(q)}"
    else:
        scales = q["scale"]
        text = f"{_num(min(scales), 5)} \u2013 {_num(max(scales), 5)}"
        title = f"{len(scales)} channels (axis {q['axis']}), max |w| {_num(max(q['range'][1]))}"
    return f'<td colspan="{len(METHODS)}" class="w" title="{_e(title)}">{_e(text)}</td>'


def _tensor_row(row: _Row, by_id: dict[str, dict] | None) -> str:
    e = row.entry
    node = e.get("source_node")
    op = e.get("op") or e.get("source_op")
    if row.has_histogram:
        pid = f'<td class="pid"><a href="#{row.anchor}">{_e(row.pid)}</a></td>'
    else:
        pid = f'<td class="pid">{_e(row.pid)}</td>'
    cells = [
        _td(str(row.index)),
        pid,
        _td(str(e.get("kind", DASH))),  # text columns: left-aligned by the stylesheet
        _td(str(op) if op else DASH),
        _td(str(node) if node else DASH),
        _td(_shape(e.get("shape"))),
        _td(str(e.get("dtype", DASH))),
        _td(_num(e.get("min"))),
        _td(_num(e.get("max"))),
        _td(_num(e.get("mean"))),
        _td(_num(e.get("std"))),
    ]
    if row.weight:
        cells.append(_weight_cell(row.qparams["max"]))
    for method in () if row.weight else METHODS:
        q = row.qparams[method]
        if q is None:
            cells.append(_td(DASH, "na", f"{method}: needs a histogram"))
            continue
        title = f"{q['method']}: {_range_text(q)}"
        if q.get("note"):
            title += f"; {q['note']}"
        fell_back = q["method"] != method
        cells.append(_td(_num(q["scale"], 5), "fb" if fell_back else "", title))
    if by_id is not None:
        layer = by_id.get(row.pid)
        if layer is None:
            cells += [_td(DASH, "na"), _td(DASH, "na")]
        else:
            for key in ("isolated_sqnr_db", "accumulated_sqnr_db"):
                cells.append(_td(_db(layer.get(key)), _db_class(layer.get(key))))
    cls = ' class="weight"' if row.weight else ""
    return f'<tr id="row-{row.index}"{cls}>' + "".join(cells) + "</tr>"


# --- evaluation -------------------------------------------------------------------------------


def _sqnr_key(value: object) -> float:
    return math.inf if value is None else float(value)


def _ranked_layers(evaluation: dict) -> list[dict]:
    """Worst isolated SQNR first (``None``: exact, last), then worst accumulated SQNR."""
    layers = list(evaluation.get("layers") or [])
    return sorted(
        layers,
        key=lambda d: (
            _sqnr_key(d.get("isolated_sqnr_db")),
            _sqnr_key(d.get("accumulated_sqnr_db")),
        ),
    )


def _evaluation_section(evaluation: dict, layers: list[dict], rows: dict[str, int]) -> str:
    ev = evaluation
    summary = [
        f"target {ev.get('target', '?')}",
        f"method {ev.get('method', '?')}",
    ]
    if "weight_bits" in ev:
        bits = ev["weight_bits"]
        summary.append(f"{bits}-bit weights" if bits else "7- or 8-bit weights per layer")
    if "samples" in ev:
        summary.append(f"{ev['samples']} samples")
    summary.append(f"output SQNR {_db(ev.get('output_sqnr_db'))} dB")
    if ev.get("agreement") is not None:
        summary.append(f"agreement {ev['agreement']:.2f}%")
    if ev.get("fp32_top1") is not None and ev.get("int8_top1") is not None:
        summary.append(f"top-1 FP32 {ev['fp32_top1']:.2f}% / INT8 {ev['int8_top1']:.2f}%")
    if ev.get("kept_int8"):
        summary.append("8-bit: " + ", ".join(str(k) for k in ev["kept_int8"]))
    if ev.get("kept_int16"):
        summary.append("int16: " + ", ".join(str(k) for k in ev["kept_int16"]))
    kept = ev.get("kept_fp32") or []
    summary.append("kept FP32: " + (", ".join(str(k) for k in kept) if kept else "none"))
    if ev.get("plan"):
        summary.append("plan (layer_modes): " + " ".join(str(k) for k in ev["plan"]))
    out = [
        '<section id="evaluation">\n<h2>FP32 vs INT8 evaluation</h2>',
        f'<p id="evaluation-summary">{_e("; ".join(summary))}</p>',
    ]
    methods = ev.get("methods") or []
    if len(methods) > 1:
        rows = "".join(
            "<tr>"
            + _td(str(m.get("method")), "t")
            + _td(_db(m.get("output_sqnr_db")))
            + _td(_num(m.get("agreement")))
            + _td(_num(m.get("int8_top1")))
            + "</tr>"
            for m in methods
        )
        out.append(
            '<table id="methods"><thead><tr><th class="t">method</th><th>output dB</th>'
            f"<th>agreement %</th><th>INT8 top-1 %</th></tr></thead><tbody>{rows}</tbody></table>"
        )
    body = []
    for rank, layer in enumerate(layers, start=1):
        pid = str(layer.get("profile_id"))
        iso, acc = layer.get("isolated_sqnr_db"), layer.get("accumulated_sqnr_db")
        if pid in rows:
            pid_cell = f'<td class="pid"><a href="#row-{rows[pid]}">{_e(pid)}</a></td>'
        else:
            pid_cell = f'<td class="pid">{_e(pid)}</td>'
        body.append(
            "<tr>"
            + _td(str(rank))
            + pid_cell
            + _td(
                str(layer.get("pattern", DASH)).split(".", 1)[-1], "t", str(layer.get("region", ""))
            )
            + _td(str(layer.get("mode", DASH)), "t")
            + _td(_db(iso), _db_class(iso))
            + _td(_db(acc), _db_class(acc))
            + _td(_num(layer.get("isolated_rmse_per_scale"), 4))
            + _td(_num(layer.get("accumulated_rmse_per_scale"), 4))
            + "</tr>"
        )
    out.append(
        '<p class="note">Per layer, worst isolated SQNR first. Isolated: the layer alone in INT8 '
        "on FP32 inputs; accumulated: with every earlier layer in INT8 too. RMSE in units of the "
        "output scale. <q>exact</q>: no error.</p>"
    )
    out.append(
        '<div class="scroll">\n<table id="errors">\n<thead><tr><th>rank</th>'
        '<th class="t">profileID</th><th class="t">pattern</th><th class="t">mode</th>'
        "<th>isolated dB</th><th>accumulated dB</th><th>isolated rmse/scale</th>"
        "<th>accumulated rmse/scale</th></tr></thead>\n<tbody>\n"
        + "\n".join(body)
        + "\n</tbody>\n</table>\n</div>\n</section>"
    )
    return "\n".join(out)


# --- histograms -------------------------------------------------------------------------------


def _histogram_section(rows: list[_Row]) -> str:
    drawn = [r for r in rows if r.has_histogram]
    out = ['<section id="histograms">\n<h2>Histograms</h2>']
    if not drawn:
        out.append('<p class="note">No histograms: the profile was made with --bins 0.</p>')
    else:
        out.append(
            '<p class="note">Bar height is log10(count + 1) (a logarithmic count axis that keeps '
            f"empty bins at zero), to the nearest 1/{LEVELS} of the tallest; at most {MAX_BARS} "
            "bars, adjacent bins summed (the profile JSON holds every bin). Vertical lines: each "
            "method's clip range on the target's grid, its lower end where the tensor has "
            "negative values; a weight's widest channel range. Each figure's caption leads to "
            "its row of the table, whose scales give each range and zero point.</p>\n"
            '<p class="legend">'
            + " ".join(f'<span class="m-{m}">{_e(_LABEL[m])}</span>' for m in METHODS)
            + "</p>"
        )
        out += [_figure(r) for r in drawn]
    out.append("</section>")
    return "\n".join(out)


def _downsample(counts: np.ndarray) -> tuple[np.ndarray, int]:
    """At most :data:`MAX_BARS` bars: groups of ``k`` adjacent bins summed (the last one may
    hold fewer); returns the bars and ``k``."""
    n = len(counts)
    k = max(1, -(-n // MAX_BARS))
    if k == 1:
        return counts, 1
    groups = -(-n // k)
    padded = np.zeros(groups * k, dtype=np.int64)
    padded[:n] = counts
    return padded.reshape(groups, k).sum(axis=1), k


def _i(value: float) -> str:
    """An SVG coordinate, to the nearest unit (of a figure 640 wide)."""
    return str(round(value))


def _g(value: float, digits: int = 4) -> str:
    """A compact number for a path or transform: no exponent, no trailing zeros."""
    text = f"{value:.{digits}f}".rstrip("0").rstrip(".")
    return "0" if text in ("", "-0") else text


def _bars_path(levels: np.ndarray, last: float) -> str:
    """The bars as one filled step outline in bar units (``x``: bar index, ``y``: level), one
    ``V``/``h`` pair per run of equal levels; the last bar is ``last`` wide."""
    d = ["M0 0"]
    values = levels.tolist()
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[i]:
            j += 1
        width = (j - i) + (last if j == len(values) - 1 else 1)
        d.append(f"V{values[i]}h{_g(width)}")
        i = j + 1
    d.append("V0Z")
    return "".join(d)


def _figure(row: _Row) -> str:
    hist = row.stats.histogram
    bars, k = _downsample(hist.counts)
    width = math.ldexp(k, hist.exponent)  # of a bar, in data units
    lo_data = math.ldexp(hist.offset, hist.exponent)
    hi_data = math.ldexp(hist.offset + len(hist.counts), hist.exponent)
    signed = row.stats.min is not None and row.stats.min < 0

    # Each method's clip lines: the range's upper end, and its lower end if signed.
    ranges = row.clip_ranges()
    lines = [(m, v) for m, (lo, hi) in ranges.items() for v in ((lo, hi) if signed else (hi,))]
    x_lo = min([lo_data, *(v for _, v in lines)])
    x_hi = max([hi_data, *(v for _, v in lines)])
    if not x_hi > x_lo:
        x_lo, x_hi = x_lo - 0.5, x_hi + 0.5
    # A margin, so that lines at the ends stay clear of the axis.
    ends = x_lo, x_hi  # labelled
    pad = (x_hi - x_lo) * 0.02
    x_lo, x_hi = x_lo - pad, x_hi + pad
    per_unit = (_PLOT_X1 - _PLOT_X0) / (x_hi - x_lo)

    def x(v: float) -> float:
        return _PLOT_X0 + (v - x_lo) * per_unit

    heights = np.log10(bars.astype(np.float64) + 1.0)
    levels = np.rint(heights / (float(heights.max()) or 1.0) * LEVELS).astype(np.int64)
    last = (len(hist.counts) - (len(bars) - 1) * k) / k
    # Bar units to the plot: x from the first edge, one bar ``width`` each; y up from the base.
    transform = (
        f"matrix({_g(width * per_unit)} 0 0 {_g(-(_PLOT_Y1 - _PLOT_Y0) / LEVELS)} "
        f"{_g(x(lo_data), 2)} {_PLOT_Y1})"
    )
    svg = [
        f'<svg viewBox="0 0 {_W} {_H}" role="img" aria-label="{_e("histogram of " + row.pid)}">',
        f'<path class="bars" transform="{transform}" d="{_bars_path(levels, last)}"/>',
        f'<path class="axis" d="M{_PLOT_X0} {_PLOT_Y0}V{_PLOT_Y1}H{_PLOT_X1}"/>',
    ]
    span = f"{_PLOT_Y0}v{_PLOT_Y1 - _PLOT_Y0}"
    if x_lo < 0 < x_hi:
        svg.append(f'<path class="zero" d="M{_i(x(0.0))} {span}"/>')
    for method in ranges:
        d = "".join(f"M{_i(x(v))} {span}" for m, v in lines if m == method)
        svg.append(f'<path class="clip m-{method}" d="{d}"/>')
    # Axis labels: x at both ends of what is drawn (and 0), y the top's count.
    ty = _PLOT_Y1 + 14
    for v, anchor in zip(ends, ("s", "e"), strict=True):
        svg.append(f'<text class="{anchor}" x="{_i(x(v))}" y="{ty}">{_e(_num(v, 4))}</text>')
    if x_lo < 0 < x_hi and min(x(0.0) - _PLOT_X0, _PLOT_X1 - x(0.0)) > 40:
        svg.append(f'<text class="m" x="{_i(x(0.0))}" y="{ty}">0</text>')
    peak = _e(_num(int(bars.max())))
    svg.append(f'<text class="e" x="{_PLOT_X0 - 4}" y="{_PLOT_Y0 + 4}">{peak}</text>')
    svg.append("</svg>")

    e = row.entry
    caption = (
        f"{row.pid} \u00b7 {e.get('kind', '?')} \u00b7 {e.get('op') or e.get('source_op') or '?'}"
        f" \u00b7 min {_num(row.stats.min)} \u00b7 max {_num(row.stats.max)}"
    )
    return (
        f'<figure id="{row.anchor}">\n<figcaption><a href="#row-{row.index}">{_e(caption)}</a>'
        "</figcaption>\n" + "\n".join(svg) + "\n</figure>"
    )
