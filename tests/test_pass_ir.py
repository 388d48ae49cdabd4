"""Before and after, in TVMScript: what each of our passes makes of a tiny module.

Each test writes the module a pass gets and the module it must give, and compares them with
``tvm.ir.assert_structural_equal`` (constants by value). Spans, which carry the profileIDs, are
not part of structural equality: where a pass is about them, the test reads them.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from rangeprof.profiler.ir.bindings import function_bindings
from rangeprof.profiler.ir.passes.canonicalize import Canonicalize
from rangeprof.profiler.ir.passes.equalize import CrossLayerEqualization
from rangeprof.profiler.ir.passes.fold_scale_axis import FoldScaleAxis
from rangeprof.profiler.ir.spans import ids_of, with_ids
from rangeprof.profiler.ir.tagging import TagProfileIDs


def _f32(*values) -> np.ndarray:
    return np.array(values, dtype="float32")


def _bindings(mod: tvm.IRModule) -> dict[str, relax.Binding]:
    return {str(r.var.name): r for r in function_bindings("main", mod["main"])}


def test_tag_profile_ids_writes_ids_on_spans_and_changes_nothing_else():
    w = _f32(1, 2, 3, 4, 5, 6).reshape(2, 3)

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 2), "float32")) -> R.Tensor((1, 3), "float32"):
            with R.dataflow():
                lv = R.matmul(x, R.const(w))
                gv = R.nn.relu(lv)
                R.output(gv)
            return gv

    refs = _bindings(Before)
    weight = refs["lv"].value.args[1]
    binding_ids = {refs["lv"].var: "fc", refs["gv"].var: "act"}
    after = TagProfileIDs(binding_ids, {weight: "weight:w"})(Before)

    # The pass rebuilds the body without its type; Normalize fills it in and changes nothing else.
    tvm.ir.assert_structural_equal(relax.transform.Normalize()(after), Before)
    tagged = _bindings(after)
    assert {name: ids_of(ref.value) for name, ref in tagged.items()} == {
        "lv": {"fc"},
        "gv": {"act"},
    }
    assert ids_of(tagged["lv"].value.args[1]) == {"weight:w"}
    assert "fc" not in ids_of(refs["lv"].value)  # the module it was given is left as it was


def test_fold_scale_axis_folds_a_scale_after_a_dense_into_its_weight():
    w, s, b = _f32(1, 2, 3, 4, 5, 6).reshape(2, 3), _f32(1, 2, 4), _f32(0.5, 0.25, -1)

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 2), "float32")) -> R.Tensor((1, 3), "float32"):
            with R.dataflow():
                lv = R.matmul(x, R.const(w))
                lv1 = R.multiply(lv, R.const(s))
                lv2 = R.add(lv1, R.const(b))
                gv = R.nn.relu(lv2)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 2), "float32")) -> R.Tensor((1, 3), "float32"):
            with R.dataflow():
                lv = R.matmul(x, R.const(w * s))
                lv2 = R.add(lv, R.const(b))
                gv = R.nn.relu(lv2)
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(FoldScaleAxis()(Before), Expected)


def test_fold_scale_axis_folds_a_scale_on_an_input_into_the_conv_after_it():
    w = np.arange(2 * 3 * 1 * 1, dtype="float32").reshape(2, 3, 1, 1) + 1
    s = _f32(1, 2, 0.5).reshape(1, 3, 1, 1)

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 3, 4, 4), "float32")) -> R.Tensor((1, 2, 4, 4), "float32"):
            with R.dataflow():
                lv = R.multiply(x, R.const(s))
                gv = R.nn.conv2d(lv, R.const(w))
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 3, 4, 4), "float32")) -> R.Tensor((1, 2, 4, 4), "float32"):
            with R.dataflow():
                gv = R.nn.conv2d(x, R.const(w * s))
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(FoldScaleAxis()(Before), Expected)


def test_canonicalize_folds_constants_and_puts_a_full_rank_constant_second():
    g, k = _f32(1, 2, 3).reshape(3, 1, 1), _f32(2, 2, 0.5).reshape(3, 1, 1)

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 3, 2, 2), "float32")) -> R.Tensor((1, 3, 2, 2), "float32"):
            with R.dataflow():
                lv = R.multiply(R.const(g), R.const(k))  # a constant chain: folded in numpy
                lv1 = R.add(lv, x)  # constant first, of rank 3 against rank 4
                gv = R.nn.relu(lv1)
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 3, 2, 2), "float32")) -> R.Tensor((1, 3, 2, 2), "float32"):
            with R.dataflow():
                lv1 = R.add(x, R.const((g * k).reshape(1, 3, 1, 1)))
                gv = R.nn.relu(lv1)
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(Canonicalize()(Before), Expected)


def test_canonicalize_rewrites_dropout_as_its_inference_value():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 3), "float32")) -> R.Tensor((2, 3), "float32"):
            with R.dataflow():
                lv = R.nn.dropout(x, rate=0.5)
                gv = R.nn.relu(lv[0])
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 3), "float32")) -> R.Tensor((2, 3), "float32"):
            with R.dataflow():
                lv = (x, R.ones_like(x))
                gv = R.nn.relu(lv[0])
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(Canonicalize()(Before), Expected)


def test_cross_layer_equalization_evens_the_ranges_of_two_dense_layers():
    # Output-channel ranges of the first layer [4, 1], input-channel ranges of the second
    # [1, 4]: scales sqrt(r1 / r2) = [2, 0.5] make both [2, 2] (powers of two: exact). The
    # first layer's bias is divided by the same scales.
    w1, b1 = _f32(4, 1, 1, 0.5).reshape(2, 2), _f32(2, 1)
    w2 = _f32(1, 0.5, 4, 2).reshape(2, 2)
    scale = _f32(2, 0.5)

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 2), "float32")) -> R.Tensor((1, 2), "float32"):
            with R.dataflow():
                lv = R.matmul(x, R.const(w1))
                lv1 = R.add(lv, R.const(b1))
                lv2 = R.nn.relu(lv1)
                gv = R.matmul(lv2, R.const(w2))
                R.output(gv)
            return gv

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((1, 2), "float32")) -> R.Tensor((1, 2), "float32"):
            with R.dataflow():
                lv = R.matmul(x, R.const(w1 / scale))
                lv1 = R.add(lv, R.const(b1 / scale))
                lv2 = R.nn.relu(lv1)
                gv = R.matmul(lv2, R.const(w2 * scale[:, None]))
                R.output(gv)
            return gv

    after = CrossLayerEqualization()(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    assert np.abs(w1 / scale).max(axis=0).tolist() == [2, 2]  # the expected ranges are even
    assert np.abs(w2 * scale[:, None]).max(axis=1).tolist() == [2, 2]


def test_cross_layer_equalization_keeps_each_constants_profile_id():
    w1, w2 = _f32(4, 1, 1, 0.5).reshape(2, 2), _f32(1, 0.5, 4, 2).reshape(2, 2)
    first = with_ids(relax.const(w1), ["weight:w1"])
    second = with_ids(relax.const(w2), ["weight:w2"])

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((1, 2), "float32")) -> R.Tensor((1, 2), "float32"):
            with R.dataflow():
                lv = R.matmul(x, first)
                lv1 = R.nn.relu(lv)
                gv = R.matmul(lv1, second)
                R.output(gv)
            return gv

    refs = _bindings(CrossLayerEqualization()(Before))
    assert ids_of(refs["lv"].value.args[1]) == {"weight:w1"}
    assert ids_of(refs["gv"].value.args[1]) == {"weight:w2"}
    assert not np.array_equal(refs["lv"].value.args[1].value.numpy(), w1)  # it did rescale
