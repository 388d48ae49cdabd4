"""Relax passes of our own (TVM 0.27 lacks them), one pass object per transformation as TVM's
``relax.transform`` has them: :class:`~.canonicalize.Canonicalize` and
:class:`~.canonicalize.LegalizeTrainingBatchNorm`, :class:`~.fold_constant.FoldConstantNumpy`,
:class:`~.fold_scale_axis.FoldScaleAxis` (and its halves ``ForwardFoldScaleAxis``,
``BackwardFoldScaleAxis``), :class:`~.equalize.CrossLayerEqualization`. Each is applied as
``Pass()(mod)`` or listed in a ``tvm.transform.Sequential``; :mod:`..stages` orders them."""
