"""Layout clean-ups of the CPU build, after ``ConvertLayout`` (canonicalization before it is
:mod:`rangeprof.profiler.ir.passes.canonicalize`).

* **Per-tensor quantize / dequantize out of their transposes** (:data:`untranspose_quantize`,
  after ``ConvertLayout``, which has no layout rule for them and wraps each in a round trip to
  NCHW): elementwise again, FuseOps can fuse them into the kernel that produces their input
  (ResNet-18 INT8 1.5 % faster).
* **Input channels of unpadded integer convs to a multiple of 4** (:data:`pad_int8_channels`, after
  the layout rewrite): a 3-channel image would otherwise be copied into a 4-channel stage inside the
  conv kernel, element by element (the dot instructions multiply groups of 4, or 2 of int16); as a
  ``pad`` of the graph FuseOps fuses it into the kernel producing the image, and the zero weights of
  the new channel keep the sums exact.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

from rangeprof.profiler.ir.spans import ids_of, with_ids

from .conv2d_int8 import is_integer

# The depth of the widest dot instructions (vpdpbusd, vpmaddubsw, sdot): 4 products per lane.
CHANNEL_GROUP = 4


def _inverse(first: relax.Call, second: relax.Call) -> bool:
    """Whether permuting by ``first`` then by ``second`` gives the original axes."""
    p, q = ([int(a) for a in c.attrs.axes] for c in (first, second))
    return [p[i] for i in q] == list(range(len(p)))


def _untranspose(func: relax.Function) -> relax.Function:
    data = wildcard()
    inner = is_op("relax.permute_dims")(data)
    quantize = is_op("relax.quantize")(inner, wildcard(), wildcard()) | is_op("relax.dequantize")(
        inner, wildcard(), wildcard()
    )
    outer = is_op("relax.permute_dims")(quantize)

    def rewrite(expr, matches):
        call = matches[quantize]
        if not _inverse(matches[inner], expr) or any(a.ty.ndim != 0 for a in call.args[1:]):
            return expr
        args = [matches[data], *call.args[1:]]
        return relax.Call(call.op, args, call.attrs, call.ty_args, call.span)

    return rewrite_call(outer, rewrite, func)


@tvm.transform.module_pass(opt_level=0, name="UntransposeQuantize")
def untranspose_quantize(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """``permute_dims(q(permute_dims(x, p)), p⁻¹)`` → ``q(x)`` for a per-tensor (scalar scale
    and zero point) ``quantize`` / ``dequantize`` ``q``."""
    mod = mod.clone()
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[gvar] = _untranspose(func)
    return relax.transform.DeadCodeElimination()(mod)


def _pad_channels(func: relax.Function) -> relax.Function:
    data, weight = wildcard(), is_const()
    conv = is_op("relax.nn.conv2d")(data, weight)

    def rewrite(expr, matches):
        call = matches[conv]
        attrs = call.attrs
        layouts = (attrs.data_layout, attrs.kernel_layout)
        if layouts != ("NHWC", "OHWI") or attrs.groups != 1 or not is_integer(call):
            return expr
        channels = int(matches[data].ty.shape[3])
        extra = -channels % CHANNEL_GROUP
        # A conv with padding has a stage of its own (the padding), which pads channels too.
        if extra == 0 or any(int(p) for p in attrs.padding):
            return expr
        # The pad derives from the conv: it carries the conv's profileIDs.
        x = with_ids(relax.op.nn.pad(matches[data], [0, 0, 0, 0, 0, 0, 0, extra]), ids_of(call))
        w = matches[weight].value.numpy()
        w = relax.const(np.pad(w, [(0, 0)] * 3 + [(0, extra)]), "int8")
        return relax.Call(call.op, [x, w], attrs, call.ty_args, call.span)

    return rewrite_call(conv, rewrite, func)


@tvm.transform.module_pass(opt_level=0, name="PadInt8Channels")
def pad_int8_channels(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """An NHWC 8-bit or int16 conv with constant int8 weights, no padding and input channels that
    are no multiple of 4 convolves a zero-padded input with zero-padded weights instead."""
    mod = mod.clone()
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[gvar] = _pad_channels(func)
    return mod
