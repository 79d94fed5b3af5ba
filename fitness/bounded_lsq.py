"""Bounded least squares from the normal equations: the one solver behind every fit of constants."""

from __future__ import annotations

import numpy as np
from scipy.linalg.lapack import dtrtrs
from scipy.optimize import lsq_linear, nnls


def bounded_gram(G: np.ndarray, h: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> np.ndarray | None:
    """min ||A x - b||, lower <= x <= upper, from the (k x k) normal equations G = A^T A, h = A^T b.

    A column that is all zero is work the data never saw: it gets its lower bound (0 where
    that is not finite), so an efficiency term prices unseen work at its ideal or measured
    time, not at nothing; the fit itself cannot tell. A term pinned by lower == upper gets
    exactly that value.
    """
    norms = np.sqrt(np.diag(G))
    keep = norms > 1e-12
    if not keep.any():
        return None
    nk = norms[keep]
    Gs = (G if keep.all() else G[keep][:, keep]) / np.outer(nk, nk)  # the normal equations of A with unit columns
    Gs.flat[:: len(Gs) + 1] += 1e-10  # ridge: collinear terms (e.g. constant per deployment)
    lo, hi = lower[keep] * nk, upper[keep] * nk
    hi = np.where(hi > lo, hi, np.nextafter(lo, np.inf))  # a pinned term (lower == upper): bvls needs lo < hi
    try:
        L = np.linalg.cholesky(Gs)
        y, info = dtrtrs(L, h[keep] / nk, lower=1)  # LAPACK directly: the wrappers cost more than the solve
        if info != 0:
            return None
        if np.isinf(hi).all() and not lo.any():
            sol, _ = nnls(L.T, y, maxiter=50 * len(G))
        else:
            sol = np.clip(lsq_linear(L.T, y, bounds=(lo, hi), method="bvls").x, lo, hi)  # bvls may overshoot by ulps
    except (np.linalg.LinAlgError, RuntimeError, ValueError):
        return None
    theta = np.where(np.isfinite(lower), lower, 0.0)  # unseen work (see above)
    pinned = lower[keep] == upper[keep]
    theta[keep] = np.where(pinned, lower[keep], sol / nk)  # a pinned term is its bound, not bvls's ulp past it
    return theta
