"""Closed-loop simulation of a vLLM V1 (v0.15) server under the inference-perf load generator.

The server side (``../shared/NOTES.md`` §4): the scheduler (``fitness.sim.scheduler``) over
the KV cache with prefix caching (``fitness.sim.kv_cache``), driven by this event loop:

* **Asynchronous scheduling**: the step starting at ``T_k`` is scheduled at ``T_k`` with
  the requests enqueued by then; its cycle is ``model.step_time_us(batch) +
  scheduling_processing_us (+ preemption_processing_us per preemption)``; its tokens reach
  the client at the end of the *following* step (at the end of the step itself when the
  engine idles afterwards) plus ``output_token_processing_us``. A request is enqueued
  ``queueing_time_us(input_len)`` (HTTP + tokenisation) plus ``queueing_per_running_request_us``
  times the requests of the last step started before it was sent (0 before the first) after
  it is sent, never before. The engine idles until the next send or enqueue when nothing
  is runnable.
* **Timeouts**: the client gives up ``request_timeout_s`` after sending; the engine
  aborts the request (freeing its KV blocks and slot) at the first step start after.
* **Stages** start once the previous one has drained (client side), after the interval.
* **Percentiles** (``distributions=True``) need every token's arrival: the scheduler then
  logs which requests sampled a token in each step (a run takes ~20% longer; off in the search).

The client side (arrivals, prompts, the two-events-per-token arithmetic) is
``fitness.sim.loadgen``; what a run returns is ``fitness.sim.recording``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fitness.sim.core import run_closed_loop
from fitness.sim.kv_cache import BLOCK, key_stride, prompt_block_keys
from fitness.sim.latency_model import LatencyModel
from fitness.sim.loadgen import US_PER_S, LoadPlan, TokenTimes, build_load, client_times, lifecycle_metrics
from fitness.sim.recording import (
    FINISHED,
    REJECTED,
    RequestTable,
    SimResult,
    StepLog,
    Trajectory,
    enqueue_positions,
)
from fitness.sim.scheduler import Scheduler
from primitives.data.experiments import ExperimentSpec, ObservedMetrics
from primitives.deployment import Deployment
from primitives.program import StepProgram, Unsupported
from primitives.program_eval import program_arrays


def simulate(
    spec: ExperimentSpec,
    deployment: Deployment,
    model: LatencyModel,
    seed: int = 0,
    record: bool = True,
    load: LoadPlan | None = None,
    kv_capacity_blocks: int | None = None,
    distributions: bool = False,
    engine: str = "auto",
    step_scales: np.ndarray | None = None,
) -> SimResult:
    """Run SPEC's load against a simulated vLLM server whose steps take MODEL's times.

    ``load`` overrides the seeded load plan (tests); ``kv_capacity_blocks`` overrides the
    capacity derived from the deployment (``kv_capacity_blocks(gpu_memory_utilization)``).
    ``distributions``: the metrics carry the percentiles the load generator reports too.
    ``engine``: ``compiled`` (``fitness.sim.core``: the model must have a step program),
    ``python`` (the reference loop below), or ``auto``: compiled where the model allows.
    ``step_scales``: step ``k`` takes the model's time times ``step_scales[k % len]`` (the
    measured scatter of real steps, ``fitness.step_scatter``); none: exactly the model's.
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; valid: {', '.join(ENGINES)}")
    if load is None:
        load = build_load(spec, seed)
    if kv_capacity_blocks is None:
        kv_capacity_blocks = deployment.kv_capacity_blocks(spec.gpu_memory_utilization)
    kv_total = int(kv_capacity_blocks)
    scales = np.ones(1) if step_scales is None else np.asarray(step_scales, dtype=np.float64)
    if not (scales.ndim == 1 and len(scales) and np.all(np.isfinite(scales)) and np.all(scales > 0)):
        raise ValueError("step_scales: expected a non-empty 1-D array of positive, finite multipliers")
    program = None if engine == "python" else step_program_of(model, required=engine == "compiled")
    if program is not None:
        outcome = _compiled_outcome(spec, model, load, kv_total, record, distributions, program, scales)
    else:
        run = _ClosedLoop(spec, model, load, kv_total, record, scales)
        if distributions:
            run.sched.token_log = []
        for si in range(len(load.stage_offsets_s)):
            run.stage(si)  # the engine is empty between stages (every request of a stage is done)
        outcome = run.outcome()
    return measure(spec.name, load, model, kv_total, outcome, None if step_scales is None else scales)


ENGINES = ("auto", "compiled", "python")


def scales_of_steps(step_scales: np.ndarray, n_steps: int) -> np.ndarray:
    """The multiplier each of N_STEPS steps got: step k's is ``step_scales[k % len]`` (as both engines draw)."""
    return step_scales[np.arange(n_steps) % len(step_scales)]


def step_program_of(model: LatencyModel, required: bool = False) -> StepProgram | None:
    """MODEL's step program, or None where it has none (``required``: raise instead)."""
    try:
        build = getattr(model, "step_program", None)
        if build is None:
            raise Unsupported(f"{type(model).__name__} has no step program")
        return build()
    except Unsupported:
        if required:
            raise
        return None


@dataclass
class LoopOutcome:
    """What one closed loop leaves behind, whichever engine ran it (``measure`` turns it into a result)."""

    prompt_len: np.ndarray  # per request: its prompt length (``_request_inputs``)
    send_us: np.ndarray
    enqueue_us: np.ndarray
    stage_start_us: np.ndarray
    status: np.ndarray  # per request (fitness.sim.recording's codes)
    output_tokens: np.ndarray
    admit_step: np.ndarray
    first_step: np.ndarray
    last_step: np.ndarray
    preemptions: np.ndarray
    prefix_hit_tokens: np.ndarray
    step_start_us: np.ndarray  # per step
    step_time_us: np.ndarray
    step_cycle_us: np.ndarray
    step_preemptions: np.ndarray
    step_kv_held_blocks: np.ndarray
    step_follows: np.ndarray  # launched while the previous step ran (its outputs delayed by this one)
    step_gapless: np.ndarray  # started right at the end of the previous step
    step_offsets: np.ndarray
    batch: list[np.ndarray] | None  # progress, new tokens, input len, output len, request (recording only)
    token_log: tuple[np.ndarray, np.ndarray] | None  # (step, request) of every sampled token
    total_preemptions: int
    kv_free_blocks: int
    kv_held_blocks: int
    send_depth: np.ndarray  # per request: requests in the step running when it was sent


def _request_inputs(load: LoadPlan, model: LatencyModel) -> tuple[np.ndarray, np.ndarray]:
    """Each request's prompt length and the queueing time known before it is sent (µs; the
    load part is added at sending)."""
    prompt_len = load.shapes.user_prompt_len[load.request_user].astype(np.int64)
    queue_us = np.asarray(model.queueing_time_us(prompt_len), dtype=np.float64) * np.ones(load.num_requests)
    return prompt_len, queue_us


def _compiled_outcome(spec, model, load: LoadPlan, kv_total: int, record: bool, distributions: bool, program, scales):
    """One run of the compiled core (``fitness.sim.core``)."""
    prompt_len, queue_us = _request_inputs(load, model)
    stride = key_stride(int(spec.max_model_len))
    user_keys = prompt_block_keys(load.shapes, stride)
    n_keys = np.array([len(k) for k in user_keys], dtype=np.int64)
    keys = np.zeros((len(user_keys), max(int(n_keys.max(initial=0)), 1)), dtype=np.int64)
    for u, k in enumerate(user_keys):
        keys[u, : len(k)] = k
    offsets = np.concatenate(load.stage_offsets_s) if load.stage_offsets_s else np.zeros(0)
    out = run_closed_loop(
        prompt_len,
        np.asarray(load.request_user, dtype=np.int64),
        np.asarray(offsets, dtype=np.float64),
        queue_us,
        float(model.queueing_per_running_request_us),
        np.asarray(load.stage_first_request, dtype=np.int64),
        float(load.stage_interval_s),
        float(load.timeout_s * US_PER_S),
        int(load.output_len),
        int(spec.max_model_len),
        int(spec.max_num_batched_tokens),
        int(spec.max_num_seqs),
        stride,
        keys,
        n_keys,
        kv_total,
        float(model.scheduling_processing_us),
        float(model.preemption_processing_us),
        float(model.output_token_processing_us),
        float(model.event_gap_us),
        bool(record),
        bool(distributions),
        program_arrays(program),
        scales,
    )
    return LoopOutcome(
        prompt_len, *out[7:10], *out[:7], *out[10:18],
        batch=list(out[18:23]) if record else None,
        token_log=(out[23], out[24]) if distributions else None,
        total_preemptions=int(out[25]), kv_free_blocks=int(out[26]), kv_held_blocks=int(out[27]),
        send_depth=out[28],
    )  # fmt: skip


class _ClosedLoop:
    """One run: the engine's clock and steps around the scheduler, and the client's send times."""

    def __init__(self, spec: ExperimentSpec, model: LatencyModel, load: LoadPlan, kv_total: int, record: bool, scales):
        self.load = load
        self.scales = scales
        self.record = record
        self.sched_us = float(model.scheduling_processing_us)
        self.preempt_us = float(model.preemption_processing_us)
        self.otp_us = float(model.output_token_processing_us)
        self.gap_us = float(model.event_gap_us)
        self.step_time = model.step_time_us

        n = load.num_requests
        self.req_L, self.q_us = _request_inputs(load, model)
        self.target = int(load.output_len)
        self.timeout_us = load.timeout_s * US_PER_S
        self.sched = Scheduler(spec, load, self.req_L, kv_total)
        self.per_running_us = float(model.queueing_per_running_request_us)
        self.send_us = np.full(n, np.nan)
        self.enq_us = np.full(n, np.nan)
        self.send_depth = np.zeros(n, dtype=np.int64)
        self.last_batch = 0  # requests in the latest step (BLIS's model remembers it the same way)
        self.sent = 0  # requests below it are sent
        self.pending: list[int] = []  # sent, not yet enqueued (in send order)
        self.steps = StepLog(record, min(int(n * (self.target + 2) * 1.05), 1 << 22) if record else 1)

        self.T = 0.0
        self.prev_end = -1.0
        self.synced = False  # the engine waited for the last step's outputs (they are not delayed)
        self.stage_start = np.zeros(len(load.stage_offsets_s))

    def stage(self, si: int) -> None:
        """Send stage SI's requests and run the engine until every one of them is done."""
        load, sched = self.load, self.sched
        stage_first = load.stage_first_request
        lo, hi = int(stage_first[si]), int(stage_first[si + 1])
        if si > 0:
            # the stage starts once the previous one drained (client side), after the interval
            prev = slice(int(stage_first[si - 1]), lo)
            start_us = _drain_time_us(
                self.send_us[prev],
                sched.status[prev],
                sched.last_step[prev],
                self.steps,
                self.otp_us,
                self.gap_us,
                self.timeout_us,
                self.enq_us[prev],
            )
            start_us = max(start_us, self.stage_start[si - 1], self.T) + load.stage_interval_s * US_PER_S
        else:
            start_us = 0.0
        self.stage_start[si] = start_us
        self.send_us[lo:hi] = start_us + load.stage_offsets_s[si] * US_PER_S
        deadline = self.send_us + self.timeout_us  # monotone in the request index
        self.sent, self.pending = lo, []
        n_stage = hi - lo
        p_dead = lo  # every request below p_dead is done or has a deadline in the future
        done = sched.reject_too_long(lo, hi)

        while True:
            # 1. arrivals sent and enqueued by now
            self.send_until(self.T, hi)
            ready, waiting = [], []
            for r in self.pending:
                (ready if self.enq_us[r] <= self.T else waiting).append(r)
            self.pending = waiting
            for r in sorted(ready, key=lambda r: self.enq_us[r]):  # stable: ties in send order
                sched.enqueue(r)
            # 2. client timeouts reach the engine
            while p_dead < hi and deadline[p_dead] <= self.T:
                done += sched.abort(p_dead)
                p_dead += 1
            if done >= n_stage:
                sched.release_finishing()
                self.send_until(np.inf, hi)  # requests rejected before they were sent get their times
                break
            if sched.idle():
                sched.release_finishing()  # the engine idles: the last outputs get processed
                if not self.pending and self.sent >= hi:  # every request enqueued and none left in the engine
                    raise RuntimeError(
                        f"simulator invariant: stage {si} has {n_stage - done} requests neither done nor in the engine"
                    )
                self.T = max(self.T, self.next_event_us(hi))
                continue
            done += self.step()

    def send_until(self, t_us: float, hi: int) -> None:
        """The requests the client sent by T_US get their enqueue time: the queueing time
        known at sending, plus the term per request of the step running then. (A negative
        queueing time enqueues a request when it is sent, never before.)"""
        while self.sent < hi and self.send_us[self.sent] <= t_us:
            r = self.sent
            self.send_depth[r] = self.last_batch
            self.enq_us[r] = self.send_us[r] + self.q_us[r] + self.per_running_us * self.last_batch
            self.pending.append(r)
            self.sent += 1

    def next_event_us(self, hi: int) -> float:
        """An idle engine waits for the next enqueue of a request already sent, or for the
        next send (whose enqueue time depends on the load then)."""
        nxt = [self.enq_us[r] for r in self.pending]
        if self.sent < hi:
            nxt.append(self.send_us[self.sent])
        return float(min(nxt))

    def step(self) -> int:
        """Schedule and run one step (or reject a request that can never run). Returns requests done."""
        sched = self.sched
        k = len(self.steps.start)
        # 3. the running requests, 4. waiting ones FCFS (not in a step that preempted)
        alloc, new_comp, budget, n_pre = sched.schedule_running()
        adm = sched.admit(budget, k) if n_pre == 0 else []
        # 5. the batch
        b_prog, b_new, new_comp = sched.join(adm, alloc, new_comp)
        if len(b_new) == 0:
            if n_pre:
                return 0  # everything preempted: schedule again (admission allowed now)
            if sched.finishing:  # nothing to run: the engine waits for the last outputs, then retries
                sched.release_finishing()
                self.synced = True  # so the last step's outputs are not delayed by the next one
                return 0
            return sched.reject_head()
        batch = sched.batch(b_prog, b_new)
        self.last_batch = len(batch[1])  # the requests that compute tokens (BLIS's scheduled)
        t_model = float(self.step_time(*batch[:4]))
        cycle = t_model * float(self.scales[k % len(self.scales)]) + self.sched_us + n_pre * self.preempt_us
        T = self.T
        follows, gapless = T == self.prev_end and not self.synced, T == self.prev_end
        self.steps.add(T, t_model, cycle, n_pre, follows, gapless, batch, sched.kv.total - sched.kv.free())
        self.synced = False
        sched.release_finishing()  # their output was processed while this step ran
        self.T = T + cycle
        self.prev_end = self.T
        # 6. the step's outcome
        return sched.step_done(new_comp, k)

    def outcome(self) -> LoopOutcome:
        sched, steps = self.sched, self.steps
        token_log = None
        if sched.token_log is not None:
            log = sched.token_log
            step_of = np.repeat([k for k, _ in log], [len(r) for _, r in log]).astype(np.int64)
            req_of = np.concatenate([r for _, r in log]) if log else np.zeros(0, dtype=np.int64)
            token_log = (step_of, req_of)
        return LoopOutcome(
            self.req_L, self.send_us, self.enq_us, self.stage_start,
            sched.status, sched.out_tok, sched.admit_step, sched.first_step, sched.last_step, sched.n_preempt,
            sched.hit_tokens,
            np.array(steps.start, dtype=np.float64), np.array(steps.time, dtype=np.float64),
            np.array(steps.cycle, dtype=np.float64), np.array(steps.preemptions, dtype=np.int64),
            np.array(steps.kv_held_blocks, dtype=np.int64), np.array(steps.follows, dtype=bool),
            np.array(steps.gapless, dtype=bool), np.array(steps.offsets, dtype=np.int64),
            batch=steps.batches.arrays() if self.record else None, token_log=token_log,
            total_preemptions=sched.total_preempt, kv_free_blocks=sched.kv.free(),
            kv_held_blocks=sched.kv.held_blocks(), send_depth=self.send_depth,
        )  # fmt: skip


# ---------------------------------------------------------------------------
# Client-side measurement


def measure(
    name: str, load: LoadPlan, model: LatencyModel, kv_total: int, run: LoopOutcome, step_scales=None
) -> SimResult:
    """Client-side measurement of a closed loop's outcome, and its recording (``step_scales``:
    the multipliers the steps' times got, which the recording keeps for the replay)."""
    n = load.num_requests
    prompt_len = run.prompt_len
    otp_us, gap_us = float(model.output_token_processing_us), float(model.event_gap_us)
    start, cyc, next_contig, out_us = _step_timeline(run.step_start_us, run.step_cycle_us, run.step_follows, otp_us)
    n_steps = len(start)
    gapless = np.zeros(n_steps, dtype=bool)
    if n_steps > 1:
        gapless[:-1] = run.step_gapless[1:]
    status = run.status
    finished = status == FINISHED
    first_tok_us = np.full(n, np.nan)
    last_tok_us = np.full(n, np.nan)
    first_tok_us[finished] = out_us[run.first_step[finished]]
    last_tok_us[finished] = out_us[run.last_step[finished]]
    ct = client_times(run.send_us, first_tok_us, last_tok_us, np.where(finished, run.output_tokens, 0), gap_us)
    success = finished & (ct.e2e_us <= load.timeout_s * US_PER_S)
    nan = np.where(success, 1.0, np.nan)
    stage_arr = load.request_stage
    tokens = None
    if run.token_log is not None:  # every token reaches the client when its step's outputs do
        step_of, req_of = run.token_log
        tokens = TokenTimes.from_tokens(n, req_of, out_us[step_of], gap_us)
    metrics = ObservedMetrics(
        summary=lifecycle_metrics(ct, success, tokens=tokens),
        stages=tuple(lifecycle_metrics(ct, success, stage_arr == s, tokens) for s in range(len(load.stage_offsets_s))),
    )
    requests = RequestTable(
        send_us=run.send_us,
        enqueue_us=run.enqueue_us,
        stage=stage_arr,
        user=load.request_user,
        input_len=prompt_len,
        output_tokens=run.output_tokens,
        target_tokens=np.full(n, int(load.output_len), dtype=np.int64),
        status=status,
        success=success,
        ttft_us=ct.ttft_us * nan,
        e2e_us=ct.e2e_us * nan,
        tpot_us=ct.tpot_us * nan,
        preemptions=run.preemptions,
        prefix_hit_tokens=run.prefix_hit_tokens,
    )
    traj = None
    if run.batch is not None:
        prog, new, inl, outl, reqi = run.batch
        enq_step, enq_frac, wait_from = enqueue_positions(run.enqueue_us, start, cyc, status)
        traj = Trajectory(
            step_start_us=start,
            step_time_us=run.step_time_us,
            step_cycle_us=cyc,
            step_preemptions=run.step_preemptions.astype(np.int32),
            step_kv_block_tokens=run.step_kv_held_blocks * BLOCK,
            next_contiguous=gapless,
            output_delayed=next_contig,
            step_offsets=run.step_offsets,
            batch_progress=prog,
            batch_new_tokens=new,
            batch_input_len=inl,
            batch_output_len=outl,
            batch_request=reqi,
            send_us=run.send_us,
            enqueue_us=run.enqueue_us,
            send_depth=run.send_depth,
            input_len=prompt_len,
            target_tokens=requests.target_tokens,
            stage=stage_arr,
            success=success,
            enq_step=enq_step,
            enq_frac=enq_frac,
            wait_from_step=wait_from,
            admit_step=run.admit_step,
            first_token_step=run.first_step,
            last_step=run.last_step,
            preemptions=run.preemptions,
            n_stages=len(load.stage_offsets_s),
            name=name,
            step_scale=None if step_scales is None else scales_of_steps(step_scales, len(run.step_time_us)),
        )
    return SimResult(
        metrics=metrics,
        requests=requests,
        trajectory=traj,
        n_steps=n_steps,
        kv_capacity_blocks=kv_total,
        stage_start_us=run.stage_start_us,
        total_preemptions=run.total_preemptions,
        extra={"kv_free_blocks_at_end": run.kv_free_blocks, "kv_blocks_held_at_end": run.kv_held_blocks}
        | ({"token_times": tokens} if tokens is not None else {}),
    )


def _step_timeline(start, cycle, follows, otp_us: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The steps' starts and cycles, whether each one's outputs wait for the next step, and when
    its tokens reach the client: end of step k+1, or end of step k before an idle gap."""
    start = np.asarray(start, dtype=np.float64)
    cycle = np.asarray(cycle, dtype=np.float64)
    follows = np.asarray(follows, dtype=bool)
    next_contig = np.zeros(len(start), dtype=bool)  # outputs delayed by the next step
    if len(start) > 1:
        next_contig[:-1] = follows[1:]
    end = start + cycle
    out = end.copy()
    if len(end) > 1:
        nxt = np.append(cycle[1:], 0.0)
        out = end + np.where(next_contig, nxt, 0.0)
    return start, cycle, next_contig, out + otp_us


def _drain_time_us(send, status, last, steps: StepLog, otp_us, gap_us, timeout_us, enq) -> float:
    """When the client has every response of a stage (received, or given up at the timeout)."""
    out = _step_timeline(steps.start, steps.cycle, steps.follows, otp_us)[3]
    done = np.where(status == REJECTED, enq, send + timeout_us)
    fin = status == FINISHED
    if fin.any():
        done[fin] = np.minimum(out[last[fin]] + gap_us, send[fin] + timeout_us)
    return float(np.max(done)) if len(done) else 0.0
