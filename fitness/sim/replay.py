"""Teacher-forced replay: re-time a recorded trajectory for other step times, without simulating.

The batches of a recorded :class:`fitness.sim.recording.Trajectory` stay fixed; only the
step cycles change (``cycle_k = step_time_us[k] + scheduling_processing_us +
preemption_processing_us * preemptions_k``). Every request's path is a contiguous run of
steps, so its client times are sums of cycles along the path:

* wait: ``queueing_time_us(input_len, send_depth)`` (send -> enqueued; ``send_depth``: the
  requests of the step running at sending), then the rest of the step that
  was running at that moment (``(1 - enq_frac) * cycle[enq_step]``), then the steps from
  ``wait_from_step`` on;
* a token sampled at step k reaches the client at the end of step k+1 (one-step output
  delay of asynchronous scheduling; the end of step k when the engine idled after it),
  plus ``output_token_processing_us``;
* two events per token: E2E ends ``event_gap_us`` after the last token, ITL pools the
  ``2N - 1`` gaps of each request, TPOT = (last - first event) / (2N - 1).

With the recorded step times and overheads it reproduces the closed-loop metrics exactly
(the trajectory is the one the closed loop took); with other step times it is the
teacher-forced approximation (same batches, same admissions, same successes).

Everything is linear in the step times, so :func:`metric_weights` also gives each mean as
``w @ step_time_us + sum(const[name] * overhead[name])``: the search can fit constants by
least squares.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fitness.sim.latency_model import SIMULATED_NON_STEP_NAMES, LatencyModel
from fitness.sim.loadgen import EVENTS_PER_TOKEN, lifecycle_means
from fitness.sim.recording import Trajectory
from primitives.data.experiments import LifecycleMetrics, ObservedMetrics

METRICS = ("e2e", "ttft", "itl", "tpot")
# what a linear form has a coefficient for: the non-step terms the simulator applies, and
# the client's event gap
OVERHEAD_NAMES = (*SIMULATED_NON_STEP_NAMES, "event_gap_us")


@dataclass(frozen=True)
class ReplayTimes:
    """Per-request client times of a replay (µs; successful requests only)."""

    ttft_us: np.ndarray
    e2e_us: np.ndarray
    span_us: np.ndarray  # last event - first event
    gaps: np.ndarray  # 2N - 1
    tpot_us: np.ndarray
    stage: np.ndarray


@dataclass(frozen=True)
class _Paths:
    """The fixed structure of a trajectory's successful requests (cached per trajectory)."""

    s: np.ndarray  # enqueue step (-1: none)
    wait_coef: np.ndarray  # 1 - enq_frac (0 where s == -1)
    b: np.ndarray  # first step the request could join
    ft: np.ndarray  # first-token step
    lt: np.ndarray  # last-token step
    cf: np.ndarray  # step ft's outputs wait for the end of step ft+1 (asynchronous scheduling)
    cl: np.ndarray
    input_len: np.ndarray
    send_depth: np.ndarray  # requests in the step running when it was sent
    n_tokens: np.ndarray
    stage: np.ndarray
    gaps: np.ndarray


def _paths(traj: Trajectory) -> _Paths:
    """The path arrays of TRAJ's successful requests, computed once and kept on the trajectory."""
    hit = traj.__dict__.get("_replay_paths")
    if hit is not None:
        return hit
    ok = traj.success
    s = traj.enq_step[ok]
    ft = traj.first_token_step[ok]
    lt = traj.last_step[ok]
    nc = traj.output_delayed
    n_tok = traj.target_tokens[ok].astype(np.float64)
    p = _Paths(
        s=s,
        wait_coef=np.where(s >= 0, 1.0 - traj.enq_frac[ok], 0.0),
        b=traj.wait_from_step[ok],
        ft=ft,
        lt=lt,
        cf=nc[ft] if len(ft) else np.zeros(0, bool),
        cl=nc[lt] if len(lt) else np.zeros(0, bool),
        input_len=traj.input_len[ok].astype(np.float64),
        send_depth=traj.send_depth[ok].astype(np.float64),
        n_tokens=n_tok,
        stage=traj.stage[ok],
        gaps=EVENTS_PER_TOKEN * n_tok - 1,
    )
    traj.__dict__["_replay_paths"] = p
    return p


def cycles_us(traj: Trajectory, step_time_us: np.ndarray, overheads: LatencyModel) -> np.ndarray:
    """Each step's cycle: the model's step time (times the recorded scatter) plus the per-step CPU overheads."""
    cyc = np.asarray(step_time_us, dtype=np.float64)
    if traj.step_scale is not None:  # the same stalls on the same steps as the recording
        cyc = cyc * traj.step_scale
    cyc = cyc + float(overheads.scheduling_processing_us)
    pre = float(overheads.preemption_processing_us)
    if pre:
        cyc = cyc + pre * traj.step_preemptions
    return cyc


def replay_times(traj: Trajectory, step_time_us: np.ndarray, overheads: LatencyModel) -> ReplayTimes:
    """Per-request client times of the successful requests for the given step times."""
    p = _paths(traj)
    cyc = cycles_us(traj, step_time_us, overheads)
    n = len(cyc)
    P = np.concatenate([[0.0], np.cumsum(cyc)])
    nxt = np.append(cyc, 0.0)  # cycle of step k+1 (0 past the end)
    q = np.asarray(overheads.queueing_time_us(p.input_len, p.send_depth), dtype=np.float64)
    otp = float(overheads.output_token_processing_us)
    gap = float(overheads.event_gap_us)
    wait = p.wait_coef * cyc[np.maximum(p.s, 0)] if n else np.zeros(len(p.b))
    start_b = q + wait - P[p.b]  # relative to the send time: time of step b's start, minus P[b]
    first = start_b + P[p.ft + 1] + np.where(p.cf, nxt[p.ft + 1], 0.0) + otp
    last = start_b + P[p.lt + 1] + np.where(p.cl, nxt[p.lt + 1], 0.0) + otp
    span = last + gap - first
    tpot = np.where(p.gaps > 0, span / np.maximum(p.gaps, 1), 0.0)
    return ReplayTimes(ttft_us=first, e2e_us=last + gap, span_us=span, gaps=p.gaps, tpot_us=tpot, stage=p.stage)


def replay(traj: Trajectory, step_time_us: np.ndarray, overheads: LatencyModel, stages: bool = True) -> ObservedMetrics:
    """The run's metrics (same keys as the observed results, seconds) for new step times.

    ``overheads``: a LatencyModel, or just its :class:`fitness.sim.latency_model.NonStepTerms`.
    """
    t = replay_times(traj, step_time_us, overheads)
    fail_all = traj.success.size - int(traj.success.sum())
    summary = lifecycle_means(t, slice(None), fail_all)
    per_stage: tuple[LifecycleMetrics, ...] = ()
    if stages:
        fails = np.bincount(traj.stage[~traj.success], minlength=traj.n_stages)
        per_stage = tuple(lifecycle_means(t, t.stage == s, int(fails[s])) for s in range(traj.n_stages))
    return ObservedMetrics(summary=summary, stages=per_stage)


# ---------------------------------------------------------------------------
# Linear forms


def _range_weights(lo: np.ndarray, hi: np.ndarray, coef: np.ndarray, n: int) -> np.ndarray:
    """sum_r coef_r * indicator(lo_r <= k <= hi_r), for every step k (difference array)."""
    d = np.bincount(lo, weights=coef, minlength=n + 1)[: n + 1]
    d = d - np.bincount(hi + 1, weights=coef, minlength=n + 2)[: n + 1]
    return np.cumsum(d)[:n]


def _point_weights(idx: np.ndarray, coef: np.ndarray, n: int) -> np.ndarray:
    keep = (idx >= 0) & (idx < n) & (coef != 0)
    return np.bincount(idx[keep], weights=coef[keep], minlength=n)[:n]


def _forms(
    p: _Paths, sel: np.ndarray | None, n: int, npre: np.ndarray
) -> dict[str, tuple[np.ndarray, dict[str, float]]]:
    if sel is not None:
        p = _Paths(**{k: getattr(p, k)[sel] for k in p.__dataclass_fields__})
    m = len(p.b)
    out: dict[str, tuple[np.ndarray, dict[str, float]]] = {}
    if m == 0:
        return out
    one = np.full(m, 1.0 / m)
    wait = _point_weights(p.s, one * p.wait_coef, n)
    # time of token k's arrival = wait + steps b..k + the next step if contiguous
    w_first = wait + _range_weights(p.b, p.ft, one, n) + _point_weights(p.ft + 1, one * p.cf, n)
    w_last = wait + _range_weights(p.b, p.lt, one, n) + _point_weights(p.lt + 1, one * p.cl, n)
    mean_len = float(p.input_len.mean())
    mean_depth = float(p.send_depth.mean())

    def const(w: np.ndarray, queue: float, otp: float, gap: float) -> dict[str, float]:
        return {
            "queueing_base_us": queue,
            "queueing_per_input_token_us": queue * mean_len,
            "queueing_per_running_request_us": queue * mean_depth,
            "output_token_processing_us": otp,
            "scheduling_processing_us": float(w.sum()),
            "preemption_processing_us": float(w @ npre),
            "event_gap_us": gap,
        }

    out["e2e"] = (w_last, const(w_last, 1.0, 1.0, 1.0))
    out["ttft"] = (w_first, const(w_first, 1.0, 1.0, 0.0))

    # span of request r = sum over steps f+1..l + next-step terms; pooled over sum(2N-1) gaps
    def span_weights(c: np.ndarray) -> np.ndarray:
        return (
            _range_weights(p.ft + 1, p.lt, c, n)
            + _point_weights(p.lt + 1, c * p.cl, n)
            - _point_weights(p.ft + 1, c * p.cf, n)
        )

    g_total = float(p.gaps.sum())
    w_itl = span_weights(np.full(m, 1.0 / g_total))
    out["itl"] = (w_itl, const(w_itl, 0.0, 0.0, m / g_total))
    c_tpot = np.where(p.gaps > 0, 1.0 / np.maximum(p.gaps, 1), 0.0) / m
    w_tpot = span_weights(c_tpot)
    out["tpot"] = (w_tpot, const(w_tpot, 0.0, 0.0, float(c_tpot.sum())))
    return out


def metric_weights(traj: Trajectory, stages: bool = True) -> dict[str, tuple[np.ndarray, dict[str, float]]]:
    """Linear forms of the replayed means, in µs.

    ``mean_us[name] = w @ step_time_us + sum(const[k] * overheads.k)`` for ``name`` in
    ``e2e``, ``ttft``, ``itl``, ``tpot`` (means over successful requests; ITL pooled as the
    load generator does) and ``stage_<i>/<metric>`` per stage. ``const`` holds the
    coefficient of every name in ``OVERHEAD_NAMES``: the queueing time
    enters as ``queueing_base_us + queueing_per_input_token_us * input_len +
    queueing_per_running_request_us * send_depth``; the per-step
    CPU overheads through the step cycles.
    """
    p = _paths(traj)
    n = traj.n_steps
    npre = traj.step_preemptions.astype(np.float64)
    out = _forms(p, None, n, npre)
    if stages:
        for s in range(traj.n_stages):
            for k, v in _forms(p, p.stage == s, n, npre).items():
                out[f"stage_{s}/{k}"] = v
    if traj.step_scale is not None:  # a cycle's weight reaches the step time through its scale
        out = {name: (w * traj.step_scale, const) for name, (w, const) in out.items()}
    return out


def evaluate_weights(
    weights: dict[str, tuple[np.ndarray, dict[str, float]]], step_time_us: np.ndarray, overheads: LatencyModel
) -> dict[str, float]:
    """Apply :func:`metric_weights` forms: mean (µs) of every metric."""
    vals = {k: float(getattr(overheads, k)) for k in OVERHEAD_NAMES}
    step_time_us = np.asarray(step_time_us, dtype=np.float64)
    return {
        name: float(w @ step_time_us + sum(c * vals[k] for k, c in const.items()))
        for name, (w, const) in weights.items()
    }
