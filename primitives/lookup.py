"""The one lookup arithmetic of the kernel tables, compiled: log2-grid interpolation of log2(latency).

Both the Python evaluator (``primitives.kernels.Table1D``/``Table2D``, scalars and columns)
and the compiled simulator core (``primitives.program_eval``) call these functions, so
both give the same bits. numpy's own ``exp2``/``log2`` would not do: on CPUs with
AVX-512 numpy uses SVML, which differs from the C library in the last bit of about 1% of
values, so the same model would give different step times on different machines and in
the two simulator paths. Here every ``exp2``/``log2`` is the C library's.

A table is described by a float64 parameter vector: ``(start, step, count, offset)`` for
1-D, ``(x start, x step, x count, y start, y step, y count, offset, unused)`` for 2-D,
with its log2 values flattened (row-major) in ``values`` from ``offset`` on.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

OFFSET_1D, OFFSET_2D = 3, 6  # where a parameter vector holds its values' offset


@njit(cache=True)
def grid_position(start, step, count, x):
    """(index, fraction) of X on the grid 2**(start + i*step), clamped at its ends."""
    xm = x if (x != x or x >= 1e-300) else 1e-300
    u = (np.log2(xm) - start) / step
    if u < 0.0:
        u = 0.0
    elif u > count - 1.0:
        u = count - 1.0
    i = int(math.floor(u))
    if i > count - 2:
        i = int(count) - 2
    return i, u - i


@njit(cache=True)
def lookup1(p, values, x):
    """The 1-D table P at X (0 for no work)."""
    if not x > 0:
        return 0.0
    i, t = grid_position(p[0], p[1], p[2], x)
    o = int(p[OFFSET_1D])
    return np.exp2(values[o + i] * (1 - t) + values[o + i + 1] * t)


@njit(cache=True)
def lookup2(p, values, x, y):
    """The 2-D table P at (X, Y) (0 for no work)."""
    if not (x > 0 and y > 0):
        return 0.0
    i, s = grid_position(p[0], p[1], p[2], x)
    j, t = grid_position(p[3], p[4], p[5], y)
    o, m = int(p[OFFSET_2D]), int(p[5])
    z00, z01 = values[o + i * m + j], values[o + i * m + j + 1]
    z10, z11 = values[o + (i + 1) * m + j], values[o + (i + 1) * m + j + 1]
    v = (z00 * (1 - t) + z01 * t) * (1 - s) + (z10 * (1 - t) + z11 * t) * s
    return np.exp2(v)


@njit(cache=True)
def lookup1_array(p, values, x):
    out = np.empty(x.size)
    flat = x.ravel()
    for k in range(flat.size):
        out[k] = lookup1(p, values, flat[k])
    return out.reshape(x.shape)


@njit(cache=True)
def lookup2_array(p, values, x, y):
    out = np.empty(x.size)
    fx, fy = x.ravel(), y.ravel()
    for k in range(fx.size):
        out[k] = lookup2(p, values, fx[k], fy[k])
    return out.reshape(x.shape)
