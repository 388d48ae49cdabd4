"""Integer matmul operands for the kernel tests, with the extremes where the int32 sums are
largest, so an exact check also checks that nothing saturates."""

from __future__ import annotations

import numpy as np

# The values drawn for the left operand, by its type.
RANGE = {"uint8": (0, 255), "int8": (-128, 127), "int16": (-2000, 2000)}


def matmul_operands(a_shape, b_shape, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Random ``a`` of ``dtype`` and int8 ``b``: the first row of ``a`` at its type's largest
    magnitude, the first column of ``b`` at −128, the last at 127."""
    rng = np.random.default_rng(0)
    low, high = RANGE[dtype]
    a = rng.integers(low, high + 1, a_shape)
    b = rng.integers(-128, 128, b_shape)
    a[..., 0, :] = low if dtype == "int8" else high
    b[..., 0], b[..., -1] = -128, 127
    return a.astype(dtype), b.astype("int8")
