"""Activations, epilogues and reductions around convs and dense layers in the fast FP32 build.

SiLU, HardSwish and HardSigmoid after dense, depthwise and grouped convs fuse into the conv's
kernel; ``exp``, ``tanh`` and ``sigmoid`` are vector arithmetic (no libm call per element);
reductions that keep their last axis read it in vectors; a 1-D conv laid out along H tiles
down its column. Each test compares with onnxruntime (or numpy) and checks, on the lowered
program, that the schedule was the one meant.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from onnx import helper
from tvm import relax

from rangeprof.profiler.compile.schedules import build
from rangeprof.profiler.compile.schedules.activations import as_extrema
from rangeprof.profiler.ir.importer import import_onnx
from rangeprof.profiler.ir.onnx_load import load_model_bytes
from rangeprof.profiler.ir.spans import ids_of

from schedule_checks import (
    assert_matches_onnxruntime,
    kernel_calls,
    kernel_scripts,
    lowered,
    onnx_model,
)

C, HW = 32, 12
LIBM = re.compile(r"T\.(exp|tanh|sigmoid|pow)\(")


def _conv(name: str, inp: str, out: str, group: int, rng) -> tuple:
    inits = {
        f"{name}_w": rng.normal(size=(C, C // group, 3, 3)) / np.sqrt(9 * C // group),
        f"{name}_b": rng.normal(size=C) * 0.5,
    }
    node = helper.make_node("Conv", [inp, *inits], [out], pads=[1, 1, 1, 1], group=group, name=name)
    return node, inits


def _activated_convs():
    """A dense conv + SiLU (YOLOv8), a depthwise conv + HardSwish (PP-LCNet, MobileNetV3), a
    grouped conv + x · HardSigmoid(x)."""
    rng = np.random.default_rng(0)
    nodes, inits = [], {}
    for name, inp, out, group in (
        ("dense", "x", "a", 1),
        ("dw", "s", "b", C),
        ("grp", "h", "c", 4),
    ):
        node, weights = _conv(name, inp, out, group, rng)
        nodes.append(node)
        inits.update(weights)
    nodes[1:1] = [
        helper.make_node("Sigmoid", ["a"], ["as"]),
        helper.make_node("Mul", ["a", "as"], ["s"]),
    ]
    nodes[4:4] = [helper.make_node("HardSwish", ["b"], ["h"], name="hswish")]
    nodes += [
        helper.make_node("HardSigmoid", ["c"], ["cs"], alpha=1 / 6, beta=0.5),
        helper.make_node("Mul", ["c", "cs"], ["y"]),
    ]
    shape = [1, C, HW, HW]
    return onnx_model(nodes, inits, {"x": shape}, {"y": shape})


def test_activations_fuse_into_dense_depthwise_and_grouped_convs():
    """Three kernels, one per conv, each with its activation and no transpose between them
    (the HardSwish / HardSigmoid clips once sent the layout back to NCHW), vectorised, no libm
    call; the grouped conv is the packed conv kernel, not TVM's scalar one; the depthwise conv
    (32 channels: whole vectors) reads its input through the padding test, no padded copy; the
    dense one has one."""
    model = _activated_convs()
    program = lowered(model)
    assert_matches_onnxruntime(model, program)

    names = [c.op.name_hint for c in kernel_calls(program)]
    convs = [n for n in names if "conv2d" in n]
    assert len(convs) == 3 and len(names) == 5, names  # the input's and output's transposes
    assert "sigmoid_multiply" in convs[0]
    assert all(re.search(r"maximum.*minimum.*multiply", n) for n in convs[1:])
    assert convs[2].startswith("fused_grouped_conv2d_nhwc_packed")
    scripts = kernel_scripts(program)
    for name in convs:
        assert "T.vectorized(" in scripts[name] and not LIBM.search(scripts[name]), name
    assert 'sblock("conv_pad")' not in scripts[convs[1]]
    # A dense conv keeps its padded copy: channel-blocked where its input channels take more
    # than one pass of the reduction (on AVX-512 hosts here, whose output blocks are wider).
    assert re.search(r'sblock\("conv_(pad|input_blocked)"\)', scripts[convs[0]])


@pytest.mark.parametrize("alpha", [0.2, 1.5, -0.5])
def test_leaky_relu_and_a_max_fuse_into_the_conv(alpha):
    """Conv → LeakyReLU → Max with a constant (a speech CNN's block) → conv is two kernels: no
    transpose back to NCHW around the LeakyReLU, no stacked copy reduced for the Max; the
    same values as onnxruntime, and LeakyReLU's bit for bit where its input is NaN, ±0 or ±inf."""
    rng = np.random.default_rng(4)
    first, inits = _conv("first", "x", "a", 1, rng)
    second, more = _conv("second", "c", "d", 1, rng)
    inits |= more | {"floor": np.full((1, 1, 1, 1), -0.4)}
    nodes = [
        first,
        helper.make_node("LeakyRelu", ["a"], ["b"], alpha=alpha),
        helper.make_node("Max", ["b", "floor"], ["c"]),
        second,
        helper.make_node("LeakyRelu", ["d"], ["y"], alpha=alpha),
    ]
    shape = [1, C, HW, HW]
    model = onnx_model(nodes, inits, {"x": shape}, {"y": shape})
    program = lowered(model)
    assert_matches_onnxruntime(model, program)
    names = [c.op.name_hint for c in kernel_calls(program)]
    assert len(names) == 4, names  # the input's and output's transposes
    assert all(re.search(r"conv2d.*(maximum|minimum)", n) for n in names[1:3]), names

    edges = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 3.0, -3.0, 1e-45], np.float32)
    node = helper.make_node("LeakyRelu", ["x"], ["y"], alpha=alpha)
    plain = onnx_model([node], {}, {"x": [edges.size]}, {"y": [edges.size]})
    mod = import_onnx(load_model_bytes(plain.SerializeToString(), "leaky.onnx")).mod
    vm = relax.VirtualMachine(build(mod), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(edges)).numpy()
    want = np.where(edges > 0, edges, edges * np.float32(alpha))
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize(
    ("c_in", "c_out", "group", "stride"),
    [(32, 64, 4, 1), (16, 32, 16, 1), (24, 48, 2, 2)],
    ids=["4_groups", "channel_multiplier_2", "groups_of_24_stride2"],
)
def test_grouped_convs_are_the_packed_kernel(c_in, c_out, group, stride):
    """Groups of any width (a depthwise conv with a channel multiplier: groups of one input
    channel) run the packed conv kernel, vectorised, and match onnxruntime."""
    rng = np.random.default_rng(6)
    inits = {"w": rng.normal(size=(c_out, c_in // group, 3, 3)) / 5, "b": rng.normal(size=c_out)}
    node = helper.make_node(
        "Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1], group=group, strides=[stride] * 2
    )
    out = (HW - 1) // stride + 1
    model = onnx_model([node], inits, {"x": [1, c_in, HW, HW]}, {"y": [1, c_out, out, out]})
    program = lowered(model)
    assert_matches_onnxruntime(model, program)
    (conv,) = [c for c in kernel_calls(program) if "conv2d" in c.op.name_hint]
    assert conv.op.name_hint.startswith("fused_grouped_conv2d_nhwc_packed")
    assert "T.vectorized(" in program[conv.op].script()


def test_clip_bounds_keep_the_clips_profile_ids():
    """The ``minimum`` that ends a rewritten clip carries the clip's span (its profileIDs)."""
    mod = import_onnx(load_model_bytes(_activated_convs().SerializeToString(), "m.onnx")).mod
    calls = [b.value for b in mod["main"].body.blocks[0].bindings]
    clips = [ids_of(c) for c in calls if isinstance(c, relax.Call) and c.op.name == "relax.clip"]
    rewritten = as_extrema(mod)
    calls = [b.value for b in rewritten["main"].body.blocks[0].bindings]
    assert not any(isinstance(c, relax.Call) and c.op.name == "relax.clip" for c in calls)
    minima = [ids_of(c) for c in calls if c.op.name == "relax.minimum"]
    assert len(clips) == 2 and all(ids for ids in clips) and minima == clips


def _unary(op, size: int) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((size,), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(op(x))
        bb.emit_func_output(y)
    return bb.get()


EDGES = [np.nan, np.inf, -np.inf, 0.0, -0.0, 88.5, 88.72, 89.0, -87.3, -88.0, -104.0, 1e-30]


@pytest.mark.parametrize(
    ("op", "reference", "ulps"),
    [
        (relax.op.exp, np.exp, 2),
        (relax.op.tanh, np.tanh, 7),
        (relax.op.sigmoid, lambda x: 1 / (1 + np.exp(-x)), 3),
    ],
    ids=["exp", "tanh", "sigmoid"],
)
def test_vector_math_is_accurate_and_calls_no_libm(op, reference, ulps):
    """Within a few ulps of float64 numpy over [-100, 100] (normal results), the edges as libm
    has them (NaN, ±inf, overflow to inf, 0 below exp's normal range), no ``expf`` / ``tanhf``
    call in the machine code."""
    grid = np.concatenate([np.linspace(-100, 100, 40000), np.linspace(-10, 10, 40000), EDGES])
    x = np.pad(grid, (0, -len(grid) % 16)).astype(np.float32)
    executable = build(_unary(op, len(x)))
    llvm = next(m for m in executable.mod.imports if m.kind == "llvm")
    assert not re.search(r"call.*(expf|tanhf)", llvm.inspect_source("asm"))
    got = relax.VirtualMachine(executable, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    with np.errstate(over="ignore"):
        want = reference(x.astype(np.float64))
    normal = (np.abs(want) > np.finfo(np.float32).tiny) & (np.abs(want) < np.finfo(np.float32).max)
    spacing = np.spacing(np.abs(want[normal]).astype(np.float32))
    assert np.max(np.abs(got[normal] - want[normal]) / spacing) <= ulps
    edges = np.isin(x, np.float32(EDGES)) & ~normal
    tiny = edges & (np.abs(want) < np.finfo(np.float32).tiny)  # subnormal, or flushed to 0
    assert np.all(np.abs(got[tiny] - want[tiny]) < np.finfo(np.float32).tiny)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(got[edges & ~tiny], want[edges & ~tiny].astype(np.float32))


@pytest.mark.parametrize("cube", ["products", "pow"])
def test_dense_with_a_tanh_gelu_keeps_the_epilogue_in_the_tile(cube, capfd):
    """MatMul → bias → GELU in its tanh form (Magika's dense layers; GPT-2's export cubes with
    ``Pow(a, 3)``): one kernel, the tanh and the cube as vector arithmetic in the register
    tile's epilogue, and no warning of TVM's about ``pow``."""
    rng = np.random.default_rng(3)
    inits = {"w": rng.normal(size=(48, 64)) / 7, "b": rng.normal(size=64)}
    inits.update(k=0.044715, s=np.sqrt(2 / np.pi), one=1.0, half=0.5, three=3.0)
    cubed = [helper.make_node("Pow", ["a", "three"], ["a3"])]
    if cube == "products":
        cubed = [
            helper.make_node("Mul", ["a", "a"], ["a2"]),
            helper.make_node("Mul", ["a2", "a"], ["a3"]),
        ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["a"]),
        *cubed,
        helper.make_node("Mul", ["a3", "k"], ["ka3"]),
        helper.make_node("Add", ["a", "ka3"], ["inner"]),
        helper.make_node("Mul", ["inner", "s"], ["arg"]),
        helper.make_node("Tanh", ["arg"], ["t"]),
        helper.make_node("Add", ["t", "one"], ["t1"]),
        helper.make_node("Mul", ["a", "t1"], ["g"]),
        helper.make_node("Mul", ["g", "half"], ["y"]),
    ]
    model = onnx_model(nodes, inits, {"x": [1, 40, 48]}, {"y": [1, 40, 64]})
    program = lowered(model)
    assert_matches_onnxruntime(model, program)
    (call,) = kernel_calls(program)
    script = program[call.op].script()
    assert "dense_packed" in call.op.name_hint and "tanh" in call.op.name_hint
    assert not LIBM.search(script) and "T.vectorized(" in script
    assert "pow" not in capfd.readouterr().err


def _reduction(op: str, shape: list[int], out: list[int], before=None, inits=None):
    """``op`` over axis 1 (over the pixels, axes 2 and 3, of a 4-D input) after ``before``."""
    axes = [2, 3] if len(shape) == 4 else [1]
    nodes = [helper.make_node(op, ["r" if before else "x"], ["y"], axes=axes, keepdims=0)]
    if before:
        nodes.insert(0, helper.make_node(before, ["x", *(inits or {})], ["r"]))
    opset = 11 if op == "ReduceSum" else 17  # axes as an attribute
    return onnx_model(nodes, inits or {}, {"x": shape}, {"y": out}, opset=opset)


CONV_1X1 = {"w": np.random.default_rng(5).normal(size=(24, 8, 1, 1))}


@pytest.mark.parametrize(
    "model",
    [
        _reduction("ReduceSum", [1, 64, 48], [1, 48]),
        _reduction("ReduceMax", [2, 50, 40], [2, 40], before="Tanh"),
        _reduction("ReduceMean", [1, 8, 9, 11], [1, 24], before="Conv", inits=CONV_1X1),
    ],
    ids=["sum_rows", "max_of_tanh", "global_mean_after_conv"],
)
def test_reductions_keeping_the_last_axis_read_it_in_vectors(model):
    """The kept, contiguous axis is split into vector lanes under the reduced loop (contiguous
    loads) instead of a scalar strided walk, its prologue (tanh) inside as arithmetic. A mean
    over the pixels of a conv's output keeps the channels last after the layout rewrite."""
    program = lowered(model)
    assert_matches_onnxruntime(model, program)
    (script,) = [s for s in kernel_scripts(program).values() if "_init" in s and "conv" not in s]
    assert not LIBM.search(script)
    head = script.split('_update"')[0]  # the loops down to the reduction's update
    loops = [line.strip() for line in head.splitlines() if line.strip().startswith("for ")]
    lanes = [k for k, line in enumerate(loops) if "T.vectorized(" in line]
    # the init's lanes, then the reduced loop(s), then the update's lanes innermost
    assert len(lanes) == 2 and lanes[1] == len(loops) - 1 and lanes[1] > lanes[0] + 1


def test_a_conv_along_h_tiles_its_column():
    """A 5×1 conv over an H × 1 image (Magika's 1-D conv, written as a 2-D one): the register
    tile runs down the rows (their width of one would give a tile of one pixel: two
    accumulators waiting on each FMA's latency)."""
    rng = np.random.default_rng(4)
    inits = {"w": rng.normal(size=(C, 16, 5, 1)) / 9, "b": rng.normal(size=C)}
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"]),
        helper.make_node("Relu", ["c"], ["y"]),
    ]
    model = onnx_model(nodes, inits, {"x": [1, 16, 60, 1]}, {"y": [1, C, 56, 1]})
    program = lowered(model)
    assert_matches_onnxruntime(model, program)
    (conv,) = [c for c in kernel_calls(program) if "conv2d" in c.op.name_hint]
    update = program[conv.op].script().split('T.sblock("conv2d_nhwc_packed_update")')[0]
    tile = re.findall(r"T\.unroll\(T\.int64\((\d+)\)\)", update)[-1]
    assert int(tile) > 1 and 56 % int(tile) == 0
