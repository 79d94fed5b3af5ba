"""The closed loop of ``fitness.sim.engine`` compiled with numba: same run, same bits, ~30x faster.

``engine.simulate`` runs this core whenever the latency model can be turned into a
``primitives.program.StepProgram`` (every archived expression, anchored or not); the
Python loop (``engine._ClosedLoop`` over ``fitness.sim.scheduler``) stays the reference
for other models and for the tests that hold the two equal. Each part below names the
Python method it mirrors; the order of every KV allocation, eviction and float operation
is the same, so per-request latencies are identical. Compiled functions are cached on
disk (``cache=True``): only the first process on a machine pays the compile.

The loop returns raw arrays; ``engine.simulate`` measures the client side from them
exactly as for the Python loop.
"""

from __future__ import annotations

import sys

import numpy as np
from numba import njit

from fitness.sim import core_kv, core_log, kv_cache, recording
from fitness.sim.core_kv import (
    FREE_TOP,
    FRESH,
    N_KV_STATE,
    NEXT_ANON,
    acquire,
    held_blocks,
    kv_free,
    lookup,
    new_slot,
    new_table,
    preempt_release,
    register_prompt,
    release,
    take,
)
from fitness.sim.core_log import drain_time_us, grow, next_event_us, send_until, take_enqueued, write_batch
from fitness.sim.kv_cache import BLOCK, request_key
from fitness.sim.recording import ABORTED, FINISHED, PENDING, REJECTED, RUNNING, WAITING
from primitives import lookup as kernel_lookup
from primitives import program, program_eval
from primitives.jit_cache import flush_when_changed
from primitives.program_eval import program_step_time_us

US_PER_S = 1e6


@njit(cache=True, error_model="numpy")
def run_closed_loop(
    req_len,
    req_user,
    offsets_s,
    queue_us,
    per_running_us,
    stage_first,
    interval_s,
    timeout_us,
    target,
    max_len,
    budget_cap,
    max_seqs,
    stride,
    user_keys,
    n_user_keys,
    kv_total,
    sched_us,
    preempt_us,
    otp_us,
    gap_us,
    record,
    log_tokens,
    prog,
    step_scales,
):
    (vo, va, vc, rng, fph, fre, fsl, so, sa, sc, slots, k1p, k1v, k2p, k2v, scales) = prog
    n = len(req_len)
    n_stages = len(stage_first) - 1
    cap = max_seqs + 2
    max_blocks = max_len // BLOCK + 3
    # per request
    status = np.full(n, PENDING, dtype=np.int8)
    out_tok = np.zeros(n, dtype=np.int64)
    admit_step = np.full(n, -1, dtype=np.int64)
    first_step = np.full(n, -1, dtype=np.int64)
    last_step = np.full(n, -1, dtype=np.int64)
    n_preempt = np.zeros(n, dtype=np.int64)
    hit_tokens = np.zeros(n, dtype=np.int64)
    slot_of = np.full(n, -1, dtype=np.int64)
    send = np.full(n, np.nan)
    enq = np.full(n, np.nan)
    send_depth = np.zeros(n, dtype=np.int64)  # requests in the step running when each was sent
    pend = np.zeros(n + 1, dtype=np.int64)  # sent, not yet enqueued (in send order)
    ready = np.zeros(n + 1, dtype=np.int64)
    last_batch = 0  # requests in the latest step (BLIS's model remembers it the same way)
    stage_start = np.zeros(n_stages)
    # KV pool (fitness.sim.core_kv)
    st = np.zeros(N_KV_STATE, dtype=np.int64)
    st[FRESH] = kv_total
    st[NEXT_ANON] = 3
    tab = new_table(kv_total)
    lru_keys = np.zeros(2 * kv_total + 64, dtype=np.int64)
    blk = np.zeros((cap, max_blocks), dtype=np.int64)
    nblk = np.zeros(cap, dtype=np.int64)
    free_slots = np.arange(cap)[::-1].copy()
    st[FREE_TOP] = cap
    keys = np.zeros(max_blocks + 2, dtype=np.int64)
    # waiting queue: a ring (each request is in it at most once)
    wq = np.zeros(n + 1, dtype=np.int64)
    w_head = 0
    w_len = 0
    n_wait = 0
    # running set in admission order (scheduler.RunningSet), and the finishing requests
    rid = np.zeros(cap, dtype=np.int64)
    rcomp = np.zeros(cap, dtype=np.int64)
    rknown = np.zeros(cap, dtype=np.int64)
    rlen = np.zeros(cap, dtype=np.int64)
    rout = np.zeros(cap, dtype=np.int64)
    rblocks = np.zeros(cap, dtype=np.int64)
    rhend = np.zeros(cap, dtype=np.int64)
    n_run = 0
    fin = np.zeros(cap, dtype=np.int64)
    n_fin = 0
    alloc = np.zeros(cap, dtype=np.int64)
    new_comp = np.zeros(cap, dtype=np.int64)
    fields = np.zeros((4, cap))
    vstack = np.zeros((64, cap))
    masks = np.zeros((2, cap), dtype=np.bool_)
    sstack = np.zeros(64)
    # the steps (recording.StepLog) and, when asked, their batch rows and the sampled tokens
    s_cap = 1024
    s_start = np.zeros(s_cap)
    s_time = np.zeros(s_cap)
    s_cycle = np.zeros(s_cap)
    s_pre = np.zeros(s_cap, dtype=np.int64)
    s_kv = np.zeros(s_cap, dtype=np.int64)
    s_follows = np.zeros(s_cap, dtype=np.bool_)
    s_gapless = np.zeros(s_cap, dtype=np.bool_)
    s_off = np.zeros(s_cap + 1, dtype=np.int64)
    n_steps = 0
    rows = 0
    b_cap = 1024 if not record else max(1024, min(n * (target + 2), 1 << 22))
    b_prog = np.zeros(b_cap, dtype=np.int32)
    b_new = np.zeros(b_cap, dtype=np.int32)
    b_in = np.zeros(b_cap, dtype=np.int32)
    b_out = np.zeros(b_cap, dtype=np.int32)
    b_req = np.zeros(b_cap, dtype=np.int32)
    t_step = np.zeros(1024, dtype=np.int64)
    t_req = np.zeros(1024, dtype=np.int64)
    n_tok = 0
    total_pre = 0
    T = 0.0
    prev_end = -1.0
    synced = False

    for si in range(n_stages):
        lo, hi = stage_first[si], stage_first[si + 1]
        if si > 0:
            start_us = drain_time_us(
                stage_first[si - 1], lo, send, enq, status, last_step, s_start, s_cycle, s_follows, n_steps, otp_us,
                gap_us, timeout_us,
            )  # fmt: skip
            m = start_us
            if stage_start[si - 1] > m:
                m = stage_start[si - 1]
            if T > m:
                m = T
            start_us = m + interval_s * US_PER_S
        else:
            start_us = 0.0
        stage_start[si] = start_us
        for r in range(lo, hi):
            send[r] = start_us + offsets_s[r] * US_PER_S
        n_stage = hi - lo
        sent = lo  # requests below it are sent
        n_pend = 0
        p_dead = lo
        done = 0
        for r in range(lo, hi):  # Scheduler.reject_too_long
            if req_len[r] + target > max_len:
                status[r] = REJECTED
                done += 1
        while True:
            sent, n_pend = send_until(
                T, sent, hi, send, queue_us, per_running_us, last_batch, send_depth, enq, pend, n_pend
            )
            n_ready, n_pend = take_enqueued(T, enq, pend, n_pend, ready)
            for i in range(n_ready):  # Scheduler.enqueue
                r = ready[i]
                if status[r] == PENDING:
                    status[r] = WAITING
                    wq[(w_head + w_len) % (n + 1)] = r
                    w_len += 1
                    n_wait += 1
            while p_dead < hi and send[p_dead] + timeout_us <= T:  # Scheduler.abort
                r = p_dead
                s = status[r]
                if s == WAITING:
                    status[r] = ABORTED
                    n_wait -= 1
                    if slot_of[r] >= 0:
                        release(slot_of[r], blk, nblk, st, tab, lru_keys, free_slots)
                        slot_of[r] = -1
                    done += 1
                elif s == RUNNING:
                    i = 0
                    while rid[i] != r:
                        i += 1
                    out_tok[r] = rout[i]
                    release(slot_of[r], blk, nblk, st, tab, lru_keys, free_slots)
                    slot_of[r] = -1
                    status[r] = ABORTED
                    for j in range(i, n_run - 1):
                        rid[j], rcomp[j], rknown[j], rlen[j] = rid[j + 1], rcomp[j + 1], rknown[j + 1], rlen[j + 1]
                        rout[j], rblocks[j], rhend[j] = rout[j + 1], rblocks[j + 1], rhend[j + 1]
                    n_run -= 1
                    done += 1
                elif s == PENDING:
                    status[r] = ABORTED
                    done += 1
                p_dead += 1
            if done >= n_stage or (n_run == 0 and n_wait == 0):
                for f in range(n_fin):  # Scheduler.release_finishing
                    r = fin[f]
                    release(slot_of[r], blk, nblk, st, tab, lru_keys, free_slots)
                    slot_of[r] = -1
                n_fin = 0
                if done >= n_stage:  # requests rejected before they were sent still get their times
                    send_until(np.inf, sent, hi, send, queue_us, per_running_us, last_batch, send_depth, enq, pend, 0)
                    break
                if n_pend == 0 and sent >= hi:
                    raise RuntimeError("simulator invariant: a stage has requests neither done nor in the engine")
                e = next_event_us(sent, hi, send, enq, pend, n_pend)
                T = e if e > T else T
                continue

            # --- one step (engine._ClosedLoop.step) ---
            k = n_steps
            budget = budget_cap
            n_pre = 0
            if n_run > 0:  # Scheduler.schedule_running
                cum = 0
                for i in range(n_run):
                    cum += rknown[i] - rcomp[i]
                if cum <= budget:
                    for i in range(n_run):
                        alloc[i] = rknown[i] - rcomp[i]
                    budget -= cum
                else:
                    c = 0
                    used = 0
                    for i in range(n_run):
                        need = rknown[i] - rcomp[i]
                        left = budget - c
                        a = need if need < left else left
                        a = a if a > 0 else 0
                        alloc[i] = a
                        c += need
                        used += a
                    budget -= used
                tot = 0
                for i in range(n_run):
                    new_comp[i] = rcomp[i] + alloc[i]
                    tot += (new_comp[i] + BLOCK - 1) // BLOCK - rblocks[i]
                if tot <= kv_free(st):
                    for i in range(n_run):
                        nb = (new_comp[i] + BLOCK - 1) // BLOCK
                        g = nb - rblocks[i]
                        if g != 0:
                            take(g, slot_of[rid[i]], blk, nblk, st, tab, lru_keys)
                        rblocks[i] = nb
                else:  # Scheduler._schedule_with_preemption / schedule_with_preemption
                    for i in range(n_run):
                        alloc[i] = 0
                    budget = budget_cap
                    reserved = 0
                    n_alive = n_run
                    i = 0
                    while i < n_alive and budget > 0:
                        a = rknown[i] - rcomp[i]
                        a = a if a < budget else budget
                        g = (rcomp[i] + a + BLOCK - 1) // BLOCK - rblocks[i]
                        g = g if g > 0 else 0
                        stop = False
                        while g > kv_free(st) - reserved:
                            v = n_alive - 1
                            r = rid[v]
                            out_tok[r] = rout[v]
                            preempt_release(
                                r, slot_of[r], rcomp[v], rhend[v], stride, blk, nblk, st, tab, lru_keys,
                                free_slots,
                            )  # fmt: skip
                            slot_of[r] = -1
                            status[r] = WAITING
                            w_head = (w_head - 1) % (n + 1)  # to the head of the queue
                            wq[w_head] = r
                            w_len += 1
                            n_preempt[r] += 1
                            n_pre += 1
                            n_alive -= 1
                            if v == i:
                                stop = True
                                break
                        if stop:
                            break
                        alloc[i] = a
                        reserved += g
                        budget -= a
                        i += 1
                    n_wait += n_pre
                    total_pre += n_pre
                    n_run = n_alive
                    for i in range(n_run):
                        new_comp[i] = rcomp[i] + alloc[i]
                        want = (new_comp[i] + BLOCK - 1) // BLOCK
                        if want > rblocks[i]:
                            take(want - rblocks[i], slot_of[rid[i]], blk, nblk, st, tab, lru_keys)
                            rblocks[i] = want
                for i in range(n_run):  # register the prompt blocks this step fills
                    if rcomp[i] < rhend[i] and alloc[i] > 0:
                        r = rid[i]
                        u = req_user[r]
                        register_prompt(slot_of[r], blk, user_keys, u, n_user_keys[u], rcomp[i], new_comp[i], st, tab)
            if n_pre == 0 and n_wait > 0:  # Scheduler.admit
                n_slots = max_seqs - n_run - n_fin
                n_adm = 0
                while budget > 0 and n_wait > 0 and n_adm < n_slots:
                    r = wq[w_head]
                    if status[r] != WAITING:  # aborted while waiting
                        w_head = (w_head + 1) % (n + 1)
                        w_len -= 1
                        continue
                    L = req_len[r]
                    o = out_tok[r]
                    ntok = L + o
                    u = req_user[r]
                    nk = n_user_keys[u]
                    for j in range(nk):
                        keys[j] = user_keys[u, j]
                    max_hit = (ntok - 1) // BLOCK
                    if o > 0:  # a preempted request also hashes its full output blocks
                        for j in range(nk, max_hit):
                            keys[j] = request_key(r, j, stride)
                        nk = nk if nk > max_hit else max_hit
                    h, hf = lookup(keys, nk, max_hit, tab)
                    c0 = h * BLOCK
                    a = ntok - c0
                    a = a if a < budget else budget
                    nbk = (c0 + a + BLOCK - 1) // BLOCK
                    if nbk - h + hf > kv_free(st):
                        break
                    acquire(keys, h, st, tab)
                    slot = new_slot(st, free_slots)
                    for j in range(h):
                        blk[slot, j] = keys[j]
                    nblk[slot] = h
                    take(nbk - h, slot, blk, nblk, st, tab, lru_keys)
                    hend = (L // BLOCK) * BLOCK
                    if c0 < hend:
                        register_prompt(slot, blk, user_keys, u, n_user_keys[u], c0, c0 + a, st, tab)
                    slot_of[r] = slot
                    w_head = (w_head + 1) % (n + 1)
                    w_len -= 1
                    n_wait -= 1
                    status[r] = RUNNING
                    if admit_step[r] < 0:
                        admit_step[r] = k
                        hit_tokens[r] = c0
                    j = n_run  # Scheduler.join
                    rid[j], rcomp[j], rknown[j], rlen[j], rout[j], rblocks[j], rhend[j] = r, c0, ntok, L, o, nbk, hend
                    alloc[j] = a
                    new_comp[j] = c0 + a
                    n_run += 1
                    n_adm += 1
                    budget -= a
            if n_run == 0:  # nothing to compute
                if n_pre:
                    continue  # everything preempted: schedule again (admission allowed now)
                if n_fin:  # the engine waits for the last outputs, then retries
                    for f in range(n_fin):
                        r = fin[f]
                        release(slot_of[r], blk, nblk, st, tab, lru_keys, free_slots)
                        slot_of[r] = -1
                    n_fin = 0
                    synced = True
                    continue
                while w_len > 0 and status[wq[w_head]] != WAITING:  # Scheduler.reject_head
                    w_head = (w_head + 1) % (n + 1)
                    w_len -= 1
                if w_len > 0:
                    r = wq[w_head]
                    w_head = (w_head + 1) % (n + 1)
                    w_len -= 1
                    n_wait -= 1
                    status[r] = REJECTED
                    if slot_of[r] >= 0:
                        release(slot_of[r], blk, nblk, st, tab, lru_keys, free_slots)
                        slot_of[r] = -1
                    done += 1
                continue
            # the batch: running requests that compute tokens (Scheduler.batch)
            m = 0
            for i in range(n_run):
                if alloc[i] > 0:
                    fields[0, m] = rcomp[i]
                    fields[1, m] = alloc[i]
                    fields[2, m] = rlen[i]
                    fields[3, m] = rout[i]
                    m += 1
            t_model = program_step_time_us(
                vo, va, vc, rng, fph, fre, fsl, so, sa, sc, slots, k1p, k1v, k2p, k2v, scales, fields, m, vstack,
                masks, sstack,
            )  # fmt: skip
            cycle = t_model * step_scales[n_steps % len(step_scales)] + sched_us + n_pre * preempt_us
            if n_steps == len(s_start):
                s_start, s_time = grow(s_start, n_steps + 1), grow(s_time, n_steps + 1)
                s_cycle = grow(s_cycle, n_steps + 1)
                s_pre, s_kv = grow(s_pre, n_steps + 1), grow(s_kv, n_steps + 1)
                s_follows, s_gapless = grow(s_follows, n_steps + 1), grow(s_gapless, n_steps + 1)
                s_off = grow(s_off, len(s_start) + 1)
            s_start[k], s_time[k], s_cycle[k], s_pre[k] = T, t_model, cycle, n_pre
            s_follows[k] = T == prev_end and not synced
            s_gapless[k] = T == prev_end
            s_kv[k] = kv_total - kv_free(st)
            if record:
                if rows + m > len(b_prog):
                    b_prog, b_new, b_in = grow(b_prog, rows + m), grow(b_new, rows + m), grow(b_in, rows + m)
                    b_out, b_req = grow(b_out, rows + m), grow(b_req, rows + m)
                write_batch(b_prog, b_new, b_in, b_out, b_req, rows, rcomp, alloc, rlen, rout, rid, n_run)
            rows += m
            last_batch = m
            s_off[k + 1] = rows
            n_steps += 1
            synced = False
            for f in range(n_fin):  # their output was processed while this step ran
                r = fin[f]
                release(slot_of[r], blk, nblk, st, tab, lru_keys, free_slots)
                slot_of[r] = -1
            n_fin = 0
            T = T + cycle
            prev_end = T
            # the step's outcome (Scheduler.step_done)
            w = 0
            if log_tokens and n_tok + n_run > len(t_step):  # grown here, not in the loop: an array
                t_step, t_req = grow(t_step, n_tok + n_run), grow(t_req, n_tok + n_run)  # reassigned in a
            for i in range(n_run):  # loop costs two atomic reference counts per iteration
                rcomp[i] = new_comp[i]
                if rcomp[i] == rknown[i]:
                    if log_tokens:
                        t_step[n_tok] = k
                        t_req[n_tok] = rid[i]
                        n_tok += 1
                    rout[i] += 1
                    rknown[i] += 1
                    if rout[i] == 1:
                        first_step[rid[i]] = k
                if rout[i] >= target:
                    r = rid[i]
                    fin[n_fin] = r
                    n_fin += 1
                    last_step[r] = k
                    out_tok[r] = rout[i]
                    status[r] = FINISHED
                    done += 1
                else:
                    rid[w], rcomp[w], rknown[w], rlen[w] = rid[i], rcomp[i], rknown[i], rlen[i]
                    rout[w], rblocks[w], rhend[w] = rout[i], rblocks[i], rhend[i]
                    w += 1
            n_run = w
    return (
        status, out_tok, admit_step, first_step, last_step, n_preempt, hit_tokens, send, enq, stage_start,
        s_start[:n_steps], s_time[:n_steps], s_cycle[:n_steps], s_pre[:n_steps], s_kv[:n_steps],
        s_follows[:n_steps], s_gapless[:n_steps], s_off[: n_steps + 1],
        b_prog[:rows], b_new[:rows], b_in[:rows], b_out[:rows], b_req[:rows],
        t_step[:n_tok], t_req[:n_tok], total_pre, kv_free(st), held_blocks(tab), send_depth,
    )  # fmt: skip


flush_when_changed(
    [run_closed_loop],
    [sys.modules[__name__], core_kv, core_log, kv_cache, recording, program_eval, kernel_lookup, program],
    "fitness.sim.core",
)
