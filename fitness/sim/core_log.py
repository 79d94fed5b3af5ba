"""The compiled core's step-log buffers and the stage drain (``fitness.sim.core``)."""

from __future__ import annotations

import numpy as np
from numba import njit

from fitness.sim.recording import FINISHED, REJECTED


@njit(cache=True)
def grow(a, need):
    if need <= len(a):
        return a
    b = np.empty(max(need, 2 * len(a)), dtype=a.dtype)
    b[: len(a)] = a
    return b


@njit(cache=True)
def drain_time_us(lo, hi, send, enq, status, last, s_start, s_cycle, s_follows, n_steps, otp, gap, timeout):
    """``engine._drain_time_us``: when the client has every response of requests LO..HI-1."""
    worst = 0.0
    for r in range(lo, hi):
        limit = send[r] + timeout
        if status[r] == REJECTED:
            d = enq[r]
        elif status[r] == FINISHED:
            k = last[r]
            out = s_start[k] + s_cycle[k]
            if k < n_steps - 1 and s_follows[k + 1]:
                out = out + s_cycle[k + 1]
            d = out + otp + gap
            d = limit if limit < d else d
        else:
            d = limit
        if r == lo or d > worst:
            worst = d
    return worst


@njit(cache=True)
def write_batch(b_prog, b_new, b_in, b_out, b_req, row, comp, alloc, inlen, outlen, rid, n_run):
    """The batch rows of the running requests that compute tokens, from ROW on.

    A function of its own, not a loop in the core: there the five arrays, reassigned when
    they grow, would cost five atomic reference counts per request and step."""
    for i in range(n_run):
        if alloc[i] > 0:
            b_prog[row], b_new[row], b_in[row], b_out[row], b_req[row] = comp[i], alloc[i], inlen[i], outlen[i], rid[i]
            row += 1
