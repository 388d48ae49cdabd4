"""The aarch64 target: cross-compiled libraries run under qemu-user agree with the x86 build.

Each model is built twice by the fast CPU path, for the host and for ``AARCH64_TARGET``; the
aarch64 library is exported with the cross compiler and run by :func:`run_under_qemu`. Integer
outputs must equal the host's bit for bit — so must the INT8 digits CNN's, whose only float
arithmetic is dequantization — and float ones agree to rounding (FMA contraction and vector
widths differ). CI installs the toolchain (``.ci/run``); elsewhere the tests that need it skip,
saying which package is missing.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import relax

from rangeprof.byoc.aarch64 import (
    AARCH64_TARGET,
    QemuRunError,
    ToolchainError,
    ensure_runtime,
    export,
    run_under_qemu,
    toolchain_available,
    unavailable_reason,
)
from rangeprof.byoc.aarch64.host import ensure_host
from rangeprof.byoc.plugin import get_plugin
from rangeprof.byoc.quantized import qparams_from_profile, quantize_model
from rangeprof.profiler.compile.schedules import host_target
from rangeprof.profiler.ir.importer import import_onnx
from rangeprof.profiler.ir.onnx_load import load_model
from rangeprof.profiler.profiling.data import model_inputs, open_data
from rangeprof.profiler.profiling.run import ProfileOptions, profile_model

from conftest import SHARED, ZOO_SHAPES, zoo_model
from integer_build import build

needs_toolchain = pytest.mark.skipif(not toolchain_available(), reason=str(unavailable_reason()))


@pytest.fixture(scope="session")
def aarch64_runtime():
    """Downloads the aarch64 runtime and compiles the host program once (both cached on disk),
    so that a failure there shows as one setup error instead of inside every test."""
    ensure_host(ensure_runtime())


@pytest.fixture
def on_aarch64(aarch64_runtime, tmp_path):
    """Runs an executable built for ``AARCH64_TARGET`` under qemu: ``(executable, inputs)``."""

    def run(executable, inputs):
        library = tmp_path / "model.so"
        export(executable, library)
        return run_under_qemu(library, inputs)

    return run


def _on_host(executable, inputs) -> list[np.ndarray]:
    """The host's outputs, flattened as :func:`run_under_qemu` flattens them."""
    out = relax.VirtualMachine(executable, tvm.cpu())["main"](
        *[tvm.runtime.tensor(x) for x in inputs]
    )
    stack, flat = [out], []
    while stack:
        item = stack.pop(0)
        if isinstance(item, tvm.runtime.Tensor):
            flat.append(item.numpy())
        else:
            stack[:0] = list(item)
    return flat


def _function(params: dict, body) -> tvm.IRModule:
    """``main(**params)`` whose dataflow block is ``body(builder, *param_vars)``."""
    bb = relax.BlockBuilder()
    args = [
        relax.Var(name, relax.TensorType(shape, dtype)) for name, (shape, dtype) in params.items()
    ]
    with bb.function("main", args):
        with bb.dataflow():
            out = bb.emit_output(body(bb, *args))
        bb.emit_func_output(out)
    return bb.get()


def _conv_relu() -> tvm.IRModule:
    rng = np.random.default_rng(0)
    w = relax.const(rng.normal(size=(16, 8, 3, 3)).astype(np.float32) / 8)
    b = relax.const(rng.normal(size=(1, 16, 1, 1)).astype(np.float32))

    def body(bb, x):
        conv = bb.emit(relax.op.nn.conv2d(x, w, padding=1))
        return relax.op.nn.relu(bb.emit(relax.op.add(conv, b)))

    return _function({"x": ((1, 8, 14, 14), "float32")}, body)


def _int_conv(dtype: str) -> tvm.IRModule:
    """8-bit input → conv with int8 weights (int32 accumulator) → + int32 bias → shift → clamp →
    8 bits; returns (accumulator, 8-bit output)."""
    rng = np.random.default_rng(1)
    w = relax.const(rng.integers(-127, 128, size=(16, 8, 3, 3), dtype=np.int8))
    b = relax.const(rng.integers(-20000, 20000, size=(1, 16, 1, 1), dtype=np.int32))
    info = np.iinfo(dtype)

    def body(bb, x):
        acc = bb.emit(relax.op.nn.conv2d(x, w, padding=1, out_dtype="int32"))
        scaled = bb.emit(relax.op.right_shift(bb.emit(relax.op.add(acc, b)), relax.const(7)))
        clamped = bb.emit(relax.op.clip(scaled, int(info.min), int(info.max)))
        return relax.Tuple([acc, bb.emit(relax.op.astype(clamped, dtype))])

    return _function({"x": ((1, 8, 14, 14), dtype)}, body)


def _random(dtype: str, shape, seed: int = 2) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=dtype)
    return rng.normal(size=shape).astype(dtype)


@needs_toolchain
def test_fp32_conv_relu_matches_x86(on_aarch64):
    mod = _conv_relu()
    x = _random("float32", (1, 8, 14, 14))
    (expected,) = _on_host(build(mod, host_target()), [x])
    (actual,) = on_aarch64(build(mod, AARCH64_TARGET), [x])
    assert actual.dtype == np.float32
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


@needs_toolchain
@pytest.mark.parametrize("dtype", ["uint8", "int8"])
def test_integer_conv_equals_x86_exactly(on_aarch64, dtype):
    mod = _int_conv(dtype)
    x = _random(dtype, (1, 8, 14, 14))
    expected = _on_host(build(mod, host_target()), [x])
    actual = on_aarch64(build(mod, AARCH64_TARGET), [x])
    assert [a.dtype for a in actual] == [np.int32, np.dtype(dtype)]
    for got, want in zip(actual, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    # The clamp must have bitten on both sides, or the test would not check it.
    assert {np.iinfo(dtype).min, np.iinfo(dtype).max} <= set(np.unique(actual[1]))


def test_int8_conv_uses_sdot():
    """Building needs no toolchain: LLVM emits the assembly itself."""
    executable = build(_int_conv("int8"), AARCH64_TARGET)
    llvm = next(m for m in executable.mod.imports if m.kind == "llvm")
    assert re.search(r"^\s*sdot\s+v\d+\.[24]s", llvm.inspect_source("asm"), re.MULTILINE)


@needs_toolchain
def test_tensor_kinds_round_trip(on_aarch64):
    """Every supported dtype, 0-d / 1-d / 4-d shapes and nested tuples pass through the host."""
    params = {
        "a": ((2, 3), "float32"),
        "b": ((5,), "int32"),
        "c": ((), "int8"),
        "d": ((1, 2, 3, 4), "uint8"),
    }

    def body(bb, a, b, c, d):
        doubled = bb.emit(relax.op.multiply(a, relax.const(2.0)))
        return relax.Tuple([relax.Tuple([doubled, b]), relax.Tuple([c, relax.Tuple([d])])])

    inputs = [_random(dtype, shape, seed) for seed, (shape, dtype) in enumerate(params.values())]
    actual = on_aarch64(tvm.compile(_function(params, body), target=AARCH64_TARGET), inputs)
    for got, want in zip(actual, [inputs[0] * 2, *inputs[1:]], strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


@needs_toolchain
def test_failed_run_raises_with_the_error(on_aarch64):
    executable = tvm.compile(_conv_relu(), target=AARCH64_TARGET)
    with pytest.raises(QemuRunError, match=r"exit status 1.*vm_host:.*main"):
        on_aarch64(executable, [])


def test_missing_cross_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    executable = tvm.compile(_conv_relu(), target=AARCH64_TARGET)
    with pytest.raises(ToolchainError, match="aarch64-linux-gnu-g\\+\\+ not found"):
        export(executable, tmp_path / "model.so")


@pytest.mark.zoo
@needs_toolchain
def test_zoo_cnn_fp32_matches_x86(on_aarch64):
    model = load_model(zoo_model("digits_cnn"), ZOO_SHAPES["digits_cnn"] or None)
    mod = import_onnx(model).mod
    feeds = next(open_data("random", model_inputs(model), samples=1).batches())
    inputs = list(feeds.values())
    (expected,) = _on_host(build(mod, host_target()), inputs)
    (actual,) = on_aarch64(build(mod, AARCH64_TARGET), inputs)
    scale = max(float(np.abs(expected).max()), 1.0)
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.zoo
@needs_toolchain
def test_zoo_cnn_int8_equals_x86_exactly(on_aarch64):
    """The issue's criterion: the INT8 program of each plugin, same qparams, same bits out —
    the model's output and every region's (dequantized) output. Both in 8-bit weights: x86
    without VNNI would otherwise choose 7 bits for some layers."""
    model = zoo_model("digits_cnn")
    digits = SHARED / "data" / "digits.npz"
    profile = profile_model(model, f"{digits}:calib", options=ProfileOptions(samples=64))
    x = np.load(digits)["test"][:1].astype(np.float32)
    outputs = {}
    for plugin in (get_plugin("x86", weight_bits=8), get_plugin("aarch64", weight_bits=8)):
        qm = quantize_model(model, qparams_from_profile(profile, plugin, "max", 99.99), plugin)
        executable = plugin.compile(qm.lower(expose=True)[0])
        run = _on_host if plugin.runs_here else on_aarch64
        outputs[plugin.name] = run(executable, [x])
    assert len(outputs["aarch64"]) == 6  # the output, then the five regions'
    for got, want in zip(outputs["aarch64"], outputs["x86"], strict=True):
        np.testing.assert_array_equal(got, want)
