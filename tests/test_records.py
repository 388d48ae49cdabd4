"""The typed records of the documents agree with their JSON schemas and give every document a
real run writes back byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rangeprof.byoc.manifest import Manifest
from rangeprof.byoc.reports import EvaluationReport
from rangeprof.cli import app
from rangeprof.profiler.calibrate.records import QParamsDocument
from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.ir.fates import Fate
from rangeprof.profiler.profiling.records import ProfileDocument
from rangeprof.profiler.records import Record

from conftest import SHARED, zoo_model

SCHEMAS = Path(__file__).resolve().parents[1] / "profiler" / "schemas"
# Hand-written schemas (with descriptions, patterns and bounds) the records must agree with.
WRITTEN = {ProfileDocument: "profile", QParamsDocument: "qparams"}
# Schemas generated from the records: the committed files must be current.
GENERATED = {Manifest: "manifest", EvaluationReport: "evaluation"}
DIGITS = f"{SHARED}/data/digits.npz"


def _object(node: dict, defs: dict) -> dict | None:
    """The object schema a property's schema holds: itself, its ``$ref``, the object branch of
    a union, its items or additional properties (None: a plain value)."""
    if "$ref" in node:
        return _object(defs[node["$ref"].rsplit("/", 1)[1]], defs)
    if "properties" in node:
        return node
    branches = node.get("anyOf", node.get("oneOf", []))
    for inner in [*branches, node.get("items"), node.get("additionalProperties")]:
        found = _object(inner, defs) if isinstance(inner, dict) else None
        if found is not None:
            return found
    return None


def _differences(ours: dict, theirs: dict, our_defs: dict, their_defs: dict, at: str = ""):
    """Where the property names or required sets differ, at every level the records model."""
    found = []
    names = set(ours["properties"]), set(theirs["properties"])
    if names[0] != names[1]:
        found.append(f"{at or '/'}: properties {sorted(names[0] ^ names[1])} differ")
    if set(ours.get("required", [])) != set(theirs.get("required", [])):
        found.append(f"{at or '/'}: required {ours.get('required')} != {theirs.get('required')}")
    for name in sorted(names[0] & names[1]):
        inner = _object(ours["properties"][name], our_defs)
        if inner is None:
            continue
        other = _object(theirs["properties"][name], their_defs)
        if other is None:
            found.append(f"{at}/{name}: an object in the record only")
            continue
        found += _differences(inner, other, our_defs, their_defs, f"{at}/{name}")
    return found


@pytest.mark.parametrize("record", list(WRITTEN), ids=lambda r: r.__name__)
def test_the_records_agree_with_the_written_schemas(record):
    theirs = json.loads((SCHEMAS / f"{WRITTEN[record]}.schema.json").read_text())
    ours = record.model_json_schema()
    assert _differences(ours, theirs, ours.get("$defs", {}), theirs.get("$defs", {})) == []


@pytest.mark.parametrize("record", list(GENERATED), ids=lambda r: r.__name__)
def test_the_generated_schemas_are_current(record):
    committed = json.loads((SCHEMAS / f"{GENERATED[record]}.schema.json").read_text())
    assert committed == record.model_json_schema(), (
        f"regenerate: {record.__name__}.model_json_schema() into "
        f"profiler/schemas/{GENERATED[record]}.schema.json"
    )


def test_the_comparison_sees_a_difference():
    theirs = json.loads((SCHEMAS / "profile.schema.json").read_text())
    del theirs["$defs"]["tensor"]["properties"]["overflow"]
    theirs["properties"]["run"]["required"].remove("timings")
    ours = ProfileDocument.model_json_schema()
    assert _differences(ours, theirs, ours["$defs"], theirs["$defs"]) == [
        "/run: required ['samples', 'options', 'timings'] != ['samples', 'options']",
        "/tensors: properties ['overflow'] differ",
    ]


def _cli(*args: str) -> None:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> dict[type[Record], str]:
    """The text of a digits_cnn profile, its qparams, a build's manifest and an evaluation
    report of every method, as ``rangeprof`` writes them."""
    folder = tmp_path_factory.mktemp("documents")
    model = str(zoo_model("digits_cnn"))
    profile, qparams, built = folder / "p.json", folder / "q.json", folder / "built"
    _cli("profile", model, "--data", f"{DIGITS}:calib", "--samples", "32", "--out", str(profile))
    _cli("calibrate", str(profile), "--method", "best", "--out", str(qparams))
    _cli("build", model, "--qparams", str(qparams), "--exclude", "/fc2/*", "--out", str(built))
    data = ["--data", f"{DIGITS}:test", "--labels", f"{DIGITS}:test_labels", "--samples", "64"]
    evaluate = ["evaluate", model, "--profile", str(profile), "--method", "all", "--json"]
    report = CliRunner().invoke(app, [*evaluate, *data])
    assert report.exit_code == 0, report.output
    return {
        ProfileDocument: profile.read_text(),
        QParamsDocument: qparams.read_text(),
        Manifest: (built / "manifest.json").read_text(),
        EvaluationReport: report.stdout[report.stdout.index("{") :].strip(),
    }


@pytest.mark.parametrize(
    "record",
    [ProfileDocument, QParamsDocument, Manifest, EvaluationReport],
    ids=lambda r: r.__name__,
)
def test_records_give_real_documents_back_exactly(record, documents):
    text = documents[record]
    doc = json.loads(text)
    assert record.from_json(doc).to_json() == doc
    assert record.from_json(text).dumps() == text


def test_a_record_of_a_file_is_checked_against_the_schema(documents, tmp_path):
    doc = json.loads(documents[ProfileDocument])
    doc["tensors"][0]["count"] = -1
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(RangeprofError, match="invalid profile at tensors/0/count"):
        ProfileDocument.from_json(path)
    with pytest.raises(RangeprofError, match="invalid at tensors/0/kind"):
        ProfileDocument.from_json({**doc, "tensors": [{**doc["tensors"][0], "kind": "other"}]})


def test_typed_attributes_read_the_document(documents):
    profile = ProfileDocument.from_json(documents[ProfileDocument])
    assert profile.run.options.channel_stats is False and profile.run.samples == 32
    assert profile.tensors[0].histogram.bins == profile.run.options.bins
    qparams = QParamsDocument.from_json(documents[QParamsDocument])
    assert qparams.options.method == "best" and qparams.options.target == "x86"
    assert {r.profile_id for r in qparams.qparams} == {t.profile_id for t in profile.tensors}
    manifest = Manifest.from_json(documents[Manifest])
    assert {r.mode for r in manifest.regions} == {"int8", "fp32"}


@pytest.mark.parametrize(
    "text", ["folded_into:Reshape@18", "aliases:/head/Softmax", "eliminated:constant", "qdq:x"]
)
def test_a_fate_reads_and_writes_its_text(text):
    fate = Fate.parse(text)
    assert str(fate) == text and fate.kind == text.split(":")[0]


def test_an_unknown_fate_is_refused():
    with pytest.raises(ValueError, match="kind"):
        Fate.parse("vanished:x")


def test_the_python_api_holds_the_records(documents):
    import rangeprof

    profile = rangeprof.Profile(json.loads(documents[ProfileDocument]))
    assert isinstance(profile.record, ProfileDocument)
    assert profile.document == json.loads(documents[ProfileDocument])
    assert profile.to_json() == documents[ProfileDocument]
    qparams = rangeprof.QParams(json.loads(documents[QParamsDocument]))
    first = json.loads(documents[QParamsDocument])["qparams"][0]
    assert qparams[first["profile_id"]] == first and qparams.to_json() == documents[QParamsDocument]
