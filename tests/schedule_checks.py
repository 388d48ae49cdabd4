"""The FP32 build of a small ONNX model, lowered and run, for the schedule tests: the program the
build hands to code generation (``main`` and its scheduled kernels, to check what a rule did),
and its outputs against onnxruntime's."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax, tirx

from rangeprof.profiler.compile.schedules import host_target
from rangeprof.profiler.compile.schedules.pipeline import relax_pipeline
from rangeprof.profiler.ir.importer import import_onnx
from rangeprof.profiler.ir.onnx_load import load_model_bytes


def onnx_model(nodes, inits: dict, inputs: dict, outputs: dict, opset: int = 17):
    """A checked model; ``inputs`` / ``outputs``: float32 tensors by name and shape (an input
    shape given as ``(shape, TensorProto type)`` has that type); float initializers become
    float32, integer ones keep their type."""
    typed = {n: s if isinstance(s, tuple) else (s, TensorProto.FLOAT) for n, s in inputs.items()}
    graph = helper.make_graph(
        nodes,
        "schedules",
        [helper.make_tensor_value_info(n, t, s) for n, (s, t) in typed.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs.items()],
        [numpy_helper.from_array(_initializer(v), n) for n, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _initializer(value) -> np.ndarray:
    value = np.asarray(value)
    return value if value.dtype.kind in "iu" else value.astype(np.float32)


def lowered(model: onnx.ModelProto) -> tvm.IRModule:
    """The program the build hands to code generation: ``main`` and its scheduled kernels."""
    mod = import_onnx(load_model_bytes(model.SerializeToString(), "model.onnx")).mod
    return relax_pipeline(host_target())(mod)


def feeds(model: onnx.ModelProto, seed: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        i.name: rng.uniform(-2, 2, [d.dim_value for d in i.type.tensor_type.shape.dim]).astype(
            np.float32
        )
        for i in model.graph.input
    }


def assert_matches_onnxruntime(
    model, program: tvm.IRModule, rtol=1e-5, atol=1e-5, inputs: dict | None = None
) -> None:
    """Runs the lowered ``program`` and every output against onnxruntime's FP32, on ``inputs``
    (default: :func:`feeds`)."""
    inputs = feeds(model) if inputs is None else inputs
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(None, inputs)
    executable = tvm.compile(program, host_target(), relax_pipeline=tvm.transform.Sequential([]))
    out = relax.VirtualMachine(executable, tvm.cpu())["main"](
        *[tvm.runtime.tensor(inputs[p.name]) for p in program["main"].params]
    )
    actual = [out] if isinstance(out, tvm.runtime.Tensor) else list(out)
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        np.testing.assert_allclose(got.numpy(), want, rtol=rtol, atol=atol)


def kernel_calls(program: tvm.IRModule) -> list[relax.Call]:
    """``main``'s calls of PrimFuncs, in order."""
    return [
        b.value
        for block in program["main"].body.blocks
        for b in block.bindings
        if isinstance(b.value, relax.Call)
        and isinstance(b.value.op, tvm.ir.GlobalVar)
        and isinstance(program[b.value.op], tirx.PrimFunc)
    ]


def kernel_scripts(program: tvm.IRModule) -> dict[str, str]:
    """Each PrimFunc's TVMScript, by name."""
    return {
        gv.name_hint: f.script()
        for gv, f in program.functions_items()
        if isinstance(f, tirx.PrimFunc)
    }
