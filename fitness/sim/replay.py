"""Teacher-forced replay: re-time a recorded trajectory for other step times, without simulating.

The batches of a recorded :class:`fitness.sim.simulator.Trajectory` stay fixed; only the
step cycles change (``cycle_k = step_time_us[k] + scheduling_processing_us +
preemption_processing_us * preemptions_k``). Every request's path is a contiguous run of
steps, so its client times are sums of cycles along the path:

* wait: ``queueing_time_us(input_len)`` (send -> enqueued), then the rest of the step that
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

from primitives.data.experiments import LifecycleMetrics, ObservedMetrics
from fitness.sim.loadgen import DEFAULT_EVENT_GAP_US, EVENTS_PER_TOKEN, US_PER_S
from fitness.sim.simulator import Overheads, Trajectory

METRICS = ("e2e", "ttft", "itl", "tpot")
OVERHEAD_NAMES = Overheads.names()


@dataclass(frozen=True)
class ReplayTimes:
    """Per-request client times of a replay (µs; successful requests only)."""

    ttft_us: np.ndarray
    e2e_us: np.ndarray
    span_us: np.ndarray  # last event - first event
    gaps: np.ndarray  # 2N - 1
    stage: np.ndarray


def _overhead(overheads, name: str, default: float = 0.0) -> float:
    return float(getattr(overheads, name, default))


@dataclass(frozen=True)
class _Paths:
    """The fixed structure of a trajectory's successful requests (cached per trajectory)."""

    s: np.ndarray  # enqueue step (-1: none)
    wait_coef: np.ndarray  # 1 - enq_frac (0 where s == -1)
    b: np.ndarray  # first step the request could join
    f: np.ndarray  # first-token step
    l: np.ndarray  # last-token step
    cf: np.ndarray  # step f's outputs wait for the end of step f+1 (asynchronous scheduling)
    cl: np.ndarray
    input_len: np.ndarray
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
    f = traj.first_token_step[ok]
    l = traj.last_step[ok]
    nc = traj.output_delayed
    n_tok = traj.target_tokens[ok].astype(np.float64)
    p = _Paths(
        s=s,
        wait_coef=np.where(s >= 0, 1.0 - traj.enq_frac[ok], 0.0),
        b=traj.wait_from_step[ok],
        f=f,
        l=l,
        cf=nc[f] if len(f) else np.zeros(0, bool),
        cl=nc[l] if len(l) else np.zeros(0, bool),
        input_len=traj.input_len[ok].astype(np.float64),
        n_tokens=n_tok,
        stage=traj.stage[ok],
        gaps=EVENTS_PER_TOKEN * n_tok - 1,
    )
    traj.__dict__["_replay_paths"] = p
    return p


def cycles_us(traj: Trajectory, step_time_us: np.ndarray, overheads) -> np.ndarray:
    """Each step's cycle: the model's step time plus the per-step CPU overheads."""
    cyc = np.asarray(step_time_us, dtype=np.float64) + _overhead(overheads, "scheduling_processing_us")
    pre = _overhead(overheads, "preemption_processing_us")
    if pre:
        cyc = cyc + pre * traj.step_preemptions
    return cyc


def replay_times(traj: Trajectory, step_time_us: np.ndarray, overheads) -> ReplayTimes:
    """Per-request client times of the successful requests for the given step times."""
    p = _paths(traj)
    cyc = cycles_us(traj, step_time_us, overheads)
    n = len(cyc)
    P = np.concatenate([[0.0], np.cumsum(cyc)])
    nxt = np.append(cyc, 0.0)  # cycle of step k+1 (0 past the end)
    q = np.asarray(overheads.queueing_time_us(p.input_len), dtype=np.float64) if hasattr(
        overheads, "queueing_time_us") else np.zeros(len(p.b))
    otp = _overhead(overheads, "output_token_processing_us")
    gap = _overhead(overheads, "event_gap_us", DEFAULT_EVENT_GAP_US)
    wait = p.wait_coef * cyc[np.maximum(p.s, 0)] if n else np.zeros(len(p.b))
    start_b = q + wait - P[p.b]  # relative to the send time: time of step b's start, minus P[b]
    first = start_b + P[p.f + 1] + np.where(p.cf, nxt[p.f + 1], 0.0) + otp
    last = start_b + P[p.l + 1] + np.where(p.cl, nxt[p.l + 1], 0.0) + otp
    return ReplayTimes(ttft_us=first, e2e_us=last + gap, span_us=last + gap - first, gaps=p.gaps, stage=p.stage)


def _lifecycle(t: ReplayTimes, mask: np.ndarray | None, failures: int) -> LifecycleMetrics:
    sel = slice(None) if mask is None else mask
    e2e, ttft, span, gaps = t.e2e_us[sel], t.ttft_us[sel], t.span_us[sel], t.gaps[sel]
    n = len(e2e)
    if n == 0:
        return LifecycleMetrics(successes=0, failures=failures)
    g = gaps.sum()
    tpot = np.where(gaps > 0, span / np.maximum(gaps, 1), 0.0)
    return LifecycleMetrics(
        successes=n,
        failures=failures,
        e2e_mean_s=float(e2e.mean() / US_PER_S),
        ttft_mean_s=float(ttft.mean() / US_PER_S),
        itl_mean_s=float(span.sum() / g / US_PER_S) if g > 0 else None,
        tpot_mean_s=float(tpot.mean() / US_PER_S),
    )


def replay(traj: Trajectory, step_time_us: np.ndarray, overheads, stages: bool = True) -> ObservedMetrics:
    """The run's metrics (same keys as the observed results, seconds) for new step times.

    ``overheads``: anything with the :class:`fitness.sim.simulator.Overheads` attributes (a
    LatencyModel works too); missing ones count as 0 (``event_gap_us``: the default).
    """
    t = replay_times(traj, step_time_us, overheads)
    fail_all = traj.success.size - int(traj.success.sum())
    summary = _lifecycle(t, None, fail_all)
    per_stage: tuple[LifecycleMetrics, ...] = ()
    if stages:
        fails = np.bincount(traj.stage[~traj.success], minlength=traj.n_stages)
        per_stage = tuple(_lifecycle(t, t.stage == s, int(fails[s])) for s in range(traj.n_stages))
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


def _forms(p: _Paths, sel: np.ndarray | None, n: int, npre: np.ndarray) -> dict[str, tuple[np.ndarray, dict[str, float]]]:
    if sel is not None:
        p = _Paths(**{k: getattr(p, k)[sel] for k in p.__dataclass_fields__})
    m = len(p.b)
    out: dict[str, tuple[np.ndarray, dict[str, float]]] = {}
    if m == 0:
        return out
    one = np.full(m, 1.0 / m)
    wait = _point_weights(p.s, one * p.wait_coef, n)
    # time of token k's arrival = wait + steps b..k + the next step if contiguous
    w_first = wait + _range_weights(p.b, p.f, one, n) + _point_weights(p.f + 1, one * p.cf, n)
    w_last = wait + _range_weights(p.b, p.l, one, n) + _point_weights(p.l + 1, one * p.cl, n)
    mean_len = float(p.input_len.mean())

    def const(w: np.ndarray, queue: float, otp: float, gap: float) -> dict[str, float]:
        return {
            "queueing_base_us": queue,
            "queueing_per_input_token_us": queue * mean_len,
            "output_token_processing_us": otp,
            "scheduling_processing_us": float(w.sum()),
            "preemption_processing_us": float(w @ npre),
            "event_gap_us": gap,
        }

    out["e2e"] = (w_last, const(w_last, 1.0, 1.0, 1.0))
    out["ttft"] = (w_first, const(w_first, 1.0, 1.0, 0.0))
    # span of request r = sum over steps f+1..l + next-step terms; pooled over sum(2N-1) gaps
    def span_weights(c: np.ndarray) -> np.ndarray:
        return (_range_weights(p.f + 1, p.l, c, n) + _point_weights(p.l + 1, c * p.cl, n)
                - _point_weights(p.f + 1, c * p.cf, n))

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
    coefficient of every :class:`fitness.sim.simulator.Overheads` field: the queueing time
    enters as ``queueing_base_us + queueing_per_input_token_us * input_len``; the per-step
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
    return out


def evaluate_weights(weights: dict[str, tuple[np.ndarray, dict[str, float]]], step_time_us: np.ndarray,
                     overheads) -> dict[str, float]:
    """Apply :func:`metric_weights` forms: mean (µs) of every metric."""
    vals = {k: _overhead(overheads, k, DEFAULT_EVENT_GAP_US if k == "event_gap_us" else 0.0) for k in OVERHEAD_NAMES}
    step_time_us = np.asarray(step_time_us, dtype=np.float64)
    return {name: float(w @ step_time_us + sum(c * vals[k] for k, c in const.items()))
            for name, (w, const) in weights.items()}


__all__ = ["METRICS", "OVERHEAD_NAMES", "ReplayTimes", "cycles_us", "evaluate_weights", "metric_weights",
           "replay", "replay_times"]
