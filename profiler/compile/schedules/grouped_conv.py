"""Grouped conv2d (``1 < groups``, not depthwise) in NHWC: the dense conv's packed kernel.

TVM's own legalization of a grouped conv (ResNeXt, RegNet, ShuffleNet) got the generic
schedule: a 4-group 3×3 conv of 64 channels ran 40× slower than onnxruntime. Legalized here
instead (constant float32 weights, NHWC/OHWI), before :mod:`.conv2d`'s legalization:

* weights ``[O, KH, KW, I/g]`` packed as a dense conv's, ``[O/ob, KH, KW, I/g, ob]``, with ``ob``
  (:func:`~.conv2d.register_tile`) dividing the ``O/g`` output channels of a group, so that a
  block of output channels lies in one group;
* output channel ``o`` reads input channels ``(o // (O/g)) · I/g + c``, ``c < I/g``: within a
  block the group is one, and the input load stays one broadcast per FMA row.

The block has the dense conv's name (:data:`~.conv2d.CONV`) and loops, so :mod:`.conv2d`'s
schedule takes it, epilogue included (a SiLU or HardSwish after the conv).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from rangeprof.profiler.compile.schedules.conv2d import conv2d_nhwc_packed, register_tile
from rangeprof.profiler.compile.schedules.isa import vector_unit


def legalize_grouped_conv2d(bb: relax.BlockBuilder, call: relax.Call):
    """A grouped NHWC/OHWI float32 conv2d with constant weights → the packed kernel; None for
    anything else (dense and depthwise convs are :mod:`.conv2d`'s)."""
    attrs = call.attrs
    data, weight = call.args
    layouts = (attrs.data_layout, attrs.kernel_layout, attrs.out_layout)
    dtypes = {str(data.ty.dtype), str(weight.ty.dtype), str(call.ty.dtype)}
    if (
        attrs.groups == 1
        or layouts != ("NHWC", "OHWI", "NHWC")
        or not isinstance(weight, tvm.ir.expr.GenericConst)
        or dtypes != {"float32"}
    ):
        return None
    w = weight.value.numpy()  # [O, KH, KW, I / groups]
    out_ch, kh, kw, in_per_group = w.shape
    if in_per_group == 1 and attrs.groups == out_ch:
        return None  # depthwise
    group_channels = out_ch // int(attrs.groups)
    ob, _ = register_tile(int(call.ty.shape[2]), group_channels, vector_unit())
    packed = w.reshape(out_ch // ob, ob, kh, kw, in_per_group).transpose(0, 2, 3, 4, 1)
    args = dict(strides=attrs.strides, padding=attrs.padding, dilation=attrs.dilation)
    return bb.call_te(
        conv2d_nhwc_packed,
        data,
        relax.const(np.ascontiguousarray(packed), "float32"),
        **{k: [int(v) for v in vals] for k, vals in args.items()},
        group_channels=group_channels,
        primfunc_name_hint="grouped_conv2d_nhwc_packed",
    )
