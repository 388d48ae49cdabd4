"""The FP32 CPU build's kernels for what audio and detection models use: conv1d (a conv2d of
height one, its channels and frames padded to whole register tiles), ConvTranspose (the packed
sub-pixel kernel) and Resize. Each model's output is compared with onnxruntime, and the kernel
is checked to be the rule's (its PrimFunc after the schedules), not the generic fallback. The
x86 INT8 build quantizes conv1d as the conv2d it became.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tvm
from onnx import helper
from tvm import relax, tirx

from rangeprof.byoc.cpu import integer_rules
from rangeprof.byoc.evaluate import evaluate
from rangeprof.byoc.plugin import get_plugin
from rangeprof.byoc.quantized import qparams_from_profile, quantize_model
from rangeprof.byoc.x86.isa import ISA as X86_ISA
from rangeprof.profiler.compile.schedules import build, host_target, relax_pipeline
from rangeprof.profiler.compile.schedules.conv1d import padded_tiling
from rangeprof.profiler.compile.schedules.isa import vector_unit
from rangeprof.profiler.ir.importer import import_onnx
from rangeprof.profiler.ir.onnx_load import load_model_bytes
from rangeprof.profiler.profiling.run import ProfileOptions, profile_model

from onnx_builders import save, single_io_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.audio_models import conv1d_encoder, log_mel, power_spectrum

RTOL, ATOL = 1e-4, 1e-5


def _imported(model) -> tvm.IRModule:
    return import_onnx(load_model_bytes(model.SerializeToString(), "model.onnx")).mod


def _ours(model, x: np.ndarray) -> np.ndarray:
    vm = relax.VirtualMachine(build(_imported(model)), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def _onnxruntime(model, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _assert_matches_onnxruntime(model, x: np.ndarray) -> None:
    expected = _onnxruntime(model, x)
    scale = max(float(np.abs(expected).max()), 1.0)
    np.testing.assert_allclose(_ours(model, x), expected, rtol=RTOL, atol=ATOL * scale)


def _kernels(model, mod: tvm.IRModule | None = None, **pipeline) -> dict[str, str]:
    """Every PrimFunc of the build of ``model`` (or of ``mod``) after the schedules, as
    TVMScript, by name; ``pipeline``: :func:`relax_pipeline`'s options."""
    lowered = relax_pipeline(host_target(), **pipeline)(mod or _imported(model))
    return {
        gvar.name_hint: func.script()
        for gvar, func in lowered.functions_items()
        if isinstance(func, tirx.PrimFunc)
    }


def _input(model, seed: int = 1) -> np.ndarray:
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def test_log_mel_matches_onnxruntime_on_the_padded_row_conv():
    """257 frequency bins and 101 frames (both prime): the STFT convs run on channels padded to
    whole vectors of the host (272 on AVX-512: 17 vectors) and on frames padded until a
    register tile holds half the accumulators (102 frames, tiles of 17), unrolled, vectorised,
    parallel; no kernel is TVM's own conv1d."""
    model = log_mel()
    _assert_matches_onnxruntime(model, _input(model) * 0.1)

    unit = vector_unit(host_target())
    ob, channels, frames = padded_tiling(101, 257, unit)
    assert (channels, frames) != (257, 101)
    kernels = _kernels(model)
    assert not any("conv1d_ncw" in script for script in kernels.values())
    convs = [s for s in kernels.values() if 'T.sblock("conv2d_nhwc_packed_update")' in s]
    assert convs  # the two STFT convs share their kernel
    for script in convs:
        assert f"T.int64({channels})" in script and 'T.sblock("conv1d_crop")' in script
        assert f"T.unroll(T.int64({unit.tile(frames, ob)}))" in script
        assert f"T.vectorized(T.int64({unit.lanes}))" in script and "T.parallel(" in script


@pytest.mark.parametrize("frames", [97, 128])
def test_conv1d_encoder_matches_onnxruntime(frames):
    """A stack of conv1d (kernel 3, strides 1 and 2) with ReLU, on a frame count that needs
    padding and on one that does not."""
    model = conv1d_encoder(frames=frames)
    _assert_matches_onnxruntime(model, _input(model))


def _quantized(model, tmp_path):
    """``model`` quantized for x86 on a profile of 8 random samples."""
    x86 = get_plugin("x86")
    path = save(model, tmp_path)
    profile = profile_model(path, "random", options=ProfileOptions(samples=8))
    return quantize_model(path, qparams_from_profile(profile, x86, "max", 99.99), x86)


def test_int8_build_quantizes_conv1d_as_conv2d(tmp_path):
    """Every conv1d of the encoder is an INT8 conv2d region whose input is the tensor the conv1d
    read (its ``expand_dims`` carries that tensor's profileID), and the INT8 output stays close to
    the FP32 one."""
    qm = _quantized(conv1d_encoder(widths=(64, 64, 32)), tmp_path)

    # The squeeze back to 3-D sits between the conv and its bias: a region is the conv alone.
    regions = {r.output_id: r for r in qm.regions}
    assert sorted(regions) == ["conv0#0", "conv1#0", "conv2#0"]
    assert {r.pattern for r in regions.values()} == {"rangeprof_x86.conv2d"}
    assert all(r.fallback is None for r in regions.values())
    assert regions["conv0#0"].input.profile_id == "input:x"
    assert regions["conv2#0"].input.profile_id == "relu1"
    assert "R.nn.conv2d(" in qm.lower()[0].script()
    assert evaluate(qm, "random", samples=4).output.sqnr_db > 25


def test_int8_stft_folds_taps_into_channels(tmp_path):
    """One audio channel, stride 160: four taps fold into the four channels of one dot
    instruction (128 taps of 4, not 512 of 1 padded to 4), the 257 bins padded to 272 and
    cropped, and the INT8 power spectrum stays close to the FP32 one."""
    qm = _quantized(power_spectrum(), tmp_path)
    assert {(r.pattern, r.fallback) for r in qm.regions} == {("rangeprof_x86.conv2d", None)}
    rules = integer_rules(X86_ISA)
    kernels = _kernels(None, qm.lower()[0], fold_scales=False, rules=rules)
    (script,) = [s for s in kernels.values() if 'T.sblock("conv2d_int8_init")' in s]
    assert "T.int64(128)" in script and "T.int64(272)" in script
    assert 'T.sblock("int8_row_conv_crop")' not in script  # inlined in the epilogue
    assert evaluate(qm, "random", samples=2).output.sqnr_db > 30


def _conv_transpose(c_in, c_out, hw, kernel, stride, pad=0, epilogue=(), seed=0, **attrs):
    """ConvTranspose with bias, then ``epilogue`` (ONNX op types applied in turn)."""
    rng = np.random.default_rng(seed)
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    sh, sw = (stride, stride) if isinstance(stride, int) else stride
    groups = attrs.get("group", 1)
    dh, dw = attrs.get("dilations", (1, 1))
    out_pad = attrs.get("output_padding", (0, 0))
    inits = {
        "w": rng.normal(size=(c_in, c_out // groups, kh, kw)) / np.sqrt(c_in),
        "b": rng.normal(size=c_out),
    }
    names = ["c", *(f"e{i}" for i in range(len(epilogue)))]
    names[-1] = "y"
    nodes = [
        helper.make_node(
            "ConvTranspose",
            ["x", "w", "b"],
            [names[0]],
            kernel_shape=[kh, kw],
            strides=[sh, sw],
            pads=[pad] * 4,
            **attrs,
        )
    ]
    nodes += [
        helper.make_node(op, [a], [b])
        for op, a, b in zip(epilogue, names[:-1], names[1:], strict=True)
    ]
    oh = (hw - 1) * sh - 2 * pad + dh * (kh - 1) + out_pad[0] + 1
    ow = (hw - 1) * sw - 2 * pad + dw * (kw - 1) + out_pad[1] + 1
    return single_io_model(nodes, inits, (1, c_in, hw, hw), (1, c_out, oh, ow))


TRANSPOSED = {
    "dbnet_upsample_relu": lambda: _conv_transpose(24, 24, 12, 2, 2, epilogue=["Relu"]),
    "one_channel_sigmoid": lambda: _conv_transpose(24, 1, 10, 2, 2, epilogue=["Sigmoid"]),
    "kernel4_stride2_pad1": lambda: _conv_transpose(16, 8, 9, 4, 2, pad=1),
    "output_padding": lambda: _conv_transpose(8, 5, 7, 3, 2, pad=1, output_padding=[1, 1]),
    "dilated": lambda: _conv_transpose(6, 16, 8, 3, 2, dilations=[2, 2]),
    "stride3": lambda: _conv_transpose(4, 12, 6, 5, 3, pad=2),
    "unequal_strides": lambda: _conv_transpose(8, 16, 6, (3, 2), (2, 1)),
    "grouped": lambda: _conv_transpose(8, 8, 6, 2, 2, group=2),
}


@pytest.mark.parametrize("case", sorted(TRANSPOSED))
def test_conv_transpose_matches_onnxruntime(case):
    model = TRANSPOSED[case]()
    _assert_matches_onnxruntime(model, _input(model))


def test_conv_transpose_runs_the_packed_sub_pixel_kernel():
    """Phases of the stride in the packed weights' last axis (2 × 24 outputs), a 16-lane vector
    of them against a broadcast input, the epilogue in the same kernel."""
    kernels = _kernels(TRANSPOSED["dbnet_upsample_relu"]())
    (script,) = [s for s in kernels.values() if "conv2d_transpose_nhwc_packed_update" in s]
    assert "T.int64(48)" in script and "T.vectorized(T.int64(16))" in script
    assert "T.parallel(" in script and "T.max(" in script  # the ReLU


def _resize(channels, hw, scale, mode, coordinates="asymmetric", concat=False):
    """Conv → Resize (→ Concat with a second resize of the same map, as FPN necks do)."""
    rng = np.random.default_rng(3)
    inits = {"w": rng.normal(size=(channels, channels, 1, 1)), "scales": [1, 1, scale, scale]}
    nearest = {"nearest_mode": "floor"} if mode == "nearest" else {}
    resize = {"mode": mode, "coordinate_transformation_mode": coordinates, **nearest}
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"]),
        helper.make_node("Resize", ["c", "", "scales"], ["r" if concat else "y"], **resize),
    ]
    out = int(hw * scale)
    if concat:
        inits["twice"] = [1, 1, 2 * scale, 2 * scale]
        inits["half"] = [1, 1, 0.5, 0.5]
        nodes += [
            helper.make_node("Resize", ["c", "", "half"], ["small"], **resize),
            helper.make_node("Resize", ["small", "", "twice"], ["r2"], **resize),
            helper.make_node("Concat", ["r", "r2"], ["y"], axis=1),
        ]
    return single_io_model(
        nodes, inits, (1, channels, hw, hw), (1, channels * (1 + concat), out, out)
    )


RESIZES = {
    "nearest_x4": lambda: _resize(24, 6, 4, "nearest"),
    "linear_half_pixel": lambda: _resize(16, 7, 2, "linear", "half_pixel"),
    "linear_align_corners": lambda: _resize(8, 5, 2, "linear", "align_corners"),
    "three_channels": lambda: _resize(3, 6, 2, "nearest"),
    "nearest_concat": lambda: _resize(24, 8, 2, "nearest", concat=True),
}


@pytest.mark.parametrize("case", sorted(RESIZES))
def test_resize_matches_onnxruntime(case):
    model = RESIZES[case]()
    _assert_matches_onnxruntime(model, _input(model))


def test_resize_vectorises_channels_per_pixel():
    """A concat of two resized 24-channel maps: 8-lane vectors (16 would straddle two maps'
    channels), the rows parallel, no lane computing its own pixel coordinates."""
    kernels = _kernels(RESIZES["nearest_concat"]())
    (script,) = [s for s in kernels.values() if "concatenate" in s]
    assert "T.vectorized(T.int64(8))" in script and "T.parallel(" in script
