"""Closed-loop simulation of a vLLM V1 (v0.15) server under the inference-perf load generator.

The server side (``../shared/NOTES.md`` §4): the scheduler (``fitness.sim.scheduler``) over
the KV cache with prefix caching (``fitness.sim.kv_cache``), driven by this event loop:

* **Asynchronous scheduling**: the step starting at ``T_k`` is scheduled at ``T_k`` with
  the requests enqueued by then; its cycle is ``model.step_time_us(batch) +
  scheduling_processing_us (+ preemption_processing_us per preemption)``; its tokens reach
  the client at the end of the *following* step (at the end of the step itself when the
  engine idles afterwards) plus ``output_token_processing_us``. A request is enqueued
  ``queueing_time_us(input_len)`` after it is sent (HTTP + tokenisation). The engine
  idles until the next enqueue when nothing is runnable.
* **Timeouts**: the client gives up ``request_timeout_s`` after sending; the engine
  aborts the request (freeing its KV blocks and slot) at the first step start after.
* **Stages** start once the previous one has drained (client side), after the interval.
* **Percentiles** (``distributions=True``) need every token's arrival: the scheduler then
  logs which requests sampled a token in each step (a run takes ~20% longer; off in the search).

The client side (arrivals, prompts, the two-events-per-token arithmetic) is
``fitness.sim.loadgen``; what a run returns is ``fitness.sim.recording``.
"""

from __future__ import annotations

from types import SimpleNamespace

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
) -> SimResult:
    """Run SPEC's load against a simulated vLLM server whose steps take MODEL's times.

    ``load`` overrides the seeded load plan (tests); ``kv_capacity_blocks`` overrides the
    capacity derived from the deployment (``kv_capacity_tokens(gpu_memory_utilization)``).
    ``distributions``: the metrics carry the percentiles the load generator reports too.
    ``engine``: ``compiled`` (``fitness.sim.core``: the model must have a step program),
    ``python`` (the reference loop below), or ``auto``: compiled where the model allows.
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; valid: {', '.join(ENGINES)}")
    if load is None:
        load = build_load(spec, seed)
    if kv_capacity_blocks is None:
        kv_capacity_blocks = deployment.kv_capacity_tokens(spec.gpu_memory_utilization) // BLOCK
    program = None if engine == "python" else step_program_of(model, required=engine == "compiled")
    if program is not None:
        run = _compiled_run(spec, model, load, int(kv_capacity_blocks), record, distributions, program)
        return run.result(spec.name)
    run = _ClosedLoop(spec, model, load, int(kv_capacity_blocks), record)
    if distributions:
        run.sched.token_log = []
    for si in range(len(load.stage_offsets_s)):
        run.stage(si)
    # the engine is empty between stages (every request of a stage is done)
    return run.result(spec.name)


ENGINES = ("auto", "compiled", "python")


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


def _compiled_run(spec, model, load: LoadPlan, kv_total: int, record: bool, distributions: bool, program):
    """One run of the compiled core, dressed as a finished ``_ClosedLoop`` for its ``result``."""
    run = _ClosedLoop.__new__(_ClosedLoop)
    run.load, run.kv_total, run.record = load, kv_total, record
    run.otp_us = float(model.output_token_processing_us)
    run.gap_us = float(model.event_gap_us)
    n = load.num_requests
    run.req_L = load.shapes.user_prompt_len[load.request_user].astype(np.int64)
    run.target = int(load.output_len)
    run.timeout_us = load.timeout_s * US_PER_S
    run.q_us = np.asarray(model.queueing_time_us(run.req_L), dtype=np.float64) * np.ones(n)
    stride = key_stride(int(spec.max_model_len))
    user_keys = prompt_block_keys(load.shapes, stride)
    n_keys = np.array([len(k) for k in user_keys], dtype=np.int64)
    keys = np.zeros((len(user_keys), max(int(n_keys.max(initial=0)), 1)), dtype=np.int64)
    for u, k in enumerate(user_keys):
        keys[u, : len(k)] = k
    offsets = np.concatenate(load.stage_offsets_s) if load.stage_offsets_s else np.zeros(0)
    out = run_closed_loop(
        run.req_L,
        np.asarray(load.request_user, dtype=np.int64),
        np.asarray(offsets, dtype=np.float64),
        run.q_us,
        np.asarray(load.stage_first_request, dtype=np.int64),
        float(load.stage_interval_s),
        float(run.timeout_us),
        run.target,
        int(spec.max_model_len),
        int(spec.max_num_batched_tokens),
        int(spec.max_num_seqs),
        stride,
        keys,
        n_keys,
        kv_total,
        float(model.scheduling_processing_us),
        float(model.preemption_processing_us),
        run.otp_us,
        run.gap_us,
        bool(record),
        bool(distributions),
        program_arrays(program),
    )
    (status, out_tok, admit, first, last, n_pre, hits, run.send_us, run.enq_us, run.stage_start) = out[:10]
    steps = SimpleNamespace(
        start=out[10], time=out[11], cycle=out[12], preemptions=out[13], kv_held_blocks=out[14],
        follows=out[15], gapless=out[16], offsets=out[17], batches=SimpleNamespace(arrays=lambda: list(out[18:23])),
    )  # fmt: skip
    run.steps = _Steps(steps)
    kv = SimpleNamespace(free=lambda: int(out[26]), held_blocks=lambda: int(out[27]))
    run.sched = SimpleNamespace(
        status=status, out_tok=out_tok, admit_step=admit, first_step=first, last_step=last, n_preempt=n_pre,
        hit_tokens=hits, total_preempt=int(out[25]), kv=kv, token_log=(out[23], out[24]) if distributions else None,
    )  # fmt: skip
    return run


class _Steps(SimpleNamespace):
    def __init__(self, ns):
        super().__init__(**vars(ns))

    def __len__(self) -> int:
        return len(self.start)


class _ClosedLoop:
    """One run: the engine's clock and steps around the scheduler, and the client's send times."""

    def __init__(self, spec: ExperimentSpec, model: LatencyModel, load: LoadPlan, kv_total: int, record: bool):
        self.load = load
        self.kv_total = kv_total
        self.record = record
        self.sched_us = float(model.scheduling_processing_us)
        self.preempt_us = float(model.preemption_processing_us)
        self.otp_us = float(model.output_token_processing_us)
        self.gap_us = float(model.event_gap_us)
        self.step_time = model.step_time_us

        n = load.num_requests
        self.req_L = load.shapes.user_prompt_len[load.request_user].astype(np.int64)
        self.target = int(load.output_len)
        self.timeout_us = load.timeout_s * US_PER_S
        self.q_us = np.asarray(model.queueing_time_us(self.req_L), dtype=np.float64) * np.ones(n)
        self.sched = Scheduler(spec, load, self.req_L, kv_total)
        self.send_us = np.full(n, np.nan)
        self.enq_us = np.full(n, np.nan)
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
        self.enq_us[lo:hi] = self.send_us[lo:hi] + self.q_us[lo:hi]
        deadline = self.send_us + self.timeout_us  # monotone in the request index
        order = lo + np.argsort(self.enq_us[lo:hi], kind="stable")
        enq_sorted = self.enq_us[order]
        n_stage = hi - lo
        ptr = 0  # next request (in enqueue order) to enqueue
        p_dead = lo  # every request below p_dead is done or has a deadline in the future
        done = sched.reject_too_long(lo, hi)

        while True:
            # 1. arrivals enqueued by now
            while ptr < n_stage and enq_sorted[ptr] <= self.T:
                sched.enqueue(int(order[ptr]))
                ptr += 1
            # 2. client timeouts reach the engine
            while p_dead < hi and deadline[p_dead] <= self.T:
                done += sched.abort(p_dead)
                p_dead += 1
            if done >= n_stage:
                sched.release_finishing()
                break
            if sched.idle():
                sched.release_finishing()  # the engine idles: the last outputs get processed
                if ptr >= n_stage:  # every request enqueued and none left in the engine
                    raise RuntimeError(
                        f"simulator invariant: stage {si} has {n_stage - done} requests neither done nor in the engine"
                    )
                self.T = max(self.T, float(enq_sorted[ptr]))  # idle until the next enqueue
                continue
            done += self.step()

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
        t_model = float(self.step_time(*batch[:4]))
        cycle = t_model + self.sched_us + n_pre * self.preempt_us
        T = self.T
        follows, gapless = T == self.prev_end and not self.synced, T == self.prev_end
        self.steps.add(T, t_model, cycle, n_pre, follows, gapless, batch, sched.kv.total - sched.kv.free())
        self.synced = False
        sched.release_finishing()  # their output was processed while this step ran
        self.T = T + cycle
        self.prev_end = self.T
        # 6. the step's outcome
        return sched.step_done(new_comp, k)

    def result(self, name: str) -> SimResult:
        """Client-side measurement of the run, and its recording."""
        load, sched, steps = self.load, self.sched, self.steps
        n = load.num_requests
        start, cyc, next_contig, out_us = _step_timeline(steps, self.otp_us)
        gapless = np.zeros(len(steps), dtype=bool)
        if len(steps) > 1:
            gapless[:-1] = np.array(steps.gapless[1:], dtype=bool)
        status = sched.status
        finished = status == FINISHED
        first_tok_us = np.full(n, np.nan)
        last_tok_us = np.full(n, np.nan)
        first_tok_us[finished] = out_us[sched.first_step[finished]]
        last_tok_us[finished] = out_us[sched.last_step[finished]]
        ct = client_times(self.send_us, first_tok_us, last_tok_us, np.where(finished, sched.out_tok, 0), self.gap_us)
        success = finished & (ct.e2e_us <= self.timeout_us)
        nan = np.where(success, 1.0, np.nan)
        stage_arr = load.request_stage
        tokens = None
        if sched.token_log is not None:  # every token reaches the client when its step's outputs do
            log = sched.token_log
            if isinstance(log, tuple):  # the compiled core's (step, request) arrays
                step_of, req_of = log
            else:
                step_of = np.repeat([k for k, _ in log], [len(r) for _, r in log]).astype(np.int64)
                req_of = np.concatenate([r for _, r in log]) if log else np.zeros(0, dtype=np.int64)
            tokens = TokenTimes.from_tokens(n, req_of, out_us[step_of], self.gap_us)
        metrics = ObservedMetrics(
            summary=lifecycle_metrics(ct, success, tokens=tokens),
            stages=tuple(
                lifecycle_metrics(ct, success, stage_arr == s, tokens) for s in range(len(load.stage_offsets_s))
            ),
        )
        requests = RequestTable(
            send_us=self.send_us,
            enqueue_us=self.enq_us,
            stage=stage_arr,
            user=load.request_user,
            input_len=self.req_L,
            output_tokens=sched.out_tok,
            target_tokens=np.full(n, self.target, dtype=np.int64),
            status=status,
            success=success,
            ttft_us=ct.ttft_us * nan,
            e2e_us=ct.e2e_us * nan,
            tpot_us=ct.tpot_us * nan,
            preemptions=sched.n_preempt,
            prefix_hit_tokens=sched.hit_tokens,
        )
        traj = None
        if self.record:
            prog, new, inl, outl, reqi = steps.batches.arrays()
            enq_step, enq_frac, wait_from = enqueue_positions(self.enq_us, start, cyc, status)
            traj = Trajectory(
                step_start_us=start,
                step_time_us=np.array(steps.time),
                step_cycle_us=cyc,
                step_preemptions=np.array(steps.preemptions, dtype=np.int32),
                step_kv_block_tokens=np.array(steps.kv_held_blocks, dtype=np.int64) * BLOCK,
                next_contiguous=gapless,
                output_delayed=next_contig,
                step_offsets=np.array(steps.offsets, dtype=np.int64),
                batch_progress=prog,
                batch_new_tokens=new,
                batch_input_len=inl,
                batch_output_len=outl,
                batch_request=reqi,
                send_us=self.send_us,
                queueing_us=self.q_us,
                input_len=self.req_L,
                target_tokens=requests.target_tokens,
                stage=stage_arr,
                success=success,
                enq_step=enq_step,
                enq_frac=enq_frac,
                wait_from_step=wait_from,
                admit_step=sched.admit_step,
                first_token_step=sched.first_step,
                last_step=sched.last_step,
                preemptions=sched.n_preempt,
                n_stages=len(load.stage_offsets_s),
                name=name,
            )
        kv = sched.kv
        return SimResult(
            metrics=metrics,
            requests=requests,
            trajectory=traj,
            n_steps=len(steps),
            kv_capacity_blocks=self.kv_total,
            stage_start_us=self.stage_start,
            total_preemptions=sched.total_preempt,
            extra={"kv_free_blocks_at_end": kv.free(), "kv_blocks_held_at_end": kv.held_blocks()}
            | ({"token_times": tokens} if tokens is not None else {}),
        )


# ---------------------------------------------------------------------------
# Client-side measurement


def _step_timeline(steps: StepLog, otp_us: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The steps' starts and cycles, whether each one's outputs wait for the next step, and when
    its tokens reach the client: end of step k+1, or end of step k before an idle gap."""
    start = np.array(steps.start, dtype=np.float64)
    cycle = np.array(steps.cycle, dtype=np.float64)
    follows = np.array(steps.follows, dtype=bool)
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
    out = _step_timeline(steps, otp_us)[3]
    done = np.where(status == REJECTED, enq, send + timeout_us)
    fin = status == FINISHED
    if fin.any():
        done[fin] = np.minimum(out[last[fin]] + gap_us, send[fin] + timeout_us)
    return float(np.max(done)) if len(done) else 0.0
