"""The static HTML report (``rangeprof.profiler.export.report``) on real profiles of digits_cnn
and a real ``rangeprof evaluate --json``: scales on the target's grid, the data by its file name,
and ppocr_cls's report under 1 MB. The default run has the smoke test of ``rangeprof report``;
the rest is the zoo step's."""

from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import replace
from html.parser import HTMLParser

import pytest
from typer.testing import CliRunner

from rangeprof.byoc.plugin import TARGETS, get_plugin
from rangeprof.cli import app
from rangeprof.profiler.calibrate.methods import METHODS, CalibrationOptions, qparams_for
from rangeprof.profiler.export.report import MAX_BARS, X86_ACTIVATIONS, X86_WEIGHTS, render_report
from rangeprof.profiler.profiling.run import ProfileOptions, profile_model

from conftest import SHARED, zoo_model

DASH = "\u2014"
VOID = {"meta", "br", "hr", "img", "input", "link", "col", "wbr", "source", "area", "base"}


class Page(HTMLParser):
    """Checks tag nesting and collects the tables' cells and the SVGs' elements."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.opened: dict[str, int] = {}
        self.closed: dict[str, int] = {}
        self.tables: dict[str, list[list[dict]]] = {}  # table id -> rows -> cells
        self.svgs: list[dict] = []  # {"label", "lines": [(method, x)], "bars": d}
        self._table: list[list[dict]] | None = None
        self._cell: dict | None = None
        self.feed(text)
        self.close()
        if self.stack:
            self.errors.append(f"never closed: {self.stack}")

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.opened[tag] = self.opened.get(tag, 0) + 1
        if tag not in VOID:
            self.stack.append(tag)
        if tag == "table":
            self._table = self.tables.setdefault(a.get("id", f"anon{len(self.tables)}"), [])
        elif tag == "tr" and self._table is not None:
            self._table.append([])
        elif tag in ("td", "th") and self._table is not None:
            self._cell = {
                "tag": tag,
                "class": a.get("class", ""),
                "title": a.get("title"),
                "text": "",
            }
            self._table[-1].append(self._cell)
        elif tag == "svg":
            self.svgs.append({"label": a.get("aria-label"), "lines": [], "bars": None})

    def handle_startendtag(self, tag, attrs):  # <path .../>: no content, nothing to close
        a = dict(attrs)
        if self.svgs and "svg" in self.stack and tag == "path":
            classes = a.get("class", "").split()
            if "clip" in classes:
                (method,) = [c[2:] for c in classes if c.startswith("m-")]
                xs = re.findall(r"M(-?\d+) ", a["d"])
                self.svgs[-1]["lines"] += [(method, int(x)) for x in xs]
            elif classes == ["bars"]:
                self.svgs[-1]["bars"] = a["d"]

    def handle_endtag(self, tag):
        self.closed[tag] = self.closed.get(tag, 0) + 1
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
            return
        self.stack.pop()
        if tag == "table":
            self._table = None
        elif tag in ("td", "th"):
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell["text"] += data

    def body_rows(self, table: str) -> list[list[dict]]:
        return [row for row in self.tables[table] if row and row[0]["tag"] == "td"]

    def header(self, table: str) -> list[str]:
        return [c["text"] for c in self.tables[table][0]]


def _hostile_free(text: str) -> None:
    for needle in ("http://", "https://", "<link", 'src="http', "@import", "url("):
        assert needle not in text, needle


@pytest.fixture(scope="module")
def model():
    return zoo_model("digits_cnn")


@pytest.fixture(scope="module")
def profile(model):
    doc = profile_model(model, "random", options=ProfileOptions(samples=8))
    return json.loads(json.dumps(doc))  # what a report reads from PROFILE.json


@pytest.fixture(scope="module")
def evaluation(model, profile, tmp_path_factory):
    profile_path = tmp_path_factory.mktemp("report") / "profile.json"
    profile_path.write_text(json.dumps(profile))
    data = SHARED / "data" / "digits.npz"
    args = ["evaluate", str(model), "--profile", str(profile_path), "--data", f"{data}:test"]
    args += ["--labels", f"{data}:test_labels", "--samples", "32", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def report(profile, evaluation):
    return render_report(profile, evaluation)


@pytest.fixture(scope="module")
def page(report):
    return Page(report)


def test_the_report_command_on_a_small_profile(tmp_path):
    """``rangeprof report`` on a profile of 16 samples (the default run's smoke test): a
    well-formed offline page with one row per tensor, in profile order, and the run's facts."""
    data = SHARED / "data" / "digits.npz"
    profile_path, html = tmp_path / "profile.json", tmp_path / "report.html"
    runner = CliRunner()
    model = str(zoo_model("digits_cnn"))
    args = ["profile", model, "--data", f"{data}:calib", "--samples", "16", "--out", profile_path]
    profiled = runner.invoke(app, [str(a) for a in args])
    assert profiled.exit_code == 0, profiled.output
    reported = runner.invoke(app, ["report", str(profile_path), "--out", str(html)])
    assert reported.exit_code == 0, reported.output
    text, profile = html.read_text(), json.loads(profile_path.read_text())
    page = Page(text)
    assert text.startswith("<!DOCTYPE html>") and page.errors == []
    _hostile_free(text)
    pids = [c["text"] for row in page.body_rows("tensors") for c in row if c["class"] == "pid"]
    assert pids == [t["profile_id"] for t in profile["tensors"]]
    assert "<dt>samples</dt><dd>16</dd>" in text
    assert "<dt>data</dt><dd>digits.npz:calib</dd>" in text
    assert len(page.svgs) == sum(1 for t in profile["tensors"] if t.get("histogram"))


def _small(profile: dict, n: int = 4) -> dict:
    """The profile with its first ``n`` tensors only (rendering is dominated by entropy)."""
    doc = copy.deepcopy(profile)
    doc["tensors"] = doc["tensors"][:n]
    return doc


@pytest.mark.zoo
def test_well_formed_and_offline(report, page):
    assert report.startswith("<!DOCTYPE html>") and report.endswith("</html>\n")
    assert page.errors == []
    for tag in ("html", "body", "table", "tr", "td", "svg", "section", "figure"):
        assert page.opened.get(tag, 0) == page.closed.get(tag, 0), tag
    assert page.opened["table"] >= 2
    _hostile_free(report)


@pytest.mark.zoo
def test_deterministic(profile, evaluation, report):
    assert render_report(copy.deepcopy(profile), copy.deepcopy(evaluation)) == report


@pytest.mark.zoo
def test_header(profile, report):
    model, run = profile["model"], profile["run"]
    head = report[: report.index("</header>")]
    assert f"<h1>{model['name']}</h1>" in head
    assert model["sha256"][:12] in head
    assert f"<dt>tensors</dt><dd>{len(profile['tensors'])} (" in head
    assert f"<dt>samples</dt><dd>{run['samples']}</dd>" in head
    assert f"<dt>bins</dt><dd>{run['options']['bins']}</dd>" in head
    assert f"<dt>TVM</dt><dd>{run['tvm_version']}</dd>" in head
    assert "<dt>data</dt><dd>random</dd>" in head
    grid = "x86: activations asym uint8 per tensor; weights sym int8 per channel (max)"
    assert f"<dt>scales for</dt><dd>{grid}</dd>" in head


@pytest.mark.zoo
def test_the_data_is_named_by_its_file_name(profile):
    doc = _small(profile)
    doc["run"]["data"] = "/home/someone/secret place/calib.npz:calib,extra"
    head = render_report(doc).split("</header>")[0]
    assert "<dt>data</dt><dd>calib.npz:calib,extra</dd>" in head
    assert "secret place" not in head and "/home" not in head
    doc["run"]["data"] = "/data/images/"  # a folder of images
    assert "<dt>data</dt><dd>images</dd>" in render_report(doc)


@pytest.mark.zoo
def test_the_default_grid_is_the_x86_policy_and_each_target_names_its_own(profile):
    policy = get_plugin("x86").policy
    assert (policy.calibration(), policy.weight_calibration()) == (X86_ACTIVATIONS, X86_WEIGHTS)
    doc = _small(profile)
    for target in TARGETS:
        policy = get_plugin(target).policy
        activations = policy.calibration()
        weights = policy.weight_calibration()
        text = render_report(doc, target=target, activations=activations, weights=weights)
        grid = f"{target}: activations {activations.scheme} {activations.dtype} per tensor"
        assert f"<dt>scales for</dt><dd>{grid}" in text
    # A symmetric grid (a target that would have one) gives symmetric scales.
    sym = render_report(doc, activations=CalibrationOptions())
    assert sym != render_report(doc) and "activations sym int8" in sym
    with pytest.raises(ValueError, match="npu"):
        render_report(doc, target="npu")


def _scale_cells(header: list[str], row: list[dict]) -> dict[str, dict]:
    """The scale cells of a row by method; a weight's one cell spans them all."""
    first = [h.startswith("scale ") for h in header].index(True)
    if row[first]["class"] == "w":
        return {"weights": row[first]}
    return {m: row[first + i] for i, m in enumerate(METHODS)}


def _activation_options(method: str) -> CalibrationOptions:
    return replace(X86_ACTIVATIONS, method=method, percentile=99.99)


@pytest.mark.zoo
def test_layer_table_rows_and_scales(profile, page):
    tensors = profile["tensors"]
    header = page.header("tensors")
    rows = page.body_rows("tensors")
    assert len(rows) == len(tensors)
    pids = [c["text"] for row in rows for c in row if c["class"] == "pid"]
    assert pids == [t["profile_id"] for t in tensors]  # each exactly once, in profile order
    col = {name: header.index(name) for name in ("min", "max", "mean", "std", "shape")}
    weights = 0
    for row, entry in zip(rows, tensors, strict=True):
        for key in ("min", "max", "mean", "std"):
            assert float(row[col[key]]["text"]) == pytest.approx(entry[key], rel=1e-5, abs=1e-12)
        assert row[col["shape"]]["text"] == "\u00d7".join(map(str, entry["shape"]))
        cells = _scale_cells(header, row)
        if entry["kind"] == "weight" or entry["static"]:
            weights += 1
            q = qparams_for(entry, X86_WEIGHTS)
            scales = [float(v) for v in cells["weights"]["text"].split(" \u2013 ")]
            if q.axis is None:
                assert scales == [pytest.approx(q.scale, rel=1e-4)]
            else:  # the smallest and the largest channel's
                assert scales == pytest.approx([min(q.scale), max(q.scale)], rel=1e-4)
            continue
        for method in METHODS:
            cell = cells[method]
            q = qparams_for(entry, _activation_options(method))
            assert float(cell["text"]) == pytest.approx(q.scale, rel=1e-4), (entry, method)
            assert q.method in cell["title"] and f"z {q.zero_point}" in cell["title"]
    assert 0 < weights < len(tensors)


def _bar_runs(d: str) -> list[tuple[int, float]]:
    """(level, width) of each run of the bars' path."""
    return [(int(v), float(w)) for v, w in re.findall(r"V(\d+)h([\d.]+)", d)]


@pytest.mark.zoo
def test_one_histogram_per_tensor_with_method_lines(profile, report, page):
    tensors = [t for t in profile["tensors"] if t["histogram"]]
    assert tensors and len(page.svgs) == len(tensors) == report.count("<svg")
    assert "log10(count + 1)" in report
    for svg, entry in zip(page.svgs, tensors, strict=True):
        assert svg["label"] == f"histogram of {entry['profile_id']}"
        ends = 2 if entry["min"] < 0 else 1
        methods = [method for method, _ in svg["lines"]]
        if entry["kind"] == "weight" or entry["static"]:
            assert methods == ["max"] * ends  # the widest channel's range
        else:
            assert sorted(methods) == sorted(m for m in METHODS for _ in range(ends)), entry
        bins = len(entry["histogram"]["counts"])
        group = math.ceil(bins / MAX_BARS)
        runs = _bar_runs(svg["bars"])
        assert math.ceil(sum(w for _, w in runs)) == math.ceil(bins / group) <= MAX_BARS
        assert max(level for level, _ in runs) == 100 and min(level for level, _ in runs) >= 0
        # The max method's upper clip line is the rightmost line, but for the asymmetric
        # grid's zero point rounding, which moves a range by up to a step (1/255 of 554 units).
        xs = {m: max(x for method, x in svg["lines"] if method == m) for m, _ in svg["lines"]}
        assert xs["max"] >= max(xs.values()) - 3


@pytest.mark.zoo
def test_evaluation_tables(profile, evaluation, report, page):
    layers = evaluation["layers"]
    assert layers
    summary = report[report.index('<p id="evaluation-summary">') :].split("</p>", 1)[0]
    assert f"output SQNR {evaluation['output_sqnr_db']:.2f} dB" in summary
    assert f"agreement {evaluation['agreement']:.2f}%" in summary
    assert f"INT8 {evaluation['int8_top1']:.2f}%" in summary

    rows = page.body_rows("errors")
    listed = [row[1]["text"] for row in rows]
    key = [math.inf if x["isolated_sqnr_db"] is None else x["isolated_sqnr_db"] for x in layers]
    worst = layers[key.index(min(key))]["profile_id"]
    assert listed[0] == worst
    assert sorted(listed) == sorted(x["profile_id"] for x in layers)
    shown = [math.inf if r[4]["text"] == "exact" else float(r[4]["text"]) for r in rows]
    assert shown == sorted(shown)

    header = page.header("tensors")
    assert header[-2:] == ["isolated dB", "accumulated dB"]
    iso, acc = -2, -1  # from the end: a weight's scale cell spans the methods' columns
    by_id = {x["profile_id"]: x for x in layers}
    matched = 0
    for row, entry in zip(page.body_rows("tensors"), profile["tensors"], strict=True):
        layer = by_id.get(entry["profile_id"])
        if layer is None:
            assert row[iso]["text"] == row[acc]["text"] == DASH
        else:
            matched += 1
            assert row[iso]["text"] == f"{layer['isolated_sqnr_db']:.2f}"
            assert row[acc]["text"] == f"{layer['accumulated_sqnr_db']:.2f}"
    assert matched == len(layers)


@pytest.mark.zoo
def test_exact_layers_rank_last_and_no_evaluation_no_columns(profile, evaluation):
    ev = copy.deepcopy(evaluation)
    ev["layers"].reverse()
    exact = min(ev["layers"], key=lambda x: x["isolated_sqnr_db"])
    exact["isolated_sqnr_db"] = exact["accumulated_sqnr_db"] = None
    small = _small(profile)
    page = Page(render_report(small, ev))
    rows = page.body_rows("errors")
    assert rows[-1][1]["text"] == exact["profile_id"] and rows[-1][4]["text"] == "exact"
    values = [float(r[4]["text"]) for r in rows[:-1]]
    assert values == sorted(values)

    plain = render_report(small)
    assert "isolated dB" not in plain and 'id="errors"' not in plain
    assert Page(plain).errors == []


@pytest.mark.zoo
def test_text_is_escaped(profile):
    doc = _small(profile)
    hostile = 'a<b>&"c/#:1'
    doc["model"]["name"] = "<i>net</i>"
    doc["tensors"][0]["profile_id"] = hostile
    doc["tensors"][1]["source_node"] = "<script>alert(1)</script>"
    text = render_report(doc)
    assert "<script>" not in text and "<i>net" not in text and "<b>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "a&lt;b&gt;&amp;&quot;c/#:1" in text
    page = Page(text)
    assert page.errors == []
    pids = [c["text"] for row in page.body_rows("tensors") for c in row if c["class"] == "pid"]
    assert pids[0] == hostile and pids.count(hostile) == 1
    assert page.svgs[0]["label"] == f"histogram of {hostile}"


@pytest.mark.zoo
def test_profile_without_histograms(model):
    doc = json.loads(
        json.dumps(profile_model(model, "random", options=ProfileOptions(bins=0, samples=4)))
    )
    assert all(t["histogram"] is None for t in doc["tensors"])
    text = render_report(doc)
    assert "<svg" not in text and "No histograms" in text
    _hostile_free(text)
    page = Page(text)
    assert page.errors == []
    header = page.header("tensors")
    rows = page.body_rows("tensors")
    assert [c["text"] for r in rows for c in r if c["class"] == "pid"] == [
        t["profile_id"] for t in doc["tensors"]
    ]
    assert "<dt>bins</dt><dd>0</dd>" in text
    for row, entry in zip(rows, doc["tensors"], strict=True):
        cells = _scale_cells(header, row)
        if "weights" in cells:  # max of each channel: no histogram needed
            assert cells["weights"]["text"] != DASH
            continue
        for method in METHODS:
            cell = cells[method]
            if method == "max" or entry["min"] == entry["max"] == 0:
                q = qparams_for(entry, _activation_options(method))
                assert float(cell["text"]) == pytest.approx(q.scale, rel=1e-4)
            else:
                assert cell["text"] == DASH


@pytest.mark.zoo
def test_ppocr_cls_report_stays_under_a_megabyte(tmp_path):
    """663 tensors profiled on the 128 calibration lines: the report drew 3.1 MB of histograms
    at 200 bars each before they were reduced for display."""
    model = zoo_model("ppocr_cls")
    data = SHARED / "data" / "textlines.npz"
    profile_path, out = tmp_path / "ppocr.profile.json", tmp_path / "ppocr.html"
    args = ["profile", str(model), "--data", f"{data}:calib", "--input-shape", "x=1x3x48x192"]
    result = CliRunner().invoke(app, [*args, "--out", str(profile_path)])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(app, ["report", str(profile_path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert len(text.encode()) < 1_000_000
    tensors = json.loads(profile_path.read_text())["tensors"]
    page = Page(text)
    assert page.errors == [] and len(page.svgs) == sum(bool(t["histogram"]) for t in tensors)
    assert "<dt>data</dt><dd>textlines.npz:calib</dd>" in text and str(SHARED) not in text
