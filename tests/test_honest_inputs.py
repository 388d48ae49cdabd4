"""Honest inputs: calibration data is checked before any work, alike in the CLI, the Python API
and the REST API (NaN and infinity, dtypes that do not fit their input, arrays not named like
the inputs), ``--allow-nonfinite`` and ``--cast`` let such data through, overflow inside the
model is flagged, and every graph output names the entry holding its statistics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import helper
from typer.testing import CliRunner

import rangeprof
from rangeprof.cli import app
from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.profiling.document import nonfinite_summary, validate
from rangeprof.profiler.profiling.run import ProfileOptions, profile_model
from rangeprof.service.limits import Limits

import onnx_builders as mb
from conftest import zoo_model
from service_fixtures import (
    BACKENDS,
    live_service,
    npz_bytes,
    row_counts,
    stored_files,
    upload_model,
    wait_for_run,
)

runner = CliRunner()


def _calib(count: int = 4) -> np.ndarray:
    return np.random.default_rng(0).uniform(0, 16, (count, 1, 8, 8)).astype(np.float32)


def _with(value: float, sample: int = 2) -> np.ndarray:
    data = _calib()
    data[sample, 0, 3, 5] = value
    return data


# Each case: the arrays of an .npz (digits_cnn: one input 'image', float32 [N, 1, 8, 8]), the
# key to give (None: FILE.npz alone), and what the refusal must say; the option that lets the
# data through (None: nothing does).
CASES = {
    "nan": (
        {"calib": _with(np.nan)},
        "calib",
        "d.npz:calib: sample 2 holds NaN (input 'image'); pass --allow-nonfinite to profile it "
        "anyway",
        "allow_nonfinite",
    ),
    "inf": (
        {"calib": _with(-np.inf, sample=3)},
        "calib",
        "d.npz:calib: sample 3 holds -inf (input 'image'); pass --allow-nonfinite",
        "allow_nonfinite",
    ),
    "dtype": (
        {"calib": _calib().astype(np.uint8)},
        "calib",
        "array 'calib' in d.npz: holds uint8, input 'image' is float32: pass --cast to convert",
        "cast",
    ),
    "names": (
        {"input": _calib()},
        None,
        "d.npz: holds arrays 'input', none named like the model's input 'image'; choose one "
        "with d.npz:KEY",
        None,
    ),
}


def _write(folder: Path, case: str) -> str:
    arrays, key, _, _ = CASES[case]
    np.savez(folder / "d.npz", **arrays)
    return f"{folder}/d.npz" + (f":{key}" if key else "")


def _flag(option: str) -> str:
    return "--" + option.replace("_", "-")


@pytest.mark.parametrize("case", CASES)
def test_cli_refuses_then_accepts(tmp_path, case):
    spec = _write(tmp_path, case)
    out = tmp_path / "p.json"
    model = str(zoo_model("digits_cnn"))
    result = runner.invoke(app, ["profile", model, "--data", spec, "--out", str(out)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and CASES[case][2] in lines[0].replace(f"{tmp_path}/", "")
    assert not out.exists()
    option = CASES[case][3]
    if option is None:
        return
    args = ["profile", model, "--data", spec, "--out", str(out), _flag(option)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = validate(rangeprof.Profile.load(out).document)
    assert doc["run"]["options"][option] is True
    image = next(t for t in doc["tensors"] if t["profile_id"] == "input:image")
    if option == "allow_nonfinite":
        assert (image["nan_count"], image["inf_count"]) == ((1, 0) if case == "nan" else (0, 1))
        assert "non-finite data profiled" in result.stderr and "input:image (1 " in result.stderr
    else:
        assert image["max"] == float(_calib().astype(np.uint8).max())


@pytest.mark.parametrize("case", CASES)
def test_python_refuses_then_accepts(tmp_path, case):
    spec = _write(tmp_path, case)
    model = rangeprof.load(zoo_model("digits_cnn"))
    with pytest.raises(RangeprofError) as info:
        rangeprof.profile(model, spec)
    assert CASES[case][2] in str(info.value).replace(f"{tmp_path}/", "")
    arrays, _, _, option = CASES[case]
    if option is None:
        return
    # Arrays in memory are checked as files are, and so is every batch of an iterable.
    (array,) = arrays.values()
    for data in (array, iter([array[:2], array[2:]])):
        with pytest.raises(RangeprofError, match=r"allow-nonfinite|cast"):
            rangeprof.profile(model, data)
    profile = rangeprof.profile(model, iter([array[:2], array[2:]]), **{option: True})
    image = profile.document["tensors"][0]
    assert image["profile_id"] == "input:image" and image["count"] == array.size
    assert image["nan_count"] + image["inf_count"] == (option == "allow_nonfinite")


def test_refused_before_compiling(tmp_path):
    """A bad sample deep in a file fails before the model is compiled: the build cache stays
    empty (the run has its own, see conftest)."""
    data = np.tile(_calib(), (64, 1, 1, 1))
    data[250, 0, 0, 0] = np.inf
    np.save(tmp_path / "d.npy", data)
    cache = rangeprof.profiler.compile.cache.BuildCache(tmp_path / "cache")
    with pytest.raises(RangeprofError, match=r"sample 250 holds inf"):
        profile_model(zoo_model("digits_cnn"), str(tmp_path / "d.npy"), cache=cache)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def _softmax_model(through_identity: bool):
    """Gemm -> Softmax to output ``y``, directly or (as ppocr_cls) through an Identity."""
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["h"], name="fc", transB=1)]
    if through_identity:
        nodes += [
            helper.make_node("Softmax", ["h"], ["s"], name="softmax", axis=-1),
            helper.make_node("Identity", ["s"], ["y"], name="out"),
        ]
    else:
        nodes.append(helper.make_node("Softmax", ["h"], ["y"], name="softmax", axis=-1))
    return mb.single_io_model(nodes, _SOFTMAX_WEIGHTS, (2, 8), (2, 5))


_SOFTMAX_WEIGHTS = {"w": np.linspace(-1, 1, 40).reshape(5, 8), "b": np.linspace(-0.5, 0.5, 5)}


@pytest.mark.parametrize("through_identity", [False, True], ids=["direct", "identity"])
def test_graph_outputs_have_statistics(tmp_path, through_identity):
    path = mb.save(_softmax_model(through_identity), tmp_path)
    x = np.random.default_rng(5).normal(size=(6, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    doc = validate(profile_model(path, str(tmp_path / "x.npy")))
    (entry,) = [t for t in doc["tensors"] if "graph_outputs" in t]
    assert entry["graph_outputs"] == ["y"] and entry["op"] == "relax.nn.softmax"
    w, b = (_SOFTMAX_WEIGHTS[k].astype(np.float32).astype(np.float64) for k in "wb")
    h = x.astype(np.float64) @ w.T + b
    expected = np.exp(h) / np.exp(h).sum(axis=1, keepdims=True)
    assert entry["min"] == pytest.approx(expected.min(), rel=1e-5)
    assert entry["max"] == pytest.approx(expected.max(), rel=1e-5)
    assert entry["count"] == expected.size


@pytest.mark.zoo
def test_ppocr_cls_output_is_named(tmp_path):
    doc = profile_model(
        zoo_model("ppocr_cls"),
        "random",
        input_shapes={"x": (1, 3, 48, 192)},
        options=ProfileOptions(samples=1, bins=0),
    )
    (entry,) = [t for t in doc["tensors"] if "graph_outputs" in t]
    assert entry["graph_outputs"] == ["save_infer_model/scale_0.tmp_1"]
    assert entry["source_tensor"] == "softmax_0.tmp_0" and entry["min"] is not None


def _overflow_model():
    """y = x * 1e38 * 1e38: finite data, infinite after the second product."""
    nodes = [
        helper.make_node("Mul", ["x", "s"], ["m"], name="first"),
        helper.make_node("Mul", ["m", "s"], ["y"], name="second"),
    ]
    return mb.single_io_model(nodes, {"s": np.full((1,), 1e38)}, (2, 4), (2, 4))


def test_overflow_is_flagged_and_warned(tmp_path):
    path = mb.save(_overflow_model(), tmp_path)
    x = np.random.default_rng(6).uniform(0.5, 2.0, (4, 4)).astype(np.float32)
    x[1, 2] = 0.0  # 0 * 1e38 * 1e38 stays finite
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "p.json"
    result = runner.invoke(
        app, ["profile", str(path), "--data", str(tmp_path / "x.npy"), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    doc = validate(rangeprof.Profile.load(out).document)
    by_id = {t["profile_id"]: t for t in doc["tensors"]}
    assert "overflow" not in by_id["first"] and by_id["first"]["inf_count"] == 0
    assert by_id["second"]["overflow"] is True and by_id["second"]["inf_count"] == 15
    warning = "warning: 1 tensor(s) overflowed to NaN or inf inside the model: second (15 inf)"
    assert warning in result.stderr.splitlines()
    assert nonfinite_summary(doc) == [warning]

    # Non-finite data propagates: counted, and no tensor is said to have overflowed.
    x[0, 0] = np.nan
    np.save(tmp_path / "x.npy", x)
    doc = profile_model(path, str(tmp_path / "x.npy"), options=ProfileOptions(allow_nonfinite=True))
    assert not any("overflow" in t for t in doc["tensors"])
    (line,) = nonfinite_summary(doc)
    assert line.startswith("non-finite data profiled: 3 tensor(s) hold NaN or inf: input:x (1 NaN)")


def test_a_padding_mask_from_the_data_is_no_overflow(tmp_path):
    """The ``-inf`` a data-made padding mask adds to the scores is counted as masked in every
    tensor that carries it; a product that overflows on top of it is still an overflow."""
    path = mb.save(mb.padding_mask_attention(), tmp_path)
    rng = np.random.default_rng(7)
    x = rng.uniform(-1, 1, (4, 6, 4)).astype(np.float32)
    attention_mask = np.ones((4, 6), np.int64)
    attention_mask[:, 4:] = 0  # two padded tokens a sample
    np.savez(tmp_path / "d.npz", x=x, attention_mask=attention_mask)
    doc = profile_model(path, str(tmp_path / "d.npz"))
    by_id = {t["profile_id"]: t for t in doc["tensors"]}
    for name in ("mask", "mask3", "masked", "large"):
        assert by_id[name]["masked"] is True and "overflow" not in by_id[name], name
    assert by_id["masked"]["inf_count"] == 4 * 6 * 2  # two keys masked on every query row
    assert np.isfinite([by_id["masked"]["min"], by_id["masked"]["max"]]).all()
    (overflowed,) = [t for t in doc["tensors"] if t.get("graph_outputs") == ["overflowed"]]
    assert overflowed["overflow"] is True  # its finite scores overflow too
    (masked, warning) = nonfinite_summary(doc)
    assert masked.startswith("masked: ") and "in 4 tensor(s)" in masked
    assert warning.startswith("warning: 1 tensor(s) overflowed to NaN or inf inside the model:")


# --- REST API ------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=BACKENDS)
def served(request, tmp_path_factory):
    with live_service(request.param, tmp_path_factory.mktemp(request.param), Limits()) as live:
        response = upload_model(live.owner, zoo_model("digits_cnn"))
        assert response.status_code == 201, response.text
        yield live, response.json()["id"]


def _post(live, model_id, case: str, **form):
    arrays, key, _, _ = CASES[case]
    form = {**form, **({"key": key} if key else {})}
    files = {"data": ("d.npz", npz_bytes(**arrays))}
    return live.owner.post(f"/api/models/{model_id}/runs", files=files, data=form)


@pytest.mark.parametrize("case", CASES)
def test_api_refuses_with_422_then_accepts(served, case):
    live, model_id = served
    rows, files = row_counts(live.url), stored_files(live.storage)
    response = _post(live, model_id, case)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, str) and CASES[case][2] in detail
    assert str(live.storage) not in detail
    assert (row_counts(live.url), stored_files(live.storage)) == (rows, files)
    option = CASES[case][3]
    if option is None:
        return
    response = _post(live, model_id, case, **{option: "true"})
    assert response.status_code == 202, response.text
    run = wait_for_run(live.owner, response.json()["id"])
    assert run["status"] == "done", run
    doc = live.owner.get(f"/api/runs/{run['id']}/profile").json()
    assert doc["run"]["options"][option] is True
