"""The compiled core's step-log buffers, the client's sends and the stage drain (``fitness.sim.core``)."""

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


@njit(cache=True)
def send_until(t_us, sent, hi, send, queue_us, per_running_us, depth, send_depth, enq, pend, n_pend):
    """``engine._ClosedLoop.send_until``: the requests from SENT on that the client sent by
    T_US get their enqueue time, counting the DEPTH requests of the step running then
    (a negative queueing time enqueues a request when it is sent, never before)."""
    while sent < hi and send[sent] <= t_us:
        send_depth[sent] = depth
        enq[sent] = send[sent] + queue_us[sent] + per_running_us * depth
        pend[n_pend] = sent
        n_pend += 1
        sent += 1
    return sent, n_pend


@njit(cache=True)
def take_enqueued(t_us, enq, pend, n_pend, ready):
    """The pending requests enqueued by T_US, into READY in enqueue order (ties: sent first).
    Returns (how many are ready, how many still pend)."""
    n_ready = 0
    w = 0
    for i in range(n_pend):
        r = pend[i]
        if enq[r] <= t_us:
            ready[n_ready] = r
            n_ready += 1
        else:
            pend[w] = r
            w += 1
    if n_ready > 1:
        idx = np.argsort(enq[ready[:n_ready]], kind="mergesort")
        ready[:n_ready] = ready[:n_ready][idx]
    return n_ready, w


@njit(cache=True)
def next_event_us(sent, hi, send, enq, pend, n_pend):
    """``engine._ClosedLoop.next_event_us``: an idle engine waits for the next enqueue of a
    request already sent, or for the next send (whose enqueue time depends on the load then)."""
    best = send[sent] if sent < hi else np.inf
    for i in range(n_pend):
        if enq[pend[i]] < best:
            best = enq[pend[i]]
    return best
