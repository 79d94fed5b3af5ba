"""What a run leaves: per-request outcomes, the steps with their batches, the recorded trajectory.

With ``record=True`` the simulator returns a :class:`Trajectory`: every step's batch in CSR
form and every request's path through the steps, from which ``fitness.sim.replay`` re-times
the run for other step times without re-simulating.

KV has two meanings here. The ``kv_tokens`` feature sums every request's context (what
attention reads: a shared prefix is read by each request that holds it);
``Trajectory.step_kv_block_tokens`` counts distinct blocks, as vLLM's block counters (and so
the real step traces) do. ``kv_sharing_factor`` relates the two.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from primitives.data.experiments import ObservedMetrics

# Request states (RequestTable.status holds the final one)
PENDING, WAITING, RUNNING, FINISHED, ABORTED, REJECTED = range(6)


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
    # KV tokens in distinct blocks held after scheduling (what vLLM's kv.blocks_* count:
    # a shared prefix once), beside the per-request sum the features hold
    step_kv_block_tokens: np.ndarray
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
    enqueue_us: np.ndarray  # when it reached the scheduler's queue: sent + its QueueingTime
    send_depth: np.ndarray  # requests in the step running when it was sent (the QueueingTime's load)
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
    # step k's time was the model's times step_scale[k] (the measured scatter); None: exactly the model's
    step_scale: np.ndarray | None = None

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

        return features_from_requests(
            self.batch_step,
            self.batch_progress,
            self.batch_new_tokens,
            self.batch_input_len,
            self.batch_output_len,
            self.n_steps,
            names,
        )

    def without_batches(self) -> "Trajectory":
        """A copy without the per-step batch rows (all replay needs; a fraction of the memory)."""
        empty = np.zeros(0, dtype=np.int32)
        return replace(
            self,
            step_offsets=np.zeros(self.n_steps + 1, dtype=np.int64),
            batch_progress=empty,
            batch_new_tokens=empty,
            batch_input_len=empty,
            batch_output_len=empty,
            batch_request=empty,
        )

    def running_depth(self, status: np.ndarray) -> np.ndarray:
        """Requests holding a slot while each step was scheduled, as the tracer's
        ``queue.running_depth`` counts them: the step's batch, and the requests that
        finished in the step before (``fitness.sim.scheduler`` releases their slots once
        this step is scheduled; at once where the engine idled or waited for that step's
        outputs, ``output_delayed`` False)."""
        last = self.last_step[(status == FINISHED) & (self.last_step >= 0)]
        last = last[self.output_delayed[last]]
        held = np.bincount(last + 1, minlength=self.n_steps + 1)[: self.n_steps]
        return np.diff(self.step_offsets) + held

    def waiting_depth(self, status: np.ndarray, timeout_s: float) -> np.ndarray:
        """Requests queued at the scheduler after each step was scheduled, as the tracer's
        ``queue.waiting_depth`` counts them.

        A request waits from its enqueue until its first admission (or its client-side
        abort, TIMEOUT_S after it was sent), and again between a preemption and its
        re-admission.
        """
        start = self.step_start_us
        n_steps = len(start)
        enq = self.enqueue_us
        # first wait: [first step starting at/after enqueue, admission step)
        ok = np.isfinite(enq) & (status != REJECTED)
        first = np.searchsorted(start, enq[ok], side="left")
        end = self.admit_step[ok].copy()
        never = end < 0
        deadline = np.searchsorted(start, self.send_us[ok] + timeout_s * 1e6, side="left")
        end[never] = np.where(status[ok][never] == ABORTED, deadline[never], n_steps)
        diff = np.zeros(n_steps + 1, dtype=np.int64)
        np.add.at(diff, np.minimum(first, n_steps), 1)
        np.add.at(diff, np.minimum(np.maximum(end, first), n_steps), -1)
        # re-waits after preemption: a request's progress falls between two of its rows
        if self.step_preemptions.sum() > 0:
            req = self.batch_request
            order = np.lexsort((self.batch_step, req))
            r, k = req[order], self.batch_step[order]
            p, n = self.batch_progress[order], self.batch_new_tokens[order]
            same = r[1:] == r[:-1]
            fell = same & (p[1:] < p[:-1] + n[:-1])
            np.add.at(diff, k[:-1][fell] + 1, 1)
            np.add.at(diff, k[1:][fell], -1)
        return np.cumsum(diff)[:n_steps]

    def batch(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        a, b = self.step_offsets[k], self.step_offsets[k + 1]
        return (
            self.batch_progress[a:b],
            self.batch_new_tokens[a:b],
            self.batch_input_len[a:b],
            self.batch_output_len[a:b],
        )


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
            self.cols = [
                np.concatenate([c[: self.pos], np.empty(self.cap - self.pos, dtype=np.int32)]) for c in self.cols
            ]
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


class StepLog:
    """The steps run so far: when each started, its model time and cycle, its preemptions, and
    (when recording) its batch rows."""

    def __init__(self, record: bool, capacity: int):
        self.start: list[float] = []
        self.time: list[float] = []
        self.cycle: list[float] = []
        self.preemptions: list[int] = []
        self.kv_held_blocks: list[int] = []  # distinct KV blocks requests hold (shared prefixes once)
        self.follows: list[bool] = []  # step k was launched while step k-1 ran (k-1's outputs delayed)
        self.gapless: list[bool] = []  # step k started right at the end of step k-1
        self.offsets: list[int] = [0]
        self.record = record
        self.batches = _Recorder(capacity)
        self.rows = 0

    def __len__(self) -> int:
        return len(self.start)

    def add(
        self,
        start_us: float,
        time_us: float,
        cycle_us: float,
        preemptions: int,
        follows: bool,
        gapless: bool,
        batch,
        kv_held_blocks: int,
    ) -> None:
        self.start.append(start_us)
        self.kv_held_blocks.append(kv_held_blocks)
        self.time.append(time_us)
        self.cycle.append(cycle_us)
        self.preemptions.append(preemptions)
        self.follows.append(follows)
        self.gapless.append(gapless)
        self.rows += len(batch[1])
        self.offsets.append(self.rows)
        if self.record:
            self.batches.add(*batch)


def enqueue_positions(enq_us, start, cycle, status):
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


def kv_sharing_factor(traj: Trajectory) -> float:
    """Per-request KV tokens over KV tokens in distinct blocks, over a recorded run's steps.

    Turns a trace's block count (shared prefixes once) into the per-request sum that the
    ``kv_tokens`` feature means, for a run of the same workload.
    """
    kv = traj.features(["kv_tokens"])["kv_tokens"]
    held = traj.step_kv_block_tokens.astype(np.float64)
    return float(kv.sum() / held.sum()) if held.sum() > 0 else 1.0
