"""The row-reduction rule (layer norm, softmax): claimed kernels, and results against numpy.

Reductions are reordered (16 partial sums per row) and softmax's exp is Cephes' polynomial, so
results match numpy within float rounding, not bitwise; masked softmax entries stay exactly 0.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, s_tir

from rangeprof.profiler.compile.schedules import build
from rangeprof.profiler.compile.schedules.activations import lower_vector_math
from rangeprof.profiler.compile.schedules.normalization import (
    legalize_softmax,
    schedule_normalization,
)

from relax_builders import single_input_module

RTOL, ATOL = 1e-5, 1e-6


def _layer_norm(shape, seed=0):
    rng = np.random.default_rng(seed)
    gamma = rng.uniform(0.5, 1.5, shape[-1]).astype("float32")
    beta = rng.normal(size=shape[-1]).astype("float32")

    def op(x):
        return relax.op.nn.layer_norm(
            x, relax.const(gamma), relax.const(beta), axes=[-1], epsilon=1e-5
        )

    def ref(x):
        x = x.astype("float64")
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + 1e-5) * gamma + beta

    return single_input_module(shape, op), ref


def _softmax(shape):
    def ref(x):
        e = np.exp(x.astype("float64") - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    return single_input_module(shape, lambda x: relax.op.nn.softmax(x, axis=-1)), ref


def _run(mod, x):
    vm = relax.VirtualMachine(build(mod), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def _scheduled(mod, legalize=None):
    """The legalized kernel of ``mod`` (TVM's legalization, or ``legalize``'s) after the rule
    (asserting that it claims it)."""
    legal = relax.transform.LegalizeOps(customize_legalize_map=legalize)(mod)
    func = next(f for _, f in legal.functions_items() if isinstance(f, tvm.tirx.PrimFunc))
    sch = s_tir.Schedule(func)
    assert schedule_normalization(sch)
    return lower_vector_math(sch.mod)["main"].script()


@pytest.mark.parametrize("shape", [(128, 256), (1, 4, 128, 128), (3, 7, 40), (5, 127), (1, 2, 24)])
@pytest.mark.parametrize("kind", ["layer_norm", "softmax"])
def test_matches_numpy(kind, shape):
    mod, ref = _layer_norm(shape) if kind == "layer_norm" else _softmax(shape)
    x = (np.random.default_rng(1).normal(size=shape) * 4).astype("float32")
    np.testing.assert_allclose(_run(mod, x), ref(x), rtol=RTOL, atol=ATOL)


def test_softmax_masked_entries_are_zero():
    """An attention mask's -10000 (and the lowest float) give exactly 0, as libm's exp does."""
    mod, ref = _softmax((4, 64))
    x = np.random.default_rng(2).normal(size=(4, 64)).astype("float32")
    x[:, 40:] = -10000.0
    x[0, 1] = np.finfo("float32").min
    out = _run(mod, x)
    assert (out[:, 40:] == 0).all() and out[0, 1] == 0
    np.testing.assert_allclose(out, ref(x), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kind", ["layer_norm", "softmax"])
def test_rule_claims_row_reductions(kind):
    """Rows parallel, reductions as 16 vector lanes of partial sums (held in registers, not
    a local buffer per row), no scalar exp left."""
    mod, _ = _layer_norm((128, 256)) if kind == "layer_norm" else _softmax((1, 4, 128, 128))
    script = _scheduled(mod)
    assert script.count("T.parallel(") == 1
    assert "_rf" in script and "T.vectorized(T.int64(16))" in script
    assert "T.exp(" not in script


def test_softmax_divides_only_the_row_sum():
    """Our legalization normalizes by the reciprocal of the row's sum, as onnxruntime's MLAS
    does: the output divides only the sum, where TVM's divides every exp by it."""
    mod, _ = _softmax((1, 4, 128, 128))
    for legalize, per_row in ((None, False), ({"relax.nn.softmax": legalize_softmax}, True)):
        script = _scheduled(mod, legalize)
        norm = [line for line in script.splitlines() if line.strip().startswith("T_softmax_norm[")]
        assert len(norm) == 1 and norm[0].count(" / ") == 1
        assert ("T.float32(1.0) / T_softmax_expsum[" in norm[0]) == per_row


def test_odd_width_stays_serial_but_per_row():
    """A reduced axis no lanes divide (127) is reduced serially, still inside the row loop."""
    mod, _ = _layer_norm((64, 127))
    script = _scheduled(mod)
    assert "rf_local" not in script and script.count("T.parallel(") == 1
