"""Row kernels of a transformer in the fast build: softmax and layer norm rows interleaved,
exp in 16-lane vectors without subnormal slow paths, head-split transposes in cache order.

Each check compares results (with numpy, onnxruntime, or bit for bit with the same row
computed alone) and, where the point is the code's shape, the lowered program or its speed.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import tvm
from onnx import helper
from tvm import relax

from rangeprof.profiler.compile.schedules import build, host_target, relax_pipeline

from relax_builders import single_input_module
from schedule_checks import assert_matches_onnxruntime, kernel_scripts, lowered, onnx_model


def _layer_norm(x):
    width = x.ty.shape.values[-1]
    ones = relax.const(np.linspace(0.5, 1.5, int(width)).astype("float32"))
    zeros = relax.const(np.linspace(-1, 1, int(width)).astype("float32"))
    return relax.op.nn.layer_norm(x, ones, zeros, axes=[-1], epsilon=1e-5)


def _softmax(x):
    return relax.op.nn.softmax(x, axis=-1)


def _run(executable, x: np.ndarray) -> np.ndarray:
    vm = relax.VirtualMachine(executable, tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


@pytest.mark.parametrize("width", [256, 127, 8], ids=["lanes", "serial", "one_step"])
@pytest.mark.parametrize("op", [_layer_norm, _softmax])
def test_interleaved_rows_add_in_each_rows_order(op, width):
    """Rows reduced side by side give the bits of the same row reduced alone (16 partial sums,
    a reduced axis no lanes divide, one that one step of 8 lanes covers)."""
    x = (np.random.default_rng(0).normal(size=(8, width)) * 3).astype("float32")
    together = _run(build(single_input_module((8, width), op)), x)
    alone = build(single_input_module((1, width), op))
    for row in range(8):
        assert np.array_equal(together[row : row + 1], _run(alone, x[row : row + 1]))


@pytest.mark.parametrize("op", [_layer_norm, _softmax])
def test_partial_sums_stay_off_the_workspace(op):
    """The 16 partial sums of a row are a stack buffer (a register), not a ``local`` one that
    TVM would allocate from its workspace and LLVM keep in memory."""
    program = relax_pipeline(host_target())(single_input_module((128, 256), op))
    script = "\n".join(kernel_scripts(program).values())
    assert "_rf" in script and 'scope="local"' not in script


def _llvm_ir(executable) -> str:
    library = executable.mod
    modules = [library, *library.imports]
    return "".join(m.inspect_source("ll") for m in modules if m.kind == "llvm")


def test_exp_is_vectorised_sixteen_wide():
    """exp's NaN test is integer arithmetic TVM's vectoriser knows: the whole approximation
    stays in the 16-lane vectors of the schedule (``T.isnan`` left the loop scalar, and LLVM
    vectorised it 8 wide)."""
    ir = _llvm_ir(build(single_input_module((64, 64), relax.op.exp)))
    assert re.search(r"fmul <16 x float>", ir)
    assert not re.search(r"<8 x float>", ir)


def _best_ms(fn, repeat: int = 7) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def test_masked_softmax_is_no_slower():
    """A causal mask's ``-inf`` half of the scores takes no subnormal slow path (it made the
    softmax 4-5× slower on Intel cores); masked entries are exactly 0."""
    shape = (4, 128, 128)
    rng = np.random.default_rng(1)
    scores = (rng.normal(size=shape) * 3).astype("float32")
    masked = np.where(np.triu(np.ones(shape[1:], bool), 1), -np.inf, scores).astype("float32")
    vm = relax.VirtualMachine(build(single_input_module(shape, _softmax)), tvm.cpu())
    args = [tvm.runtime.tensor(a) for a in (scores, masked)]
    out = vm["main"](args[1]).numpy()
    assert (out[:, np.triu(np.ones(shape[1:], bool), 1)] == 0).all()
    np.testing.assert_allclose(out.sum(-1), 1, rtol=1e-5)
    plain = min(_best_ms(lambda: vm["main"](args[0])) for _ in range(3))
    with_mask = min(_best_ms(lambda: vm["main"](args[1])) for _ in range(3))
    assert with_mask < 2 * plain, (with_mask, plain)


def _head_split(perm):
    """``[1, 128, 256]`` → four heads of 64 → transposed by ``perm``, times 2."""
    out_shape = [[1, 128, 4, 64][p] for p in perm]
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["r"]),
        helper.make_node("Transpose", ["r"], ["t"], perm=perm),
        helper.make_node("Mul", ["t", "two"], ["y"]),
    ]
    inits = {"shape": np.array([1, 128, 4, 64], np.int64), "two": np.float32(2.0)}
    return onnx_model(nodes, inits, {"x": [1, 128, 256]}, {"y": out_shape})


@pytest.mark.parametrize("perm", [[0, 2, 3, 1], [0, 2, 1, 3]], ids=["keys", "queries"])
def test_head_split_exact(perm):
    """Both head splits (keys transposed, queries not) move every value unchanged."""
    model = _head_split(perm)
    assert_matches_onnxruntime(model, lowered(model), rtol=0, atol=0)


def test_transposed_head_split_sweeps_a_strip_at_a_time():
    """Attention's ``Kᵀ`` (heads × 64 × 128, read across 128 rows): each vector gathers down
    the rows, so the strip of 16 rows it reads is the outermost loop, every head and channel
    swept while those rows are in cache."""
    model = _head_split([0, 2, 3, 1])
    program = lowered(model)
    (script,) = kernel_scripts(program).values()
    strip = re.search(
        r"v_ax3 = T\.axis\.spatial\(T\.int64\(128\), (\w+) // T\.int64\(256\)", script
    )
    assert strip and re.search(rf"for {strip.group(1)} in T\.parallel", script)
