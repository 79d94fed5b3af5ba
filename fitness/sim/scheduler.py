"""vLLM V1's scheduler (v0.15) over the KV pool: the running set, the waiting queue, preemption.

Once per step, with a budget of ``max_num_batched_tokens`` tokens: running requests first,
in admission order (one token per decode; for a request still in prefill the rest of its
prompt, capped by what is left of the budget: chunked prefill), then waiting requests first
come first served until ``max_num_seqs`` run, the budget is spent or KV blocks run out.
Waiting requests are not admitted in a step that preempted (as vLLM does).

**Preemption**: when a running request needs a block and none is free, the most recently
admitted running request is preempted: its blocks are freed (full ones stay cached, so the
recompute may hit them), its progress reset, and it goes back to the head of the waiting
queue; the recompute covers prompt + tokens generated so far. A partial prefill returns no
token; the step that completes the (re)computation samples the next token.

A request that finishes at step k keeps its slot and KV blocks while step k+1 is scheduled
(its output is processed while k+1 runs; vLLM knows it reached max_tokens and does not
schedule it): it waits in ``finishing`` until the engine releases it.

Speed: the running set lives in numpy arrays (one vector operation per quantity per step);
Python loops only touch requests that cross a KV block boundary, are admitted, finish or
are preempted. Indices come from ``mask.nonzero()[0]`` (what ``np.flatnonzero`` computes for
a 1-D array, without its Python wrapper: a few µs a step).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from fitness.sim.kv_cache import (
    BLOCK,
    PrefixKV,
    blocks_for,
    key_stride,
    preempt_release,
    prompt_block_keys,
    register_prompt,
    request_key,
)
from fitness.sim.loadgen import LoadPlan
from fitness.sim.recording import ABORTED, FINISHED, PENDING, REJECTED, RUNNING, WAITING
from primitives.data.experiments import ExperimentSpec

EMPTY = np.zeros(0, dtype=np.int64)
EMPTY.flags.writeable = False  # shared by every empty running set


class RunningSet:
    """The running requests in admission order, one int64 array per quantity."""

    __slots__ = ("id", "computed", "known", "input_len", "output_len", "blocks", "hash_end")
    FIELDS = __slots__

    def __init__(self):
        self.id = EMPTY  # request index
        self.computed = EMPTY  # tokens in the KV cache
        self.known = EMPTY  # prompt + tokens generated so far (all of them must be computed)
        self.input_len = EMPTY
        self.output_len = EMPTY  # tokens generated so far
        self.blocks = EMPTY  # KV blocks held
        self.hash_end = EMPTY  # end of the prompt's full (hashable) blocks, in tokens

    def __len__(self) -> int:
        return len(self.id)

    def keep(self, mask: np.ndarray) -> None:
        for name in self.FIELDS:
            setattr(self, name, getattr(self, name)[mask])

    def truncate(self, n: int) -> None:
        for name in self.FIELDS:
            setattr(self, name, getattr(self, name)[:n])

    def append(self, rows: np.ndarray) -> None:
        """Add admitted requests: ROWS has one row per request, one column per field (in FIELDS order)."""
        for j, name in enumerate(self.FIELDS):
            setattr(self, name, np.concatenate([getattr(self, name), rows[:, j]]))


class Scheduler:
    """The server's scheduler state: KV pool, waiting queue, running set and every request's fate.

    Per-request arrays (indexed by request): ``status`` (see ``fitness.sim.recording``),
    ``out_tok`` (tokens generated), ``admit_step`` / ``first_step`` / ``last_step`` (first
    admission, first and last token), ``n_preempt``, ``hit_tokens`` (prefix-cache hit at first
    admission).
    """

    def __init__(self, spec: ExperimentSpec, load: LoadPlan, input_len: np.ndarray, kv_total: int):
        n = load.num_requests
        self.budget_cap = int(spec.max_num_batched_tokens)
        self.max_seqs = int(spec.max_num_seqs)
        self.max_len = int(spec.max_model_len)
        self.target = int(load.output_len)
        self.req_user = load.request_user
        self.req_L = input_len
        self.stride = key_stride(self.max_len)
        self.user_keys = prompt_block_keys(load.shapes, self.stride)

        self.status = np.full(n, PENDING, dtype=np.int8)
        self.out_tok = np.zeros(n, dtype=np.int64)
        self.admit_step = np.full(n, -1, dtype=np.int64)
        self.first_step = np.full(n, -1, dtype=np.int64)
        self.last_step = np.full(n, -1, dtype=np.int64)
        self.n_preempt = np.zeros(n, dtype=np.int64)
        self.hit_tokens = np.zeros(n, dtype=np.int64)
        self.blocks_of: dict[int, list[int]] = {}

        self.kv = PrefixKV(kv_total)
        self.waiting: deque[int] = deque()
        self.n_waiting = 0  # live entries of ``waiting`` (aborted ones are skipped lazily)
        self.finishing: list[int] = []  # finished in the last step: slot and blocks held until released
        self.run = RunningSet()
        self.total_preempt = 0
        # (step, requests that sampled a token in it) of every step: only when percentiles are asked for
        self.token_log: list[tuple[int, np.ndarray]] | None = None

    # --- requests arriving and leaving -----------------------------------------------

    def reject_too_long(self, lo: int, hi: int) -> int:
        """Requests LO..HI-1 too long for the model: vLLM answers 400 at once. Returns how many."""
        too_long = self.req_L[lo:hi] + self.target > self.max_len
        if not too_long.any():
            return 0
        bad = lo + too_long.nonzero()[0]
        self.status[bad] = REJECTED
        return len(bad)

    def enqueue(self, r: int) -> None:
        if self.status[r] == PENDING:
            self.status[r] = WAITING
            self.waiting.append(r)
            self.n_waiting += 1

    def abort(self, r: int) -> int:
        """The client gave up on R: abort it (frees its KV blocks and slot). Returns 1 if that ended it."""
        status = self.status
        s = status[r]
        if s == WAITING:
            status[r] = ABORTED
            self.n_waiting -= 1
            blocks = self.blocks_of.pop(r, None)
            if blocks:
                self.kv.release(blocks)
            return 1
        if s == RUNNING:
            run = self.run
            i = int((run.id == r).nonzero()[0][0])
            self.out_tok[r] = run.output_len[i]
            self.kv.release(self.blocks_of.pop(r))
            status[r] = ABORTED
            keep = np.ones(len(run.id), dtype=bool)
            keep[i] = False
            run.keep(keep)
            return 1
        if s == PENDING:
            status[r] = ABORTED
            return 1
        return 0

    def reject_head(self) -> int:
        """The waiting head can never fit the KV cache: reject it. Returns 1 if there was one."""
        waiting, status = self.waiting, self.status
        while waiting and status[waiting[0]] != WAITING:
            waiting.popleft()
        if not waiting:
            return 0
        r = waiting.popleft()
        self.n_waiting -= 1
        status[r] = REJECTED
        blocks = self.blocks_of.pop(r, None)
        if blocks:
            self.kv.release(blocks)
        return 1

    def release_finishing(self) -> None:
        """The outputs of the last finished requests were processed: free their slots and blocks."""
        for r in self.finishing:
            self.kv.release(self.blocks_of.pop(r))
        self.finishing.clear()

    def idle(self) -> bool:
        return len(self.run.id) == 0 and self.n_waiting == 0

    # --- one step ---------------------------------------------------------------------

    def schedule_running(self) -> tuple[np.ndarray, np.ndarray, int, int]:
        """Tokens for the running requests, in admission order: (alloc, computed after the step,
        budget left, requests preempted)."""
        run = self.run
        budget = self.budget_cap
        if not len(run.id):
            return EMPTY, EMPTY, budget, 0
        n_pre = 0
        need = run.known - run.computed
        cum = np.cumsum(need)
        if cum[-1] <= budget:
            alloc = need
            budget -= int(cum[-1])
        else:
            alloc = np.minimum(need, np.maximum(budget - (cum - need), 0))
            budget -= int(alloc.sum())
        new_comp = run.computed + alloc
        nb = blocks_for(new_comp)
        grow = nb - run.blocks
        tot = int(grow.sum())
        if tot <= self.kv.free():
            if tot:
                for i in grow.nonzero()[0].tolist():
                    self.blocks_of[int(run.id[i])].extend(self.kv.take(int(grow[i])))
            run.blocks = nb
        else:
            alloc, budget, new_comp, n_pre = self._schedule_with_preemption()
        # register prompt blocks that this step fills (others may hit them at once)
        pm = ((run.computed < run.hash_end) & (alloc > 0)).nonzero()[0]
        for i in pm.tolist():
            r = int(run.id[i])
            register_prompt(
                self.blocks_of[r],
                self.user_keys[int(self.req_user[r])],
                int(run.computed[i]),
                int(new_comp[i]),
                self.kv,
            )
        return alloc, new_comp, budget, n_pre

    def _schedule_with_preemption(self) -> tuple[np.ndarray, int, np.ndarray, int]:
        """Slow path: sequential, preempting from the end (vLLM's running loop); allocates the blocks."""
        run, kv = self.run, self.kv
        preempted: list[int] = []

        def preempt(i: int) -> None:
            r = int(run.id[i])
            self.out_tok[r] = run.output_len[i]
            preempt_release(r, int(run.computed[i]), int(run.hash_end[i]), kv, self.blocks_of, self.stride)
            self.status[r] = WAITING
            self.waiting.appendleft(r)  # the last one preempted ends at the head
            self.n_preempt[r] += 1
            preempted.append(r)

        alloc, budget, n_alive = schedule_with_preemption(
            run.computed, run.known, run.blocks, self.budget_cap, kv, preempt
        )
        n_pre = len(preempted)
        self.n_waiting += n_pre
        self.total_preempt += n_pre
        run.truncate(n_alive)
        alloc = alloc[:n_alive]
        new_comp = run.computed + alloc
        nblk = run.blocks.copy()
        for i in range(n_alive):
            want = -(-int(new_comp[i]) // BLOCK)
            have = int(nblk[i])
            if want > have:
                self.blocks_of[int(run.id[i])].extend(kv.take(want - have))
                nblk[i] = want
        run.blocks = nblk
        return alloc, budget, new_comp, n_pre

    def admit(self, budget: int, step: int) -> list[tuple[int, int, int, int, int, int, int, int]]:
        """Admit waiting requests FCFS into step STEP while budget, slots and blocks last.

        Returns one row per admitted request: the RunningSet fields, then the tokens scheduled.
        """
        adm: list[tuple[int, int, int, int, int, int, int, int]] = []
        if not self.n_waiting:
            return adm
        kv, waiting, status, user_keys, stride = self.kv, self.waiting, self.status, self.user_keys, self.stride
        n_slots = self.max_seqs - len(self.run.id) - len(self.finishing)
        while budget > 0 and self.n_waiting > 0 and len(adm) < n_slots:
            r = waiting[0]
            if status[r] != WAITING:  # aborted while waiting
                waiting.popleft()
                continue
            L = int(self.req_L[r])
            o = int(self.out_tok[r])
            ntok = L + o
            keys = user_keys[int(self.req_user[r])]
            if o > 0:  # a preempted request also hashes its full output blocks
                keys = keys + [request_key(r, j, stride) for j in range(len(keys), (ntok - 1) // BLOCK)]
            h, hf = kv.lookup(keys, (ntok - 1) // BLOCK)
            c0 = h * BLOCK
            a = min(ntok - c0, budget)
            nbk = -(-(c0 + a) // BLOCK)
            if nbk - h + hf > kv.free():
                break
            kv.acquire(keys[:h])
            blocks = keys[:h] + kv.take(nbk - h)
            hend = (L // BLOCK) * BLOCK
            if c0 < hend:
                register_prompt(blocks, user_keys[int(self.req_user[r])], c0, c0 + a, kv)
            self.blocks_of[r] = blocks
            waiting.popleft()
            self.n_waiting -= 1
            status[r] = RUNNING
            if self.admit_step[r] < 0:
                self.admit_step[r] = step
                self.hit_tokens[r] = c0
            adm.append((r, c0, ntok, L, o, nbk, hend, a))
            budget -= a
        return adm

    def join(self, adm: list, alloc: np.ndarray, new_comp: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The admitted requests join the running set: (progress, new tokens, computed after the step)."""
        run = self.run
        if not adm:
            return run.computed, alloc, new_comp
        ad = np.array(adm, dtype=np.int64)
        b_new = np.concatenate([alloc, ad[:, 7]])
        run.append(ad)
        b_prog = run.computed
        return b_prog, b_new, b_prog + b_new

    def batch(self, b_prog: np.ndarray, b_new: np.ndarray) -> tuple[np.ndarray, ...]:
        """The step's batch (the requests that compute tokens): progress, new tokens, input and
        output length, request index."""
        run = self.run
        if b_new.min() > 0:
            return b_prog, b_new, run.input_len, run.output_len, run.id
        sel = (b_new > 0).nonzero()[0]
        return b_prog[sel], b_new[sel], run.input_len[sel], run.output_len[sel], run.id[sel]

    def step_done(self, new_comp: np.ndarray, step: int) -> int:
        """Step STEP ran: tokens sampled, requests finished. Returns how many finished."""
        run = self.run
        run.computed = new_comp
        sampled = run.computed == run.known
        if not sampled.any():
            return 0
        if self.token_log is not None:
            self.token_log.append((step, run.id[sampled]))
        run.output_len = run.output_len + sampled
        run.known = run.known + sampled
        fresh = sampled & (run.output_len == 1)
        if fresh.any():
            self.first_step[run.id[fresh]] = step
        fin = run.output_len >= self.target
        if not fin.any():
            return 0
        fi = fin.nonzero()[0]
        rs = run.id[fi]
        self.finishing.extend(rs.tolist())
        self.last_step[rs] = step
        self.out_tok[rs] = run.output_len[fi]
        self.status[rs] = FINISHED
        run.keep(~fin)
        return len(fi)


def schedule_with_preemption(r_comp, r_ntok, r_nblk, budget_cap, kv: PrefixKV, preempt):
    """vLLM's running loop when blocks run short: returns (alloc, budget left, requests left).

    Running request i gets min(need, budget left) tokens; while the blocks it needs are not
    free, the last running request is preempted (``preempt(index)`` releases its blocks) —
    until they are, or until i itself is the one preempted (then the loop stops). Blocks are
    only counted here; the caller allocates them for the requests left.
    """
    n = len(r_comp)
    alloc = np.zeros(n, dtype=np.int64)
    budget = budget_cap
    reserved = 0  # blocks promised to earlier requests of this step
    n_alive = n
    comp = r_comp.tolist()
    ntok = r_ntok.tolist()
    nblk = r_nblk.tolist()
    i = 0
    while i < n_alive and budget > 0:
        a = min(ntok[i] - comp[i], budget)
        g = max(-(-(comp[i] + a) // BLOCK) - nblk[i], 0)
        stop = False
        while g > kv.free() - reserved:
            v = n_alive - 1
            preempt(v)
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
    return alloc, budget, n_alive
