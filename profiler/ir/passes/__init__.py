"""Relax passes of our own (TVM 0.27 lacks them): FoldScaleAxis, constant folding in numpy."""
