"""profileIDs on the initial IR: naming, sub-indices, source tensors, inputs and weights."""

from __future__ import annotations

import tvm

from rangeprof.profiler.ir.bindings import module_bindings
from rangeprof.profiler.ir.importer import import_onnx
from rangeprof.profiler.ir.onnx_load import load_model
from rangeprof.profiler.ir.spans import ids_of

import onnx_builders as mb


def _import(model, tmp_path, **shapes):
    return import_onnx(load_model(mb.save(model, tmp_path), shapes or None))


def _by_id(imported):
    return {layer.profile_id: layer for layer in imported.layers}


def test_gemm_expands_into_sub_indexed_bindings(tmp_path):
    layers = _by_id(_import(mb.gemm(), tmp_path))
    assert [layers[f"fc#{k}"].op for k in range(3)] == [
        "relax.permute_dims",
        "relax.matmul",
        "relax.add",
    ]
    # Only the binding whose value *is* the ONNX output names that tensor.
    assert [layers[f"fc#{k}"].source_tensor for k in range(3)] == [None, None, "y"]
    assert all(layers[f"fc#{k}"].source_op == "Gemm" for k in range(3))
    assert layers["fc#2"].shape == [2, 5]


def test_conv_with_bias_and_batch_norm(tmp_path):
    layers = _by_id(_import(mb.conv_bias(), tmp_path))
    conv = [p for p in layers if p.startswith("conv")]
    assert len(conv) >= 2, conv  # conv2d + bias add
    assert layers[conv[0]].op == "relax.nn.conv2d"
    assert [layers[p].source_tensor for p in conv].count("y") == 1

    layers = _by_id(_import(mb.conv_bn_relu_scale(), tmp_path))
    bn = sorted(p for p in layers if p.startswith("bn#"))
    assert layers[bn[0]].op == "relax.nn.batch_norm"
    assert layers[bn[1]].op == "TupleGetItem"
    assert layers[bn[1]].source_tensor == "n"
    assert layers["relu"].source_tensor == "r"


def test_inputs_and_weights_get_ids(tmp_path):
    layers = _by_id(_import(mb.conv_bn_relu_scale(), tmp_path))
    assert layers["input:x"].kind == "input"
    assert layers["input:x"].shape == [1, 3, 6, 6]
    assert layers["weight:w"].kind == "weight"
    assert layers["weight:w"].shape == [4, 3, 3, 3]
    assert {"weight:bn.g", "weight:bn.b", "weight:bn.m", "weight:bn.v", "weight:s"} <= set(layers)


def test_every_binding_and_weight_is_tagged_in_the_ir(tmp_path):
    imported = _import(mb.conv_bn_relu_scale(), tmp_path)
    ids = {layer.profile_id for layer in imported.layers}
    refs = list(module_bindings(imported.mod))
    assert refs and all(len(ids_of(r.value)) == 1 for r in refs)
    assert {next(iter(ids_of(r.value))) for r in refs} <= ids
    weights = set()

    def visit(expr):
        if isinstance(expr, tvm.ir.GenericConst):
            weights.update(ids_of(expr))

    tvm.relax.analysis.post_order_visit(imported.mod["main"], visit)
    assert weights == {p for p in ids if p.startswith("weight:")}


def test_unnamed_nodes_get_op_type_and_index(tmp_path):
    layers = _by_id(_import(mb.unnamed_nodes(), tmp_path))
    assert {"Relu_0", "Sigmoid_0", "Relu_1"} <= set(layers)
    assert layers["Relu_1"].source_tensor == "y"


def test_ids_are_unique_and_deterministic(tmp_path):
    first = _import(mb.conv_bn_relu_scale(), tmp_path)
    second = _import(mb.conv_bn_relu_scale(), tmp_path)
    ids = [layer.profile_id for layer in first.layers]
    assert len(ids) == len(set(ids))
    assert first.layers == second.layers
    tvm.ir.assert_structural_equal(first.mod, second.mod, map_free_vars=True)
    spans = [sorted(ids_of(r.value)) for r in module_bindings(first.mod)]
    assert spans == [sorted(ids_of(r.value)) for r in module_bindings(second.mod)]
