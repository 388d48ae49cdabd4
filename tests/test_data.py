"""Calibration data sources: .npz, .npy, image folders and random data; batching, streaming,
validation and determinism."""

from __future__ import annotations

import inspect
import re
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rangeprof.profiler.errors import CalibrationDataError
from rangeprof.profiler.ir.onnx_load import load_model
from rangeprof.profiler.profiling.data import (
    InputSpec,
    Preprocess,
    model_inputs,
    open_data,
    parse_preprocess,
)

import onnx_builders
from conftest import SHARED

X = InputSpec("x", (1, 2, 3), "float32")  # samples of shape (2, 3)


def _samples(n: int, dtype="float32") -> np.ndarray:
    return np.arange(n * 6).reshape(n, 2, 3).astype(dtype)


def _all(data, name="x") -> np.ndarray:
    return np.concatenate([batch[name] for batch in data.batches()])


def _error(spec, inputs=(X,), **options) -> str:
    with pytest.raises(CalibrationDataError) as info:
        data = open_data(str(spec), list(inputs), **options)
        list(data.batches())
    message = str(info.value)
    assert "\n" not in message
    return message


# --- .npz ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_npz_only_array(tmp_path, save):
    path = tmp_path / "calib.npz"
    save(path, calib=_samples(5))
    message = _error(path)  # one array is not guessed to be the one input's
    assert message == (
        f"{path}: holds arrays 'calib', none named like the model's input 'x'; choose one with "
        f"{path}:KEY"
    )
    data = open_data(f"{path}:calib", [X], batch_size=2)
    assert (data.num_samples, data.num_batches) == (5, 3)
    batches = list(data.batches())
    assert [b["x"].shape for b in batches] == [(2, 2, 3), (2, 2, 3), (1, 2, 3)]
    assert all(b["x"].flags.c_contiguous and b["x"].dtype == np.float32 for b in batches)
    np.testing.assert_array_equal(_all(data), _samples(5))


def test_npz_key(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, calib=_samples(4), test=_samples(7) + 100, labels=np.zeros(7, np.int64))
    np.testing.assert_array_equal(_all(open_data(f"{path}:test", [X])), _samples(7) + 100)
    message = _error(path)
    assert message == (
        f"{path}: holds arrays 'calib', 'test', 'labels', none named like the model's input 'x'; "
        f"choose one with {path}:KEY"
    )
    message = _error(f"{path}:nope")
    assert "'nope'" in message and "'calib', 'test', 'labels'" in message


def test_npz_multi_input_by_name_and_by_keys(tmp_path):
    ids = InputSpec("ids", (1, 4), "int64")
    inputs = [X, ids]
    token_ids = np.arange(20).reshape(5, 4)
    path = tmp_path / "d.npz"
    np.savez(path, ids=token_ids, x=_samples(5), a=_samples(5) + 1, b=token_ids + 1)
    [batch] = open_data(str(path), inputs, batch_size=5).batches()
    np.testing.assert_array_equal(batch["x"], _samples(5))
    np.testing.assert_array_equal(batch["ids"], token_ids)
    assert list(batch) == ["x", "ids"] and batch["ids"].dtype == np.int64

    [batch] = open_data(f"{path}:a,b", inputs, batch_size=5).batches()
    np.testing.assert_array_equal(batch["x"], _samples(5) + 1)
    np.testing.assert_array_equal(batch["ids"], token_ids + 1)

    assert "1 key(s) ('a') for the model's 2 input(s) ('x', 'ids')" in _error(f"{path}:a", inputs)
    other = tmp_path / "other.npz"
    np.savez(other, a=_samples(5), b=token_ids)
    assert "'x', 'ids'" in _error(other, inputs)  # no keys and no names that fit


def test_npz_sample_counts_differ(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x=_samples(5), ids=np.zeros((4, 4), np.int64))
    message = _error(path, [X, InputSpec("ids", (1, 4), "int64")])
    assert "different sample counts" in message and "'x': 5" in message and "'ids': 4" in message


def test_npz_errors(tmp_path):
    assert "no such file" in _error(tmp_path / "missing.npz")

    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(np.random.default_rng(0).bytes(1000))
    assert _error(garbage).startswith(f"{garbage}: not an .npz file")

    empty = tmp_path / "empty.npz"
    with zipfile.ZipFile(empty, "w"):
        pass
    assert _error(empty) == f"{empty}: holds no arrays"

    not_npy = tmp_path / "not_npy.npz"
    with zipfile.ZipFile(not_npy, "w") as archive:
        archive.writestr("x.npy", b"hello, not an array")
    assert _error(not_npy).startswith(f"array 'x' in {not_npy}: not a valid .npy array")

    truncated = tmp_path / "truncated.npz"
    np.savez(truncated, x=_samples(50))
    truncated.write_bytes(truncated.read_bytes()[:300])
    assert str(truncated) in _error(truncated)

    fortran = tmp_path / "fortran.npz"
    np.savez(fortran, x=np.asfortranarray(_samples(5)))
    assert "Fortran order" in _error(fortran)


def test_npz_member_stored_short(tmp_path):
    # A member whose data stops before its header's shape says: found while streaming.
    path = tmp_path / "short.npz"
    array_file = tmp_path / "x.npy"
    np.save(array_file, _samples(5))
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", array_file.read_bytes()[:-24])
    message = _error(path, batch_size=2)
    assert message == f"array 'x' in {path}: truncated, samples from 4 on are missing"


# --- .npy ---------------------------------------------------------------------------------------


def test_npy_casts_and_keeps_nan_when_allowed(tmp_path):
    path = tmp_path / "x.npy"
    values = _samples(3, ">f8")  # big-endian float64 -> native float32 is fine
    values[1, 0, 0] = np.nan
    np.save(path, values)
    message = _error(path)
    assert message == (
        f"{path}: sample 1 holds NaN (input 'x'); pass --allow-nonfinite to profile it anyway"
    )
    got = _all(open_data(str(path), [X], allow_nonfinite=True))
    assert got.dtype == np.float32 and np.isnan(got[1, 0, 0])
    np.testing.assert_array_equal(got, values.astype(np.float32))

    np.save(path, _samples(3, "int16"))  # int -> float only when asked
    message = _error(path)
    assert message == f"{path}: holds int16, input 'x' is float32: pass --cast to convert"
    np.testing.assert_array_equal(_all(open_data(str(path), [X], cast=True)), _samples(3))

    np.save(path, np.asfortranarray(_samples(3)))  # a memory map reads any order
    np.testing.assert_array_equal(_all(open_data(str(path), [X])), _samples(3))


def test_npy_errors(tmp_path):
    path = tmp_path / "x.npy"
    path.write_bytes(b"")
    assert _error(path).startswith(f"{path}: not a valid .npy array")
    path.write_bytes(np.random.default_rng(0).bytes(1000))
    assert _error(path).startswith(f"{path}: not a valid .npy array")
    np.savez(tmp_path / "x.npz", x=_samples(2))  # a zip under a .npy name
    path.write_bytes((tmp_path / "x.npz").read_bytes())
    assert _error(path).startswith(f"{path}: not a valid .npy array")

    np.save(path, _samples(10))
    path.write_bytes(path.read_bytes()[:-40])
    assert _error(path).startswith(f"{path}: not a valid .npy array")

    np.save(path, _samples(2))
    message = _error(path, [X, InputSpec("y", (1, 3), "float32")])
    assert str(path) in message and "'x', 'y'" in message and ".npz" in message

    assert "preprocessing applies to a folder of images only" in _error(
        path, preprocess=Preprocess()
    )


def test_unknown_source(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("1,2,3\n")
    assert _error(path).startswith(f"{path}: unknown data source")


# --- validation shared by .npz and .npy ---------------------------------------------------------


@pytest.mark.parametrize("suffix", ["npz", "npy"])
def test_object_arrays_are_rejected(tmp_path, suffix):
    path = tmp_path / f"objects.{suffix}"
    objects = np.empty((2, 2, 3), dtype=object)
    if suffix == "npz":
        np.savez(path, x=objects, allow_pickle=True)
    else:
        np.save(path, objects, allow_pickle=True)
    message = _error(path)
    assert str(path) in message and "Python objects (pickled data) are never loaded" in message


@pytest.mark.parametrize("suffix", ["npz", "npy"])
def test_array_checks(tmp_path, suffix):
    path = tmp_path / f"d.{suffix}"

    def save(array):
        if suffix == "npz":
            np.savez(path, x=array)  # named like the input
        else:
            np.save(path, array)

    save(_samples(3)[0])  # one sample without the sample axis
    message = _error(path)
    assert str(path) in message and "'x'" in message and "[N, 2, 3]" in message
    assert "add a leading sample axis" in message

    save(np.zeros((3, 3, 2), np.float32))
    message = _error(path)
    assert "shape [3, 3, 2] does not fit input 'x'" in message
    assert "leading sample axis" not in message

    save(np.zeros((0, 2, 3), np.float32))
    assert "no samples" in _error(path)

    ids = [InputSpec("ids", (1, 4), "int64")]
    spec = f"{path}:x" if suffix == "npz" else str(path)
    save(np.zeros((3, 4), np.float64))
    assert "holds float64, input 'ids' is int64: pass --cast to convert" in _error(spec, ids)
    assert _all(open_data(spec, ids, cast=True), "ids").dtype == np.int64

    save(np.zeros((3, 4), np.int32))  # int32 -> int64 is fine
    assert _all(open_data(spec, ids), "ids").dtype == np.int64


def test_option_checks(tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, _samples(2))
    assert "batch size 0" in _error(path, batch_size=0)
    assert "sample count 0" in _error(path, samples=0)
    assert "'s'" in _error(path, [InputSpec("s", (), "float32")])


# --- batching and streaming ---------------------------------------------------------------------


def test_samples_take_the_first_and_clamp(tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, _samples(10))
    data = open_data(str(path), [X], batch_size=4, samples=6)
    assert (data.num_samples, data.num_batches) == (6, 2)
    assert [b["x"].shape[0] for b in data.batches()] == [4, 2]
    np.testing.assert_array_equal(_all(data), _samples(6))
    assert open_data(str(path), [X], samples=100).num_samples == 10


@pytest.mark.parametrize("suffix", ["npy", "npz", "compressed.npz"])
def test_batches_stream(tmp_path, suffix):
    # 4 MB of samples read in batches of 16 KB: memory must stay near one batch.
    path = tmp_path / f"big.{suffix}"
    values = np.random.default_rng(0).standard_normal((256, 64, 64), dtype=np.float32)
    if suffix == "npy":
        np.save(path, values)
    else:
        (np.savez_compressed if "compressed" in suffix else np.savez)(path, x=values)
    inputs = [InputSpec("x", (1, 64, 64), "float32")]
    data = open_data(str(path), inputs)
    batches = data.batches()
    assert inspect.isgenerator(batches)
    count = 0
    tracemalloc.start()
    try:
        for batch in batches:
            assert type(batch["x"]) is np.ndarray and batch["x"].shape == (1, 64, 64)
            assert batch["x"].flags.owndata  # a copy, not a view into the memory map
            count += 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 256
    assert peak < 1_000_000


# --- random -------------------------------------------------------------------------------------


def test_random_is_seeded_and_independent_of_batch_size():
    inputs = [InputSpec("x", (1, 3, 4), "float32"), InputSpec("ids", (1, 5), "int64")]
    one = open_data("random", inputs, seed=7)
    assert one.num_samples == 8
    by_three = open_data("random", inputs, seed=7, batch_size=3)
    assert [b["x"].shape[0] for b in by_three.batches()] == [3, 3, 2]
    for name in ("x", "ids"):
        np.testing.assert_array_equal(_all(one, name), _all(by_three, name))
        np.testing.assert_array_equal(_all(one, name), _all(one, name))
    assert not np.array_equal(_all(one), _all(open_data("random", inputs, seed=8)))

    ids = _all(open_data("random", inputs, samples=200), "ids")
    assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < 100
    x = _all(open_data("random", inputs, samples=200))
    assert x.dtype == np.float32 and abs(x.mean()) < 0.1 and 0.9 < x.std() < 1.1


def test_random_dtypes():
    inputs = [InputSpec("h", (1, 2), "float16"), InputSpec("m", (1, 9), "bool")]
    [batch] = open_data("random", inputs, samples=4, batch_size=4).batches()
    assert batch["h"].dtype == np.float16 and batch["m"].dtype == np.bool_
    assert "'c'" in _error("random", [InputSpec("c", (1, 2), "complex64")])
    assert "preprocessing" in _error("random", preprocess=Preprocess())


# --- images -------------------------------------------------------------------------------------


def _image(path: Path, color, size=(6, 4), mode="RGB") -> None:
    Image.new(mode, size, color).save(path)  # size is (W, H)


IMAGE = InputSpec("img", (1, 3, 4, 6), "float32")


def test_images_sorted_and_normalized(tmp_path):
    _image(tmp_path / "b.jpg", (0, 0, 0))
    _image(tmp_path / "a.png", (255, 0, 51))
    _image(tmp_path / "c.BMP", (0, 255, 0), size=(12, 8))  # resized to the input's 4x6
    (tmp_path / "labels.txt").write_text("ignored\n")
    (tmp_path / "sub.png").mkdir()  # a folder, ignored
    prep = parse_preprocess("mean=0.5,std=0.5")
    data = open_data(str(tmp_path), [IMAGE], batch_size=2, preprocess=prep)
    assert (data.num_samples, data.num_batches) == (3, 2)
    first, last = data.batches()
    assert first["img"].shape == (2, 3, 4, 6) and last["img"].shape == (1, 3, 4, 6)
    assert first["img"].dtype == np.float32 and first["img"].flags.c_contiguous
    np.testing.assert_allclose(first["img"][0, :, 0, 0], [1.0, -1.0, -0.6], atol=1e-6)  # a.png
    np.testing.assert_allclose(first["img"][1], -1.0, atol=0.02)  # b.jpg (lossy)
    np.testing.assert_allclose(last["img"][0, :, 2, 3], [-1.0, 1.0, -1.0], atol=1e-6)


def test_images_bgr_nhwc_and_grayscale(tmp_path):
    _image(tmp_path / "a.png", (10, 20, 30))
    prep = Preprocess(scale=1, layout="NHWC", channels="BGR", size=(4, 6))
    data = open_data(str(tmp_path), [InputSpec("i", (1, 4, 6, 3), "float32")], preprocess=prep)
    [batch] = data.batches()
    np.testing.assert_array_equal(batch["i"][0, 1, 2], [30, 20, 10])
    [batch] = open_data(str(tmp_path), [InputSpec("g", (1, 1, 4, 6), "float16")]).batches()
    assert batch["g"].dtype == np.float16
    # Pillow's L: (299 R + 587 G + 114 B) / 1000, then the default scale of 1/255
    np.testing.assert_allclose(batch["g"][0, 0], (2990 + 11740 + 3420) / 1000 / 255, atol=1e-3)


def test_image_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no images\n")
    assert _error(empty, [IMAGE]).startswith(f"{empty}: no images")

    folder = tmp_path / "imgs"
    folder.mkdir()
    _image(folder / "a.png", (1, 2, 3))
    message = _error(folder, [InputSpec("x", IMAGE.shape, "float32"), InputSpec("y", (1, 3), "f4")])
    assert str(folder) in message and "'x', 'y'" in message


def test_image_input_checks(tmp_path):
    _image(tmp_path / "a.png", (1, 2, 3))

    def message(inp, **prep):
        return _error(tmp_path, [inp], preprocess=Preprocess(**prep))

    assert "'x' of shape [1, 2, 3] is not an image input" in message(X)
    assert "has 6 channels" in message(IMAGE, layout="NHWC")
    assert "channels=L does not fit" in message(IMAGE, channels="L")
    assert "size=8x8 does not fit" in message(IMAGE, size=(8, 8))
    assert "mean has 2 values" in message(IMAGE, mean=(0.1, 0.2))
    assert "holds float32, input 'u' is uint8: pass --cast to convert" in message(
        InputSpec("u", IMAGE.shape, "uint8")
    )
    bad = tmp_path / "b.png"
    bad.write_text("not a png")
    assert message(IMAGE).startswith(f"{bad}: cannot read the image")


def test_truncated_image_fails_when_read(tmp_path):
    path = tmp_path / "a.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 60, 3), np.uint8)).save(path)
    path.write_bytes(path.read_bytes()[:200])
    data = open_data(str(tmp_path), [IMAGE])  # the header is fine
    with pytest.raises(
        CalibrationDataError, match=f"^{re.escape(str(path))}: cannot read the image"
    ):
        list(data.batches())


# --- preprocessing specs ------------------------------------------------------------------------


def test_parse_preprocess():
    assert parse_preprocess(
        "size=48x192,mean=0.5,0.5,0.5,std=0.5,0.5,0.5,layout=nchw,scale=1/255,channels=bgr"
    ) == Preprocess(
        size=(48, 192),
        mean=(0.5, 0.5, 0.5),
        std=(0.5, 0.5, 0.5),
        layout="NCHW",
        scale=1 / 255,
        channels="BGR",
    )
    assert parse_preprocess("scale=0.5") == Preprocess(scale=0.5)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "expected KEY=VALUE"),
        ("0.5,mean=1", "expected KEY=VALUE"),
        ("resize=4x4", "unknown key 'resize'; keys are size, mean, std, scale, layout, channels"),
        ("mean=1,mean=2", "mean given twice"),
        ("size=48", "size='48' is not HxW"),
        ("size=4x4,5", "size takes one value"),
        ("std=a", "std='a' is not numbers"),
        ("scale=1/0", "scale='1/0' is not numbers"),
        ("layout=CHW", "layout 'CHW' is not one of NCHW, NHWC"),
        ("channels=RGBA", "channels 'RGBA' is not one of RGB, BGR, L"),
        ("std=1,0", "std (1.0, 0.0) contains zero"),
        ("size=0x4", "size (0, 4) is not two positive dims"),
    ],
)
def test_parse_preprocess_errors(text, problem):
    with pytest.raises(CalibrationDataError, match=re.escape(problem)):
        parse_preprocess(text)


# --- model inputs and the shared data -----------------------------------------------------------


def test_model_inputs(tmp_path):
    model = load_model(onnx_builders.save(onnx_builders.gemm(), tmp_path))
    assert model_inputs(model) == [InputSpec("x", (2, 8), "float32")]


@pytest.mark.parametrize(
    ("name", "shape", "count"),
    [("digits", (1, 1, 8, 8), 200), ("textlines", (1, 3, 48, 192), 128)],
)
def test_shared_calibration_sets(name, shape, count):
    path = SHARED / "data" / f"{name}.npz"
    if not path.exists():
        pytest.skip(f"shared data not available ({path})")
    data = open_data(f"{path}:calib", [InputSpec("x", shape, "float32")], batch_size=50)
    assert data.num_samples == count
    sizes = [batch["x"].shape for batch in data.batches()]
    assert sizes[0] == (50, *shape[1:]) and sum(s[0] for s in sizes) == count
