"""``take`` that never reads outside its data.

TVM legalizes ``take`` in its ``fast`` mode unless told otherwise (the ONNX importer's Gather
does not say): an index past the axis reads whatever memory lies there, and a token id past a
model's vocabulary crashed the process. ONNX makes such an index an error. Where a model input
is the index, the data checks refuse it first (:mod:`rangeprof.profiler.profiling.data`); an
index computed inside the model is clipped to the axis here: a wrong value, never a crash. The
importer has made negative indices positive before.
"""

from __future__ import annotations

from tvm import relax, topi


def legalize_take(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """``take`` in ``clip`` mode where it asked for ``fast``; other modes as asked."""
    mode = "clip" if call.attrs.mode == "fast" else call.attrs.mode
    return bb.call_te(topi.take, call.args[0], call.args[1], call.attrs.axis, mode=mode)
