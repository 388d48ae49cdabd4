"""The npu plugin: the external codegen's C is compiled, loaded and run, tiled to its buffer, and
its integer outputs equal the x86 build's bit for bit, on 8-bit and on int16 activations."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess

import numpy as np
import pytest
import tvm
import tvm_ffi.libinfo
from onnx import helper
from tvm import relax

from rangeprof.byoc import npu
from rangeprof.byoc.artifact import LIBRARY, build_artifact
from rangeprof.byoc.evaluate import fit_budget
from rangeprof.byoc.lowering import INT8, INT16
from rangeprof.byoc.npu.codegen import offloaded
from rangeprof.byoc.npu.core import Conv2dOp, MatmulOp, Requantize, read_core
from rangeprof.byoc.npu.tiling import plan_tiles
from rangeprof.byoc.plugin import Plugin, get_plugin
from rangeprof.byoc.quantized import qparams_from_profile, quantize_model
from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.ir.tracking import track_model

import onnx_builders as mb
from conftest import SHARED, zoo_model

NPU = npu.make_plugin(sram_kb=256)  # the default buffer, whatever the environment says


def layers_model():
    """Every kernel shape the NPU runs, batch 2: a padded 3×3 conv of the raw (signed) input,
    a strided conv + ReLU, a depthwise conv with dilation, a 1×1 conv, a padded grouped conv of
    a signed tensor (pad with a nonzero zero point) and a Gemm of 2 rows; sized so that a 1 KB
    buffer cuts every layer into several tiles."""
    rng = np.random.default_rng(7)
    conv = helper.make_node
    nodes = [
        conv("Conv", ["x", "w0", "b0"], ["a"], name="conv", pads=[1, 1, 1, 1]),
        conv("Conv", ["a", "w1", "b1"], ["b"], name="strided", strides=[2, 2], pads=[1, 1, 1, 1]),
        conv("Relu", ["b"], ["br"], name="relu"),
        conv(
            "Conv", ["br", "w2", "b2"], ["c"], name="dw", group=16, dilations=[2, 2], pads=[2] * 4
        ),
        conv("Conv", ["c", "w3", "b3"], ["d"], name="pointwise"),
        conv("Conv", ["d", "w4", "b4"], ["e"], name="grouped", group=2, pads=[1, 1, 1, 1]),
        conv("Flatten", ["e"], ["f"], name="flatten"),
        conv("Gemm", ["f", "w5", "b5"], ["y"], name="fc", transB=1),
    ]
    shapes = {
        "w0": (16, 4, 3, 3),
        "w1": (16, 16, 3, 3),
        "w2": (16, 1, 3, 3),
        "w3": (24, 16, 1, 1),
        "w4": (16, 12, 3, 3),
        "w5": (5, 400),
    }
    inits = {}
    for name, shape in shapes.items():
        inits[name] = rng.normal(size=shape) / np.sqrt(np.prod(shape[1:]))
        inits[name.replace("w", "b")] = rng.normal(size=shape[0]) * 0.1
    return mb.single_io_model(nodes, inits, (2, 4, 9, 9), (2, 5))


def synthetic_qparams(path, dtype: str = "uint8") -> dict:
    """A QPARAMS document for every tensor of ``path`` without profiling (which builds and
    runs the model): seeded scales and zero points, 0 after a ReLU. Exactness between targets
    holds for any qparams; these give most convs a nonzero input zero point to pad with."""
    zero_points = (90, 160) if dtype == "uint8" else (-40, 40)
    imported = track_model(path).imported
    rng = np.random.default_rng(3)
    entries = []
    for layer in imported.layers:
        if layer.kind == "weight":
            continue
        relu = layer.source_op == "Relu"
        entries.append(
            {
                "profile_id": layer.profile_id,
                "dtype": dtype,
                "scale": float(rng.uniform(3, 8) / 255),
                "zero_point": 0 if relu else int(rng.integers(*zero_points)),
                "axis": None,
            }
        )
    model = {"name": imported.loaded.name, "sha256": imported.loaded.sha256}
    return {"model": model, "qparams": entries}


def x86_reference() -> Plugin:
    """The x86 plugin with the npu's policy, whose outputs the npu build's must equal: the
    same qparams and formulas, and every region output requantized (plain x86 leaves those
    that only FP32 operators read as scaled int32 accumulators)."""
    return dataclasses.replace(get_plugin("x86"), policy=NPU.policy)


def _lowered(path, qparams: dict, plugin: Plugin, mode: str = INT8) -> tvm.IRModule:
    """``path`` lowered for ``plugin``, every region in ``mode``, every region output exposed."""
    qm = quantize_model(path, qparams, plugin)
    assert all(r.fallback is None for r in qm.regions)
    mod, _ = qm.lower({r.name: mode for r in qm.regions}, expose=True)
    return mod


def _run(executable, x: np.ndarray) -> list[np.ndarray]:
    vm = relax.VirtualMachine(executable, tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(x))
    return [out[i].numpy() for i in range(len(out))]


def _assert_same(got: list[np.ndarray], want: list[np.ndarray]):
    assert len(got) == len(want)
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"output {index}")


@pytest.fixture(scope="module")
def layers(tmp_path_factory):
    """The layers model lowered for x86 and npu, and the x86 build's outputs on one input."""
    path = mb.save(layers_model(), tmp_path_factory.mktemp("npu"))
    qparams = synthetic_qparams(path)
    x = np.random.default_rng(1).standard_normal((2, 4, 9, 9)).astype("float32")
    reference = x86_reference()
    want = _run(reference.compile(_lowered(path, qparams, reference)), x)
    return _lowered(path, qparams, NPU), x, want


def test_plugin_registered():
    plugin = get_plugin("npu")
    assert plugin.name == "npu" and plugin.external == "rangeprof_npu"
    x86 = get_plugin("x86").policy
    assert (plugin.policy.activation_scheme, plugin.policy.activation_dtype) == ("asym", "uint8")
    assert plugin.policy.calibration() == x86.calibration()  # the same qparams as x86
    assert plugin.policy.weight_granularity == x86.weight_granularity == "per-channel"
    assert plugin.policy.integer_outputs  # integer-only hardware
    assert plugin.policy.wide_activations == x86.wide_activations == "int16"
    assert tvm.get_global_func("relax.ext.rangeprof_npu", allow_missing=True) is not None


def test_every_layer_equals_x86(layers):
    mod, x, want = layers
    ops = [read_core(func) for func in offloaded(mod)]
    convs = [op for op in ops if isinstance(op, Conv2dOp)]
    assert len(convs) == 5 and len(ops) == 6
    assert any(any(op.padding) and op.pad_value != 0 for op in convs)  # pads with z_x
    assert any(any(op.padding) and op.pad_value == 0 for op in convs)  # the conv's own padding
    assert {op.groups for op in convs} == {1, 2, 16}
    assert {op.strides for op in convs} == {(1, 1), (2, 2)}
    assert {op.dilation for op in convs} == {(1, 1), (2, 2)}
    assert any(op.weight.shape[2:] == (1, 1) for op in convs)
    plans = npu.tile_plans(mod, sram_kb=256)
    assert all(p.tiles == p.images for p in plans.values())  # 256 KB: one tile per image
    _assert_same(_run(npu.compile_npu(mod, sram_kb=256), x), want)


def test_small_buffer_tiles_and_still_equals_x86(layers):
    mod, x, want = layers
    plans = npu.tile_plans(mod, sram_kb=1)
    for plan in plans.values():
        assert plan.footprint <= 1024
        assert plan.tiles > plan.images, plan.to_json()
    assert any(p.channel_tiles > 1 and p.op == "conv2d" for p in plans.values())
    assert any(p.channel_tiles > 1 and p.op == "matmul" for p in plans.values())
    source = npu.c_program(mod, sram_kb=1)
    for plan in plans.values():
        assert plan.describe().split("\n")[0] in source
    _assert_same(_run(npu.compile_npu(mod, sram_kb=1), x), want)


def test_buffer_size_from_environment(layers, monkeypatch):
    """``get_plugin`` reads the size once, into the plugin; its code generation then reads the
    plugin, not the environment."""
    mod, _, _ = layers
    monkeypatch.setenv("RANGEPROF_NPU_SRAM_KB", "1")
    plugin = get_plugin("npu")
    assert plugin.options == {"sram_kb": 1}
    monkeypatch.setenv("RANGEPROF_NPU_SRAM_KB", "2")
    plans = npu.tile_plans(mod, sram_kb=1)
    assert plugin.describe(mod) == {symbol: plan.to_json() for symbol, plan in plans.items()}
    monkeypatch.setenv("RANGEPROF_NPU_SRAM_KB", "lots")
    with pytest.raises(RangeprofError, match="RANGEPROF_NPU_SRAM_KB"):
        get_plugin("npu")


def test_export_library_round_trip(layers, tmp_path):
    mod, x, want = layers
    executable = npu.compile_npu(mod, sram_kb=2)
    assert "c" in {m.kind for m in executable.mod.imports[0].imports}  # the C source module
    library = tmp_path / "model.so"
    NPU.export(executable, library)
    loaded = tvm.runtime.load_module(str(library))
    _assert_same(_run(loaded, x), want)


@pytest.mark.parametrize(("builder", "shape"), [(mb.conv_bias, (1, 3, 6, 6)), (mb.gemm, (2, 8))])
def test_int8_activations_equal_x86(builder, shape, tmp_path):
    """Signed 8-bit activations (the other kernel variants) are as exact."""
    path = mb.save(builder(), tmp_path)
    qparams = synthetic_qparams(path, "int8")
    mod = _lowered(path, qparams, NPU)
    assert {read_core(f).in_dtype for f in offloaded(mod)} == {"int8"}
    x = np.random.default_rng(2).standard_normal(shape).astype("float32")
    reference = x86_reference()
    want = _run(reference.compile(_lowered(path, qparams, reference)), x)
    _assert_same(_run(npu.compile_npu(mod, sram_kb=1), x), want)


@pytest.fixture(scope="module")
def int16_layers(tmp_path_factory):
    """The layers model with every region on int16 activations (mode INT16) for the npu, and
    the x86 build's outputs (the npu's policy) on one input."""
    path = mb.save(layers_model(), tmp_path_factory.mktemp("npu16"))
    qparams = synthetic_qparams(path)
    x = np.random.default_rng(1).standard_normal((2, 4, 9, 9)).astype("float32")
    reference = x86_reference()
    want = _run(reference.compile(_lowered(path, qparams, reference, INT16)), x)
    return _lowered(path, qparams, NPU, INT16), x, want


def test_int16_layers_equal_x86(int16_layers):
    """Every kernel shape on int16 × int8 → int16, tiled to 2 KB (the matmul's 400 int16 inputs
    do not fit 1 KB), equals x86 with the npu's policy bit for bit."""
    mod, x, want = int16_layers
    ops = [read_core(func) for func in offloaded(mod)]
    assert len(ops) == 6 and all(op.symbol.endswith("_int16") for op in ops)
    assert {(op.in_dtype, op.out_dtype) for op in ops} == {("int16", "int16")}
    convs = [op for op in ops if isinstance(op, Conv2dOp)]
    # Symmetric (z = 0): the 3×3 convs pad themselves with zeros, no pad binding.
    assert any(op.weight.shape[2:] == (3, 3) and any(op.padding) for op in convs)
    assert all(op.pad_value == 0 for op in convs)
    assert any(op.groups == 16 == op.in_shape[1] for op in convs)  # depthwise
    assert any(isinstance(op, MatmulOp) for op in ops)
    relu = next(op.requantize for op in convs if op.requantize.lo == 0)
    assert relu.hi == 32767  # clamped to the int16 range after a ReLU
    for plan in npu.tile_plans(mod, sram_kb=2).values():
        assert plan.tiles > plan.images, plan.to_json()
    _assert_same(_run(npu.compile_npu(mod, sram_kb=2), x), want)
    _assert_same(_run(npu.compile_npu(mod, sram_kb=256), x), want)


def test_int16_tiles_take_two_bytes_an_element(int16_layers):
    """The input and output sections of an int16 region are twice its 8-bit twin's, and every
    section starts aligned for its type."""
    mod, _, _ = int16_layers
    for func in offloaded(mod):
        op = read_core(func)
        plan = plan_tiles(op, 1 << 20)  # one tile per image: the same tile for both types
        narrow = plan_tiles(dataclasses.replace(op, in_dtype="uint8", out_dtype="uint8"), 1 << 20)
        assert (plan.channels, plan.rows) == (narrow.channels, narrow.rows)
        assert plan.sections["input"] == 2 * narrow.sections["input"]
        assert plan.sections["output"] == 2 * narrow.sections["output"]
        assert all(plan.offset(name) % 2 == 0 for name in plan.sections)
    # The Gemm, 400 deep: 10 (9, aligned) + 400 weights + 2 · 400 inputs + 2 · 1 output.
    with pytest.raises(RangeprofError, match=r"matmul_relax_add_int16 needs 1212 bytes"):
        npu.tile_plans(mod, sram_kb=1)


@pytest.mark.zoo
def test_accuracy_budget_keeps_sensitive_layers_on_int16(digits_profile, tmp_path):
    """digits_cnn with the range of ``/Mul`` (region 1's output, region 2's input) 80 times too
    wide: the budget keeps the layers on the NPU on int16 instead of FP32, the artifact's
    manifest says so, and its library equals x86 with the npu's policy and the same modes.
    Integer-only, region 1 requantizes its output to 8 bits on ``/Mul``'s coarse grid, so both
    it and its reader (``/Relu_1``, the worst layer) are widened; x86 hands an int16 layer
    its producer's int32 accumulator in FP32 and widens ``/Relu_1`` alone."""
    model = zoo_model("digits_cnn")
    doc = qparams_from_profile(digits_profile, NPU, "max", 99.99)
    for entry in doc["qparams"]:
        if entry["profile_id"] == "/Mul":
            entry["scale"] *= 80
    qm = quantize_model(model, doc, NPU)
    fitted = fit_budget(qm, f"{SHARED}/data/digits.npz:test", 0.5, samples=150)
    assert fitted.drop <= 0.5
    assert (fitted.kept_int16, fitted.kept_fp32) == (["/Mul", "/Relu_1"], [])
    kept = frozenset(fitted.kept_int16)
    manifest = build_artifact(qm, tmp_path, kept_int16=kept)
    assert manifest["library"] == LIBRARY
    assert manifest["kept_int16"] == ["/Mul", "/Relu_1"] and manifest["kept_fp32"] == []
    assert manifest["policy"]["sensitive_layers"] == "sym int16 activations"
    regions = {r["name"]: r for r in manifest["regions"]}
    widened = [r for r in qm.regions if r.output_id in kept]
    assert len(widened) == 2
    for region in widened:
        entry = regions[region.name]
        assert entry["mode"] == INT16
        assert entry["target"]["symbol"] == f"{region.name}_int16"  # run by the NPU
    assert [r["mode"] for r in manifest["regions"]].count(INT8) == len(regions) - 2

    reference = quantize_model(model, doc, x86_reference())
    modes = {r.name: INT16 if r.output_id in kept else INT8 for r in reference.regions}
    want = relax.VirtualMachine(reference.plugin.compile(reference.lower(modes)[0]), tvm.cpu())
    got = relax.VirtualMachine(tvm.runtime.load_module(str(tmp_path / LIBRARY)), tvm.cpu())
    images = np.load(SHARED / "data" / "digits.npz")["test"][:4].astype("float32")
    for i in range(len(images)):
        image = tvm.runtime.tensor(images[i : i + 1])
        np.testing.assert_array_equal(got["main"](image).numpy(), want["main"](image).numpy())


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
@pytest.mark.parametrize("program", ["layers", "int16_layers"])
def test_emitted_code_is_c99(program, request, tmp_path):
    mod, _, _ = request.getfixturevalue(program)
    source = tmp_path / "npu.c"
    source.write_text(npu.c_program(mod, sram_kb=2))
    include = tvm_ffi.libinfo.find_include_path()
    flags = ["-std=c99", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", f"-I{include}"]
    subprocess.run(["gcc", *flags, str(source)], check=True)


def test_tiling_rule():
    """Most channels with one row first, then most rows; grouped blocks never straddle.

    A 3×3 conv, 8 → 8 channels in 4 groups, 16×16 → 14×14: a tile of ``tc`` channels by ``tr``
    rows takes 4·14 (accumulators) + 9·tc (params) + 18·tc (weights) + 2·max(1, tc // 2)·(tr +
    2)·16 (input window) + 14·tc·tr (output) bytes."""
    op = _conv_op(in_shape=(1, 8, 16, 16), weight_shape=(8, 2, 3, 3), groups=4)
    whole = plan_tiles(op, 1 << 20)
    assert (whole.channels, whole.rows, whole.tiles) == (8, 14, 1)
    # 356 bytes: 4 channels need 412 with one row; 3 would fit (275) but straddle two groups.
    plan = plan_tiles(op, 356)
    assert (plan.channels, plan.rows, plan.footprint) == (2, 3, 354)
    assert (plan.channel_tiles, plan.row_tiles, plan.tiles) == (4, 5, 20)
    sections = {"accumulators": 56, "params": 18, "weights": 36, "input": 160, "output": 84}
    assert plan.sections == sections
    assert plan.offset("input") == 56 + 18 + 36
    with pytest.raises(RangeprofError, match=r"needs 193 bytes of on-chip buffer"):
        plan_tiles(op, 150)


def _conv_op(in_shape, weight_shape, groups) -> Conv2dOp:
    k = weight_shape[0]
    n, _, h, w = in_shape
    requantize = Requantize(
        bias=np.zeros(k, np.int32),
        multiplier=np.full(k, 1 << 30, np.int32),
        shift=np.full(k, 31, np.uint8),
        zero_point=0,
        lo=0,
        hi=255,
    )
    return Conv2dOp(
        symbol="conv",
        in_dtype="uint8",
        out_dtype="uint8",
        in_shape=in_shape,
        out_shape=(n, k, h - weight_shape[2] + 1, w - weight_shape[3] + 1),
        weight=np.ones(weight_shape, np.int8),
        strides=(1, 1),
        dilation=(1, 1),
        padding=(0, 0, 0, 0),
        pad_value=0,
        groups=groups,
        requantize=requantize,
    )


def _core(body) -> relax.Function:
    """A Codegen-marked function of a uint8 [4, 8] input whose body ``body(x)`` computes."""
    bb = relax.BlockBuilder()
    x = relax.Var("xq", relax.TensorType((4, 8), "uint8"))
    with bb.function("bad_int8", [x]):
        with bb.dataflow():
            out = bb.emit_output(body(x))
        bb.emit_func_output(out)
    func = bb.get()["bad_int8"]
    return func.with_attrs({"Codegen": "rangeprof_npu", "global_symbol": "bad_int8"})


def _with_rounding_off_by_one(func: relax.Function) -> relax.Function:
    """``func`` (a canonical core) rebuilt with its rounding constant ``2^(S-1) + 1``."""
    bb = relax.BlockBuilder()
    x = relax.Var("xq", func.params[0].ty)
    remap = {func.params[0]: x}
    with bb.function("bad_int8", [x]):
        with bb.dataflow():
            *body, last = func.body.blocks[0].bindings
            for binding in body:
                call = binding.value
                args = [remap.get(a, a) for a in call.args]
                if str(call.op.name) == "relax.add" and str(call.ty.dtype) == "int64":
                    args[1] = relax.const(args[1].value.numpy() + 1, "int64")
                remap[binding.var] = bb.emit(relax.Call(call.op, args, call.attrs))
            out = bb.emit_output(
                relax.Call(last.value.op, [remap[last.value.args[0]]], last.value.attrs)
            )
        bb.emit_func_output(out)
    func = bb.get()["bad_int8"]
    return func.with_attrs({"Codegen": "rangeprof_npu", "global_symbol": "bad_int8"})


def test_non_canonical_core_is_a_clear_error(layers):
    with pytest.raises(RangeprofError, match=r"bad_int8 is not a canonical .* computes relax\.add"):
        read_core(_core(lambda x: relax.op.add(x, x)))
    mod, _, _ = layers
    canonical = next(f for _, f in mod.functions_items() if "Codegen" in (f.attrs or {}))
    bad = tvm.IRModule({"bad_int8": _with_rounding_off_by_one(canonical)})
    with pytest.raises(RangeprofError, match=r"rounding constant must be 2\^\(shift-1\)"):
        npu.compile_npu(bad, sram_kb=256)
    with pytest.raises(RuntimeError, match="rounding constant"):  # through RunCodegen too
        relax.transform.RunCodegen({"rangeprof_npu": {"sram_kb": 256}})(bad)


@pytest.mark.zoo
def test_digits_cnn_equals_x86(tmp_path):
    """The shared CNN on real images: the exported npu library's model output and every region
    output equal the x86 build's (synthetic qparams: profiling would triple the test's time,
    and exactness holds for any)."""
    path = zoo_model("digits_cnn")
    qparams = synthetic_qparams(path)
    reference = x86_reference()
    want = reference.compile(_lowered(path, qparams, reference))
    library = tmp_path / "model.so"
    NPU.export(NPU.compile(_lowered(path, qparams, NPU)), library)
    loaded = tvm.runtime.load_module(str(library))
    images = np.load(SHARED / "data" / "digits.npz")["test"][:4].astype("float32")
    for i in range(len(images)):
        _assert_same(_run(loaded, images[i : i + 1]), _run(want, images[i : i + 1]))
