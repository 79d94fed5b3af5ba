"""Closed-loop simulation of a vLLM V1 (v0.15) server under the inference-perf load generator.

The server side (``/work/shared/NOTES.md`` §4):

* **Scheduler**, once per step with a budget of ``max_num_batched_tokens`` tokens:
  running requests first, in admission order (one token per decode; for a request still
  in prefill the rest of its prompt, capped by what is left of the budget: chunked
  prefill), then waiting requests first come first served until ``max_num_seqs`` run,
  the budget is spent or KV blocks run out. Waiting requests are not admitted in a step
  that preempted (as vLLM does).
* **Prefix caching** on 16-token blocks: a new request reuses the longest chain of full
  blocks of its prompt that is cached (a group's system prompt; a repeating user's whole
  prompt), capped below its full length so at least one token is computed. Blocks are
  registered as soon as they are scheduled full; freed blocks stay cached in an LRU free
  queue (freed in reverse order, so a request's tail is evicted first) until their
  space is allocated.
* **Preemption**: when a running request needs a block and none is free, the most
  recently admitted running request is preempted: its blocks are freed (full ones stay
  cached, so the recompute may hit them), its progress reset, and it goes back to the
  head of the waiting queue; the recompute covers prompt + tokens generated so far.
* A partial prefill returns no token; the step that completes the (re)computation
  samples the next token.
* **Asynchronous scheduling**: the step starting at ``T_k`` is scheduled at ``T_k`` with
  the requests enqueued by then; its cycle is ``model.step_time_us(batch) +
  scheduling_processing_us (+ preemption_processing_us per preemption)``; its tokens reach
  the client at the end of the *following* step (at the end of the step itself when the
  engine idles afterwards) plus ``output_token_processing_us``. A request is enqueued
  ``queueing_time_us(input_len)`` after it is sent (HTTP + tokenisation). The engine
  idles until the next enqueue when nothing is runnable. A request that finishes at step k
  keeps its slot and KV blocks while step k+1 is scheduled (its output is processed while
  k+1 runs; vLLM knows it reached max_tokens and does not schedule it).
* **Timeouts**: the client gives up ``request_timeout_s`` after sending; the engine
  aborts the request (freeing its KV blocks and slot) at the first step start after.

The client side (arrivals, prompts, the two-events-per-token arithmetic) is
``fitness.sim.loadgen``. With ``record=True`` the run also returns a :class:`Trajectory`:
every step's batch in CSR form and every request's path through the steps, from which
``fitness.sim.replay`` re-times the run for other step times without re-simulating.

Speed: the running set lives in numpy arrays (one vector operation per quantity per
step); Python loops only touch requests that cross a KV block boundary, are admitted,
finish or are preempted.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from primitives.deployment import KV_BLOCK_TOKENS, Deployment

from primitives.data.experiments import ExperimentSpec, ObservedMetrics
from fitness.sim.loadgen import DEFAULT_EVENT_GAP_US, LoadPlan, build_load, client_times, lifecycle_metrics

BLOCK = KV_BLOCK_TOKENS
US_PER_S = 1e6

# Request states
PENDING, WAITING, RUNNING, FINISHED, ABORTED, REJECTED = range(6)


class LatencyModel(Protocol):
    """What the simulator asks of a step-time model (duck-typed; all times in µs)."""

    output_token_processing_us: float  # engine emits a token -> client receives it
    scheduling_processing_us: float  # added to every step's cycle
    preemption_processing_us: float  # added to a step's cycle per preemption

    def step_time_us(self, progress: np.ndarray, new_tokens: np.ndarray, input_len: np.ndarray,
                     output_len: np.ndarray) -> float: ...

    def queueing_time_us(self, input_len: np.ndarray) -> np.ndarray: ...


@dataclass
class Overheads:
    """The non-step terms of a latency model (µs); also usable as the ``overheads`` of replay.

    ``queueing_time_us(L) = queueing_base_us + queueing_per_input_token_us * L`` (HTTP +
    tokenisation, arrival -> enqueued at the scheduler).
    """

    queueing_base_us: float = 0.0
    queueing_per_input_token_us: float = 0.0
    output_token_processing_us: float = 0.0
    scheduling_processing_us: float = 0.0
    preemption_processing_us: float = 0.0
    event_gap_us: float = DEFAULT_EVENT_GAP_US

    def queueing_time_us(self, input_len: np.ndarray) -> np.ndarray:
        return self.queueing_base_us + self.queueing_per_input_token_us * np.asarray(input_len, dtype=np.float64)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(cls.__dataclass_fields__)


@dataclass
class PhysicsLatencyModel(Overheads):
    """A hand-made roofline-ish step-time model over the deployment constants (reference).

    ``step_time_us = dense + kv_coef * kv_io_time + attention_coef * attention_time +
    per_layer_us * n_layers + allreduce_latency_us * allreduce_calls + per_request_us *
    batch_size + base_us`` with ``dense = max(weight_coef * weight_time, matmul_coef *
    matmul_time)`` (a roofline: streaming the weights or the matmul FLOPs, whichever is
    longer) or their sum when ``roofline`` is False; each ``*_time`` as in
    ``primitives.registry``. Vector sums only: cheap enough for the closed loop.
    """

    deployment: Deployment | None = None
    weight_coef: float = 1.2
    kv_coef: float = 1.5
    matmul_coef: float = 0.0
    attention_coef: float = 0.0
    per_layer_us: float = 90.0
    allreduce_latency_us: float = 0.0  # per all-reduce launch (2 per layer at TP > 1)
    per_request_us: float = 0.0
    base_us: float = 0.0
    roofline: bool = True

    def __post_init__(self) -> None:
        if self.deployment is None:
            raise ValueError("PhysicsLatencyModel needs a deployment")
        c = self.deployment.constants
        self._weight_us = c["weight_bytes_per_gpu"] / c["hbm_bytes_per_us"]
        self._kv_us_per_token = c["kv_bytes_per_token_per_gpu"] / c["hbm_bytes_per_us"]
        self._matmul_us_per_token = 2.0 * c["active_params_per_gpu"] / c["dense_flops_per_us"]
        self._attn_us_per_pair = c["attn_flops_per_token_pair_per_gpu"] / c["dense_flops_per_us"]
        calls = 2.0 * c["n_layers"] if c["tp"] > 1 else 0.0
        self._weight_part_us = self.weight_coef * self._weight_us
        self._fixed_us = self.per_layer_us * c["n_layers"] + self.allreduce_latency_us * calls + self.base_us

    def step_time_us(self, progress, new_tokens, input_len, output_len) -> float:
        tokens = float(new_tokens.sum())
        kv = float(progress.sum()) + tokens
        matmul = self.matmul_coef * self._matmul_us_per_token * tokens
        dense = max(self._weight_part_us, matmul) if self.roofline else self._weight_part_us + matmul
        t = dense + self._fixed_us + self.kv_coef * self._kv_us_per_token * (kv + tokens)
        t += self.per_request_us * len(new_tokens)
        if self.attention_coef:
            work = float((new_tokens * (progress + new_tokens / 2.0)).sum())
            t += self.attention_coef * self._attn_us_per_pair * work
        return t


@dataclass(eq=False)
class RequestTable:
    """Per-request outcome of a run (times in µs, NaN where not applicable)."""

    send_us: np.ndarray
    enqueue_us: np.ndarray
    stage: np.ndarray
    user: np.ndarray
    input_len: np.ndarray
    output_tokens: np.ndarray  # tokens the engine generated
    target_tokens: np.ndarray  # max_tokens (ignore_eos): output_len
    status: np.ndarray  # FINISHED / ABORTED / REJECTED at the engine
    success: np.ndarray  # bool: finished and received within the client timeout
    ttft_us: np.ndarray
    e2e_us: np.ndarray
    tpot_us: np.ndarray
    preemptions: np.ndarray
    prefix_hit_tokens: np.ndarray  # tokens reused from the prefix cache at first admission

    @property
    def n(self) -> int:
        return len(self.send_us)


@dataclass(eq=False)
class Trajectory:
    """A recorded run: the batches (CSR) and each request's path through the steps.

    Steps ``k`` run from ``step_start_us[k]`` for ``step_cycle_us[k]`` (= the model's
    ``step_time_us[k]`` + scheduling overhead + preemption overheads). The batch of step k
    is rows ``step_offsets[k]:step_offsets[k+1]`` of the ``batch_*`` arrays (BLIS fields:
    progress = tokens in the KV cache before the step, new_tokens, input_len, output_len =
    tokens generated so far; ``batch_request`` = request index).

    Request ``r``'s path: enqueued while step ``enq_step[r]`` ran, ``enq_frac[r]`` of the way
    through it (-1 if the engine was idle: its enqueue started step ``wait_from_step[r]``);
    waits from ``wait_from_step[r]`` (the first step it could join) to its admission at
    ``admit_step[r]``; first token sampled at ``first_token_step[r]``, last at ``last_step[r]``.
    ``next_contiguous[k]``: step k+1 started right when step k ended (no idle gap).
    ``output_delayed[k]``: step k+1 was launched before step k's outputs were processed
    (asynchronous scheduling), so step k's tokens reach the client at the end of step k+1;
    False when the engine idled (or had to wait for those outputs) after step k. Steps on a
    request's path follow each other without gaps: ``step_start_us[k+1] = step_start_us[k] +
    step_cycle_us[k]`` there.
    """

    step_start_us: np.ndarray
    step_time_us: np.ndarray
    step_cycle_us: np.ndarray
    step_preemptions: np.ndarray
    next_contiguous: np.ndarray
    output_delayed: np.ndarray
    step_offsets: np.ndarray
    batch_progress: np.ndarray
    batch_new_tokens: np.ndarray
    batch_input_len: np.ndarray
    batch_output_len: np.ndarray
    batch_request: np.ndarray
    # per request
    send_us: np.ndarray
    queueing_us: np.ndarray
    input_len: np.ndarray
    target_tokens: np.ndarray
    stage: np.ndarray
    success: np.ndarray
    enq_step: np.ndarray
    enq_frac: np.ndarray
    wait_from_step: np.ndarray
    admit_step: np.ndarray
    first_token_step: np.ndarray
    last_step: np.ndarray
    preemptions: np.ndarray
    n_stages: int
    name: str = ""

    @property
    def n_steps(self) -> int:
        return len(self.step_start_us)

    @property
    def batch_step(self) -> np.ndarray:
        """Step index of every batch row (for ``primitives.compute.features_from_requests``)."""
        return np.repeat(np.arange(self.n_steps, dtype=np.int64), np.diff(self.step_offsets))

    def features(self, names: list[str] | None = None) -> dict[str, np.ndarray]:
        """Every registry feature of every step, in bulk."""
        from primitives.compute import features_from_requests

        return features_from_requests(self.batch_step, self.batch_progress, self.batch_new_tokens,
                                      self.batch_input_len, self.batch_output_len, self.n_steps, names)

    def without_batches(self) -> "Trajectory":
        """A copy without the per-step batch rows (all replay needs; a fraction of the memory)."""
        from dataclasses import replace

        empty = np.zeros(0, dtype=np.int32)
        return replace(self, step_offsets=np.zeros(self.n_steps + 1, dtype=np.int64), batch_progress=empty,
                       batch_new_tokens=empty, batch_input_len=empty, batch_output_len=empty, batch_request=empty)

    def batch(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        a, b = self.step_offsets[k], self.step_offsets[k + 1]
        return (self.batch_progress[a:b], self.batch_new_tokens[a:b], self.batch_input_len[a:b],
                self.batch_output_len[a:b])


@dataclass(eq=False)
class SimResult:
    metrics: ObservedMetrics  # same keys as the observed results (means in seconds)
    requests: RequestTable
    trajectory: Trajectory | None
    n_steps: int
    kv_capacity_blocks: int
    stage_start_us: np.ndarray
    total_preemptions: int = 0
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------
# The KV block pool with prefix caching


class _PrefixKV:
    """Block pool with hashed full blocks and an LRU free queue (vLLM V1 BlockPool).

    A block is identified by a key: hashed blocks by their content key (an int whose two low
    bits give the kind: 0 group system prompt, 1 user prompt, 2 request-specific), blocks
    without a hash by a fresh id with low bits 3. ``ref`` holds the reference count of every
    cached (hashed) block; cached blocks with count 0 sit in the free queue, where allocation
    evicts them oldest first. Never-used blocks are just a count (they precede every freed
    block in vLLM's free queue).
    """

    __slots__ = ("fresh", "lru", "ref", "next_anon", "total")

    def __init__(self, total_blocks: int):
        self.total = total_blocks
        self.fresh = total_blocks
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.ref: dict[int, int] = {}
        self.next_anon = 3

    def free(self) -> int:
        return self.fresh + len(self.lru)

    def take(self, k: int) -> list[int]:
        """Allocate K blocks (evicting cached ones oldest first); returns their anon ids."""
        fresh = self.fresh
        if fresh >= k:
            self.fresh = fresh - k
        else:
            self.fresh = 0
            lru, ref = self.lru, self.ref
            for _ in range(k - fresh):
                key, _ = lru.popitem(last=False)
                if key & 3 != 3:
                    del ref[key]
        start = self.next_anon
        self.next_anon = start + 4 * k
        return list(range(start, start + 4 * k, 4))

    def lookup(self, keys: list[int], max_hit: int) -> tuple[int, int]:
        """Longest cached chain of KEYS (at most MAX_HIT): (blocks hit, of which in the free queue)."""
        ref = self.ref
        h = hf = 0
        for key in keys[:max_hit]:
            c = ref.get(key)
            if c is None:
                break
            h += 1
            if c == 0:
                hf += 1
        return h, hf

    def acquire(self, keys: list[int]) -> None:
        ref, lru = self.ref, self.lru
        for key in keys:
            c = ref[key]
            if c == 0:
                del lru[key]
            ref[key] = c + 1

    def release(self, blocks: list[int]) -> None:
        """Free a request's blocks, tail first (vLLM frees in reverse order)."""
        ref, lru = self.ref, self.lru
        for key in reversed(blocks):
            if key & 3 == 3:
                lru[key] = None
            else:
                c = ref[key] - 1
                ref[key] = c
                if c == 0:
                    lru[key] = None


def _group_key(g: int, j: int, stride: int) -> int:
    return (g * stride + j) << 2


def _user_key(u: int, j: int, stride: int) -> int:
    return ((u * stride + j) << 2) | 1


def _request_key(r: int, j: int, stride: int) -> int:
    return ((r * stride + j) << 2) | 2


class _Recorder:
    """Growing int32 buffers for the per-step batch rows."""

    def __init__(self, capacity: int):
        self.cap = max(int(capacity), 1024)
        self.pos = 0
        self.cols = [np.empty(self.cap, dtype=np.int32) for _ in range(5)]

    def add(self, prog, new, inl, outl, req) -> None:
        m = len(new)
        end = self.pos + m
        if end > self.cap:
            self.cap = max(2 * self.cap, end)
            self.cols = [np.concatenate([c[: self.pos], np.empty(self.cap - self.pos, dtype=np.int32)])
                         for c in self.cols]
        p = self.pos
        c = self.cols
        c[0][p:end] = prog
        c[1][p:end] = new
        c[2][p:end] = inl
        c[3][p:end] = outl
        c[4][p:end] = req
        self.pos = end

    def arrays(self) -> list[np.ndarray]:
        return [c[: self.pos].copy() for c in self.cols]


# ---------------------------------------------------------------------------
# The closed loop


def simulate(spec: ExperimentSpec, deployment: Deployment, model: LatencyModel, seed: int = 0,
             record: bool = True, load: LoadPlan | None = None,
             kv_capacity_blocks: int | None = None) -> SimResult:
    """Run SPEC's load against a simulated vLLM server whose steps take MODEL's times.

    ``load`` overrides the seeded load plan (tests); ``kv_capacity_blocks`` overrides the
    capacity derived from the deployment (``kv_capacity_tokens(gpu_memory_utilization)``).
    """
    if load is None:
        load = build_load(spec, seed)
    if kv_capacity_blocks is None:
        kv_capacity_blocks = deployment.kv_capacity_tokens(spec.gpu_memory_utilization) // BLOCK
    kv_total = int(kv_capacity_blocks)
    budget_cap = int(spec.max_num_batched_tokens)
    max_seqs = int(spec.max_num_seqs)
    max_len = int(spec.max_model_len)
    sched_us = float(getattr(model, "scheduling_processing_us", 0.0))
    preempt_us = float(getattr(model, "preemption_processing_us", 0.0))
    otp_us = float(getattr(model, "output_token_processing_us", 0.0))
    gap_us = float(getattr(model, "event_gap_us", DEFAULT_EVENT_GAP_US))
    step_time = model.step_time_us

    N = load.num_requests
    shapes = load.shapes
    req_user = load.request_user
    req_L = shapes.user_prompt_len[req_user].astype(np.int64)
    target = int(load.output_len)
    timeout_us = load.timeout_s * US_PER_S
    q_us = np.asarray(model.queueing_time_us(req_L), dtype=np.float64) * np.ones(N)
    stride = max(512, max_len // BLOCK + 2)

    # Prompt block keys of each user: group-shared while the block lies inside the group's
    # system prompt, user-specific after; only full blocks are hashable.
    user_keys: list[list[int]] = []
    for u in range(shapes.num_users):
        g = int(shapes.user_group[u])
        sys_len = int(shapes.group_system_len[g])
        nfull = int(shapes.user_prompt_len[u]) // BLOCK
        user_keys.append([_group_key(g, j, stride) if (j + 1) * BLOCK <= sys_len else _user_key(u, j, stride)
                          for j in range(nfull)])

    # --- per-request state (global arrays) ---------------------------------------
    send_us = np.full(N, np.nan)
    enq_us = np.full(N, np.nan)
    status = np.full(N, PENDING, dtype=np.int8)
    out_tok = np.zeros(N, dtype=np.int64)
    admit_step = np.full(N, -1, dtype=np.int64)
    first_step = np.full(N, -1, dtype=np.int64)
    last_step = np.full(N, -1, dtype=np.int64)
    n_preempt = np.zeros(N, dtype=np.int64)
    hit_tokens = np.zeros(N, dtype=np.int64)
    blocks_of: dict[int, list[int]] = {}

    kv = _PrefixKV(kv_total)
    waiting: deque[int] = deque()
    n_waiting = 0  # live entries of ``waiting`` (aborted ones are skipped lazily)
    # Requests that finished in the last step: with asynchronous scheduling their output is
    # processed while the next step runs, so they keep their slot and KV blocks through the
    # next scheduling (vLLM skips scheduling them: it knows max_tokens is reached).
    finishing: list[int] = []

    def release_finishing() -> None:
        for r in finishing:
            kv.release(blocks_of.pop(r))
        finishing.clear()

    # --- running set, in admission order ----------------------------------------
    E = np.zeros(0, dtype=np.int64)
    r_id, r_comp, r_ntok, r_L, r_out, r_nblk, r_hend = E, E, E, E, E, E, E

    # --- step records ------------------------------------------------------------
    st_start: list[float] = []
    st_time: list[float] = []
    st_cycle: list[float] = []
    st_pre: list[int] = []
    st_follows: list[bool] = []  # step k was launched while step k-1 ran (k-1's outputs delayed)
    st_gapless: list[bool] = []  # step k started right at the end of step k-1
    st_off: list[int] = [0]
    rec = _Recorder(min(int(N * (target + 2) * 1.05), 1 << 22) if record else 1)
    n_rows = 0

    T = 0.0
    prev_end = -1.0
    synced = False
    total_preempt = 0
    stage_start = np.zeros(len(load.stage_offsets_s))
    stage_first = load.stage_first_request

    for si, offsets in enumerate(load.stage_offsets_s):
        lo, hi = int(stage_first[si]), int(stage_first[si + 1])
        if si > 0:
            # the stage starts once the previous one drained (client side), after the interval
            prev = slice(int(stage_first[si - 1]), lo)
            start_us = _drain_time_us(send_us[prev], status[prev], last_step[prev], st_start, st_cycle,
                                      st_follows, otp_us, gap_us, timeout_us, enq_us[prev])
            start_us = max(start_us, stage_start[si - 1], T) + load.stage_interval_s * US_PER_S
        else:
            start_us = 0.0
        stage_start[si] = start_us
        send_us[lo:hi] = start_us + offsets * US_PER_S
        enq_us[lo:hi] = send_us[lo:hi] + q_us[lo:hi]
        deadline = send_us + timeout_us  # monotone in the request index
        order = lo + np.argsort(enq_us[lo:hi], kind="stable")
        enq_sorted = enq_us[order]
        n_stage = hi - lo
        done_stage = 0
        ptr = 0  # next request (in enqueue order) to enqueue
        p_dead = lo  # every request below p_dead is done or has a deadline in the future
        # too long for the model: vLLM answers 400 at once
        too_long = req_L[lo:hi] + target > max_len
        if too_long.any():
            bad = lo + np.flatnonzero(too_long)
            status[bad] = REJECTED
            done_stage += len(bad)

        while True:
            # 1. arrivals enqueued by now
            while ptr < n_stage and enq_sorted[ptr] <= T:
                r = int(order[ptr])
                ptr += 1
                if status[r] == PENDING:
                    status[r] = WAITING
                    waiting.append(r)
                    n_waiting += 1
            # 2. client timeouts reach the engine: abort (frees KV blocks and the slot)
            while p_dead < hi and deadline[p_dead] <= T:
                r = p_dead
                p_dead += 1
                s = status[r]
                if s == WAITING:
                    status[r] = ABORTED
                    n_waiting -= 1
                    done_stage += 1
                    blocks = blocks_of.pop(r, None)
                    if blocks:
                        kv.release(blocks)
                elif s == RUNNING:
                    i = int(np.flatnonzero(r_id == r)[0])
                    out_tok[r] = r_out[i]
                    kv.release(blocks_of.pop(r))
                    status[r] = ABORTED
                    done_stage += 1
                    keep = np.ones(len(r_id), dtype=bool)
                    keep[i] = False
                    r_id, r_comp, r_ntok, r_L, r_out, r_nblk, r_hend = (
                        a[keep] for a in (r_id, r_comp, r_ntok, r_L, r_out, r_nblk, r_hend))
                elif s == PENDING:
                    status[r] = ABORTED
                    done_stage += 1
            if done_stage >= n_stage:
                release_finishing()
                break
            n_run = len(r_id)
            if n_run == 0 and n_waiting == 0:
                release_finishing()  # the engine idles: the last outputs get processed
                if ptr >= n_stage:  # every request enqueued and none left in the engine
                    raise RuntimeError(f"simulator invariant: stage {si} has {n_stage - done_stage} requests "
                                       "neither done nor in the engine")
                T = max(T, float(enq_sorted[ptr]))  # idle until the next enqueue
                continue

            # 3. schedule the running requests (admission order)
            budget = budget_cap
            n_pre_step = 0
            if n_run:
                need = r_ntok - r_comp
                cum = np.cumsum(need)
                if cum[-1] <= budget:
                    alloc = need
                    budget -= int(cum[-1])
                else:
                    alloc = np.minimum(need, np.maximum(budget - (cum - need), 0))
                    budget -= int(alloc.sum())
                new_comp = r_comp + alloc
                nb = (new_comp + (BLOCK - 1)) >> 4 if BLOCK == 16 else -(-new_comp // BLOCK)
                grow = nb - r_nblk
                tot = int(grow.sum())
                if tot <= kv.free():
                    if tot:
                        for i in np.flatnonzero(grow).tolist():
                            blocks_of[int(r_id[i])].extend(kv.take(int(grow[i])))
                    r_nblk = nb
                else:
                    # slow path: sequential, preempting from the end (vLLM's running loop)
                    preempted: list[int] = []

                    def preempt(i: int) -> None:
                        r = int(r_id[i])
                        out_tok[r] = r_out[i]
                        _preempt_release(r, int(r_comp[i]), int(r_hend[i]), kv, blocks_of, stride)
                        status[r] = WAITING
                        waiting.appendleft(r)  # the last one preempted ends at the head
                        n_preempt[r] += 1
                        preempted.append(r)

                    alloc, budget, n_alive = _schedule_with_preemption(r_comp, r_ntok, r_nblk, budget_cap, kv,
                                                                       preempt)
                    n_pre_step = len(preempted)
                    n_waiting += n_pre_step
                    total_preempt += n_pre_step
                    r_id, r_comp, r_ntok, r_L, r_out, r_nblk, r_hend = (
                        a[:n_alive] for a in (r_id, r_comp, r_ntok, r_L, r_out, r_nblk, r_hend))
                    alloc = alloc[:n_alive]
                    new_comp = r_comp + alloc
                    r_nblk = r_nblk.copy()
                    for i in range(n_alive):
                        want = -(-int(new_comp[i]) // BLOCK)
                        have = int(r_nblk[i])
                        if want > have:
                            blocks_of[int(r_id[i])].extend(kv.take(want - have))
                            r_nblk[i] = want
                # register prompt blocks that this step fills (others may hit them at once)
                pm = np.flatnonzero((r_comp < r_hend) & (alloc > 0))
                for i in pm.tolist():
                    r = int(r_id[i])
                    _register_prompt(blocks_of[r], user_keys[int(req_user[r])], int(r_comp[i]),
                                     int(new_comp[i]), kv)
            else:
                alloc = E
                new_comp = E

            # 4. admit waiting requests, FCFS (not in a step that preempted)
            adm: list[tuple[int, int, int, int, int, int, int, int]] = []
            if n_pre_step == 0:
                n_slots = max_seqs - len(r_id) - len(finishing)
                while budget > 0 and n_waiting > 0 and len(adm) < n_slots:
                    r = waiting[0]
                    if status[r] != WAITING:  # aborted while waiting
                        waiting.popleft()
                        continue
                    L = int(req_L[r])
                    o = int(out_tok[r])
                    ntok = L + o
                    keys = user_keys[int(req_user[r])]
                    if o > 0:  # a preempted request also hashes its full output blocks
                        keys = keys + [_request_key(r, j, stride) for j in range(len(keys), (ntok - 1) // BLOCK)]
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
                        _register_prompt(blocks, user_keys[int(req_user[r])], c0, c0 + a, kv)
                    blocks_of[r] = blocks
                    waiting.popleft()
                    n_waiting -= 1
                    status[r] = RUNNING
                    if admit_step[r] < 0:
                        admit_step[r] = len(st_start)
                        hit_tokens[r] = c0
                    adm.append((r, c0, ntok, L, o, nbk, hend, a))
                    budget -= a

            # 5. the batch
            if adm:
                ad = np.array(adm, dtype=np.int64)
                b_prog = np.concatenate([r_comp, ad[:, 1]])
                b_new = np.concatenate([alloc, ad[:, 7]])
                r_id = np.concatenate([r_id, ad[:, 0]])
                r_comp = b_prog
                r_ntok = np.concatenate([r_ntok, ad[:, 2]])
                r_L = np.concatenate([r_L, ad[:, 3]])
                r_out = np.concatenate([r_out, ad[:, 4]])
                r_nblk = np.concatenate([r_nblk, ad[:, 5]])
                r_hend = np.concatenate([r_hend, ad[:, 6]])
                new_comp = b_prog + b_new
            else:
                b_prog = r_comp
                b_new = alloc
            if len(b_new) == 0:
                if n_pre_step:
                    continue  # everything preempted: schedule again (admission allowed now)
                if finishing:  # nothing to run: the engine waits for the last outputs, then retries
                    release_finishing()
                    synced = True  # so the last step's outputs are not delayed by the next one
                    continue
                # the waiting head can never fit the KV cache: reject it
                while waiting and status[waiting[0]] != WAITING:
                    waiting.popleft()
                if waiting:
                    r = waiting.popleft()
                    n_waiting -= 1
                    status[r] = REJECTED
                    done_stage += 1
                    blocks = blocks_of.pop(r, None)
                    if blocks:
                        kv.release(blocks)
                continue
            sel = None if b_new.min() > 0 else np.flatnonzero(b_new > 0)
            if sel is None:
                bp, bn, bi, bo, br = b_prog, b_new, r_L, r_out, r_id
            else:
                bp, bn, bi, bo, br = b_prog[sel], b_new[sel], r_L[sel], r_out[sel], r_id[sel]
            t_model = float(step_time(bp, bn, bi, bo))
            cycle = t_model + sched_us + n_pre_step * preempt_us
            k = len(st_start)
            st_start.append(T)
            st_time.append(t_model)
            st_cycle.append(cycle)
            st_pre.append(n_pre_step)
            st_follows.append(T == prev_end and not synced)
            st_gapless.append(T == prev_end)
            synced = False
            n_rows += len(bn)
            st_off.append(n_rows)
            if record:
                rec.add(bp, bn, bi, bo, br)
            release_finishing()  # their output was processed while this step ran
            T = T + cycle
            prev_end = T

            # 6. the step's outcome
            r_comp = new_comp
            sampled = r_comp == r_ntok
            if sampled.any():
                r_out = r_out + sampled
                r_ntok = r_ntok + sampled
                fresh = sampled & (r_out == 1)
                if fresh.any():
                    first_step[r_id[fresh]] = k
                fin = r_out >= target
                if fin.any():
                    fi = np.flatnonzero(fin)
                    rs = r_id[fi]
                    finishing.extend(rs.tolist())
                    last_step[rs] = k
                    out_tok[rs] = r_out[fi]
                    status[rs] = FINISHED
                    done_stage += len(fi)
                    keep = ~fin
                    r_id, r_comp, r_ntok, r_L, r_out, r_nblk, r_hend = (
                        a[keep] for a in (r_id, r_comp, r_ntok, r_L, r_out, r_nblk, r_hend))
        # the engine is empty between stages (every request of this stage is done)

    # ---------------------------------------------------------------------------
    # Client-side measurement
    n_steps = len(st_start)
    start = np.array(st_start, dtype=np.float64)
    cyc = np.array(st_cycle, dtype=np.float64)
    follows = np.array(st_follows, dtype=bool)
    next_contig = np.zeros(n_steps, dtype=bool)  # outputs delayed by the next step
    gapless = np.zeros(n_steps, dtype=bool)
    if n_steps > 1:
        next_contig[:-1] = follows[1:]
        gapless[:-1] = np.array(st_gapless[1:], dtype=bool)
    out_us = _output_times_us(start, cyc, next_contig) + otp_us
    finished = status == FINISHED
    first_tok_us = np.full(N, np.nan)
    last_tok_us = np.full(N, np.nan)
    first_tok_us[finished] = out_us[first_step[finished]]
    last_tok_us[finished] = out_us[last_step[finished]]
    ct = client_times(send_us, first_tok_us, last_tok_us, np.where(finished, out_tok, 0), gap_us)
    success = finished & (ct.e2e_us <= timeout_us)
    nan = np.where(success, 1.0, np.nan)
    stage_arr = load.request_stage
    metrics = ObservedMetrics(
        summary=lifecycle_metrics(ct, success),
        stages=tuple(lifecycle_metrics(ct, success, stage_arr == s) for s in range(len(load.stage_offsets_s))),
    )
    requests = RequestTable(
        send_us=send_us, enqueue_us=enq_us, stage=stage_arr, user=req_user, input_len=req_L,
        output_tokens=out_tok, target_tokens=np.full(N, target, dtype=np.int64), status=status,
        success=success, ttft_us=ct.ttft_us * nan, e2e_us=ct.e2e_us * nan, tpot_us=ct.tpot_us * nan,
        preemptions=n_preempt, prefix_hit_tokens=hit_tokens,
    )

    traj = None
    if record:
        prog, new, inl, outl, reqi = rec.arrays()
        enq_step, enq_frac, wait_from = _enqueue_positions(enq_us, start, cyc, status)
        traj = Trajectory(
            step_start_us=start, step_time_us=np.array(st_time), step_cycle_us=cyc,
            step_preemptions=np.array(st_pre, dtype=np.int32), next_contiguous=gapless,
            output_delayed=next_contig,
            step_offsets=np.array(st_off, dtype=np.int64),
            batch_progress=prog, batch_new_tokens=new, batch_input_len=inl, batch_output_len=outl,
            batch_request=reqi,
            send_us=send_us, queueing_us=q_us, input_len=req_L, target_tokens=requests.target_tokens,
            stage=stage_arr, success=success, enq_step=enq_step, enq_frac=enq_frac, wait_from_step=wait_from,
            admit_step=admit_step, first_token_step=first_step, last_step=last_step, preemptions=n_preempt,
            n_stages=len(load.stage_offsets_s), name=spec.name,
        )
    return SimResult(metrics=metrics, requests=requests, trajectory=traj, n_steps=n_steps,
                     kv_capacity_blocks=kv_total, stage_start_us=stage_start, total_preemptions=total_preempt,
                     extra={"kv_free_blocks_at_end": kv.free(), "kv_blocks_held_at_end": sum(
                         1 for c in kv.ref.values() if c > 0)})


# ---------------------------------------------------------------------------
# Helpers of the loop


def _register_prompt(blocks: list[int], ukeys: list[int], c0: int, c1: int, kv: _PrefixKV) -> None:
    """Hash the prompt blocks that become full when computed tokens go from C0 to C1."""
    ref = kv.ref
    for j in range(c0 // BLOCK, min(c1 // BLOCK, len(ukeys))):
        key = ukeys[j]
        if key not in ref:  # else a copy is cached already; this block stays unhashed
            ref[key] = 1
            blocks[j] = key


def _preempt_release(r: int, comp: int, hend: int, kv: _PrefixKV, blocks_of: dict, stride: int) -> None:
    """Free a preempted request's blocks; its full output blocks get hashes so a recompute can hit them."""
    blocks = blocks_of.pop(r)
    ref = kv.ref
    for j in range(hend // BLOCK, min(comp // BLOCK, len(blocks))):
        if blocks[j] & 3 == 3:
            key = _request_key(r, j, stride)
            if key not in ref:
                ref[key] = 1
                blocks[j] = key
    kv.release(blocks)


def _schedule_with_preemption(r_comp, r_ntok, r_nblk, budget_cap, kv: _PrefixKV, preempt):
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


def _output_times_us(start: np.ndarray, cycle: np.ndarray, next_contig: np.ndarray) -> np.ndarray:
    """When step k's tokens leave the engine: end of step k+1, or end of step k before an idle gap."""
    end = start + cycle
    out = end.copy()
    if len(end) > 1:
        nxt = np.append(cycle[1:], 0.0)
        out = end + np.where(next_contig, nxt, 0.0)
    return out


def _drain_time_us(send, status, last, st_start, st_cycle, st_follows, otp_us, gap_us, timeout_us,
                   enq) -> float:
    """When the client has every response of a stage (received, or given up at the timeout)."""
    start = np.array(st_start, dtype=np.float64)
    cyc = np.array(st_cycle, dtype=np.float64)
    follows = np.array(st_follows, dtype=bool)
    nc = np.zeros(len(start), dtype=bool)
    if len(start) > 1:
        nc[:-1] = follows[1:]
    out = _output_times_us(start, cyc, nc) + otp_us
    done = np.where(status == REJECTED, enq, send + timeout_us)
    fin = status == FINISHED
    if fin.any():
        done[fin] = np.minimum(out[last[fin]] + gap_us, send[fin] + timeout_us)
    return float(np.max(done)) if len(done) else 0.0


def _enqueue_positions(enq_us, start, cycle, status):
    """For each request: the step running when it was enqueued and how far through (replay paths)."""
    n = len(enq_us)
    enq_step = np.full(n, -1, dtype=np.int64)
    frac = np.zeros(n, dtype=np.float64)
    wait_from = np.full(n, -1, dtype=np.int64)
    ok = np.isfinite(enq_us) & ((status == FINISHED) | (status == ABORTED))
    if len(start) == 0 or not ok.any():
        return enq_step, frac, wait_from
    e = enq_us[ok]
    s = np.searchsorted(start, e, side="left") - 1  # start[s] < e <= start[s+1]
    inside = (s >= 0) & (e < start[np.maximum(s, 0)] + cycle[np.maximum(s, 0)])
    es = np.where(inside, s, -1)
    fr = np.where(inside, (e - start[np.maximum(s, 0)]) / cycle[np.maximum(s, 0)], 0.0)
    enq_step[ok] = es
    frac[ok] = fr
    wait_from[ok] = s + 1
    return enq_step, frac, wait_from


__all__ = [
    "LatencyModel",
    "Overheads",
    "PhysicsLatencyModel",
    "RequestTable",
    "SimResult",
    "Trajectory",
    "simulate",
]
