"""Replayed-experiment rows: the linear forms scoring fits, and the arithmetic behind them.

A recorded closed-loop trajectory (teacher forcing, ``fitness.sim.replay``) turns each
experiment's mean E2E, TTFT and ITL into a linear function of a candidate's per-step
times. Each row is one (metric, scope) mean: the whole run, or one load stage. The rows
are linearised around the recording with each row's closed-loop gain (``linearise``),
consecutive steps are compressed into blocks (``compress_steps``), and single steps are
kept as probes where every candidate must stay positive (``probe_steps``). Recording the
trajectories is the search's job (``evolve.calibration``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fitness.sim.loadgen import US_PER_S
from primitives.data.experiments import ExperimentSpec

REPLAY_METRICS = ("e2e", "ttft", "itl")
# The observed (and simulated) mean, in seconds, behind each replayed metric.
OBSERVED_FIELDS = {"e2e": "e2e_mean_s", "ttft": "ttft_mean_s", "itl": "itl_mean_s"}
GAIN_LIMITS = (0.5, 10.0)
PROBE_SAMPLE = 256  # evenly spaced steps, and as many of the pure-prefill ones
SPURIOUS_QUEUE_FACTOR = 3.0
# A per-running-request cost is learnt only from one experiment seen at two loads: its rows'
# mean running counts at sending must lie this far apart (the load stages of these data: 2-5x)
LOAD_SPREAD_MIN = 1.5


@dataclass
class ReplayRows:
    """Linear forms of the replayed means of each experiment (see fitness.sim.replay.metric_weights).

    Row i of experiment e is the mean of metric ``labels[e][i] = (metric, scope)`` over
    the whole run (scope "all") or one load stage ("stage_0", ...), in µs:
    ``mean = weights[e][i] @ step_time_us + overhead[e][i] @ theta + fixed_us[e][i]``,
    with theta the values of the fitted non-step terms
    (``fitness.sim.latency_model.FITTED_NON_STEP_NAMES``) and ``fixed_us`` the known terms
    (event gap). The forms are teacher-forced or linearised around the recording with
    each row's closed-loop gain. Stage rows pin how latency grows with load; the reported
    errors use "all" rows.
    """

    names: list[str]
    models: list[str]  # model of each experiment (for leave-one-model-out)
    columns: list[dict[str, np.ndarray]]  # per experiment: primitive -> per-step values
    weights: list[np.ndarray]  # per experiment: (n_rows, n_steps)
    overhead: list[np.ndarray]  # per experiment: (n_rows, len(FITTED_NON_STEP_NAMES))
    fixed_us: list[np.ndarray]  # per experiment: (n_rows,)
    observed_us: list[np.ndarray]  # per experiment: (n_rows,), NaN when unknown
    labels: list[list[tuple[str, str]]]  # per experiment: (metric, scope) of each row
    # per experiment: primitives of single recorded steps where the step time must be > 0
    probes: list[dict[str, np.ndarray]] | None = None

    def subset(self, keep: list[int]) -> "ReplayRows":
        pick = lambda xs: [xs[i] for i in keep]  # noqa: E731
        return ReplayRows(
            pick(self.names),
            pick(self.models),
            pick(self.columns),
            pick(self.weights),
            pick(self.overhead),
            pick(self.fixed_us),
            pick(self.observed_us),
            pick(self.labels),
            pick(self.probes) if self.probes is not None else None,
        )


@dataclass
class ExperimentTrajectory:
    """The rows of one experiment, from one recorded trajectory."""

    name: str
    model: str
    columns: dict[str, np.ndarray]
    weights: np.ndarray
    overhead: np.ndarray
    fixed_us: np.ndarray
    observed_us: np.ndarray
    labels: list[tuple[str, str]]
    gain: np.ndarray  # per row: closed-loop change per teacher-forced change (see closed_loop_gain)
    probes: dict[str, np.ndarray]  # primitives of single uncompressed steps (see probe_steps)


def mean_of_draws(draws: list[ExperimentTrajectory]) -> ExperimentTrajectory:
    """One experiment's rows as the mean over several draws of its load.

    Each draw's row is linear in its own steps' times, so their mean is linear in the
    union of the steps: the columns are concatenated and each draw's weights divided by
    the number of draws. A candidate is then fitted to the mean of what the draws give,
    the figure ``validate --load-draws`` compares, not to one draw's luck near saturation.
    A row that one draw's recording distrusts (``distrust_spurious_queues``) is dropped for
    all: the mean over the trusting draws alone would lean toward those that did not queue.
    """
    if len(draws) == 1:
        return draws[0]
    first, n = draws[0], len(draws)
    if any((d.name, d.labels) != (first.name, first.labels) for d in draws):
        raise ValueError("draws of different experiments (or rows) can not be averaged")
    return ExperimentTrajectory(
        name=first.name,
        model=first.model,
        columns={k: np.concatenate([d.columns[k] for d in draws]) for k in first.columns},
        weights=np.hstack([d.weights for d in draws]) / n,
        overhead=np.mean([d.overhead for d in draws], axis=0),
        fixed_us=np.mean([d.fixed_us for d in draws], axis=0),
        observed_us=np.minimum.reduce([d.observed_us for d in draws]),  # NaN where any draw queued spuriously
        labels=first.labels,
        gain=np.mean([d.gain for d in draws], axis=0),
        probes={k: np.concatenate([d.probes[k] for d in draws]) for k in first.probes},
    )


def rows_from(trajs: list[ExperimentTrajectory]) -> ReplayRows:
    return ReplayRows(
        names=[t.name for t in trajs],
        models=[t.model for t in trajs],
        columns=[t.columns for t in trajs],
        weights=[t.weights for t in trajs],
        overhead=[t.overhead for t in trajs],
        fixed_us=[t.fixed_us for t in trajs],
        observed_us=[t.observed_us for t in trajs],
        labels=[t.labels for t in trajs],
        probes=[t.probes for t in trajs],
    )


def load_slope_identified(row_experiment: np.ndarray, running: np.ndarray) -> bool:
    """Whether rows can pin ``queueing_per_running_request_us``: some experiment's rows see
    running counts at sending ``LOAD_SPREAD_MIN`` times apart.

    ``row_experiment``: each row's experiment; ``running``: each row's coefficient of the
    term (the mean running count at sending; 0 on rows it does not enter, ITL). Across
    experiments the running count moves with the model, the prompt lengths and the step
    price, which the fixed and per-token queueing terms also carry. A fit on one load per
    experiment (the low-rate stages alone) can then trade the slope against those terms
    (docs/RESULTS.md: nearly three times the slope every stage gives, and no fixed part),
    and the slope is what extrapolates to higher loads. Within one experiment, only the
    load moves.

    The rule is all or nothing: once one experiment spans two loads, the slope is fitted
    from every row, the differences between experiments included; those can still bias
    it, and only the experiments seen at two loads pull it toward the within-experiment
    slope.
    """
    for e in np.unique(row_experiment):
        r = running[(row_experiment == e) & (running > 0)]
        if len(r) and r.max() >= LOAD_SPREAD_MIN * r.min():
            return True
    return False


def bound_load_term(upper: np.ndarray, row_experiment: np.ndarray, running: np.ndarray, column: int) -> np.ndarray:
    """UPPER, the least squares' upper bounds, with the load term's (at COLUMN) at 0 where
    the rows cannot pin it (``load_slope_identified``); UPPER itself, unchanged, where they can."""
    if load_slope_identified(row_experiment, running):
        return upper
    held = upper.copy()
    held[column] = 0.0
    return held


def row_labels(spec: ExperimentSpec) -> list[tuple[str, str]]:
    """(metric, scope) rows of an experiment: the whole run, plus each stage if several."""
    scopes = ["all"] + ([f"stage_{i}" for i in range(len(spec.stages))] if len(spec.stages) > 1 else [])
    return [(m, scope) for scope in scopes for m in REPLAY_METRICS]


def observed_us(spec: ExperimentSpec, labels: list[tuple[str, str]]) -> np.ndarray:
    out = np.full(len(labels), np.nan)
    if spec.observed is None:
        return out
    for i, (m, scope) in enumerate(labels):
        src = scope_metrics(spec.observed, scope)
        v = getattr(src, OBSERVED_FIELDS[m]) if src is not None else None
        if v is not None:
            out[i] = float(v) * US_PER_S
    return out


def scope_metrics(metrics, scope: str):
    """The summary (scope "all") or one stage's metrics of observed or simulated metrics."""
    if scope == "all":
        return metrics.summary
    i = int(scope.split("_")[1])
    return metrics.stages[i] if i < len(metrics.stages) else None


def closed_loop_gain(labels: list[tuple[str, str]], at, nearby, ratio: float, step_part_us: np.ndarray) -> np.ndarray:
    """How far each replayed mean moves in the closed loop per µs it moves teacher-forced.

    ``at`` and ``nearby`` are the metrics of two closed-loop runs whose step times differ
    by the factor ``ratio``; ``step_part_us`` is each row's step-time part on the
    recording (``w @ step_time_us``), i.e. what the same change moves it by with the
    batches held fixed. Far from saturation the two agree (gain ~1); near it the batches
    grow with the step time and the closed loop multiplies the change (Llama-2-70B
    general's TTFT: ~8). Clipped to GAIN_LIMITS.
    """
    out = np.ones(len(labels))
    for i, (m, scope) in enumerate(labels):
        a, b = scope_metrics(at, scope), scope_metrics(nearby, scope)
        va = getattr(a, OBSERVED_FIELDS[m]) if a is not None else None
        vb = getattr(b, OBSERVED_FIELDS[m]) if b is not None else None
        forced = (ratio - 1.0) * step_part_us[i]
        if va and vb and abs(forced) > 0:
            out[i] = (vb - va) * US_PER_S / forced
    return np.clip(np.nan_to_num(out, nan=1.0), *GAIN_LIMITS)


def linearise(weights: np.ndarray, fixed_us: np.ndarray, recorded_part_us: np.ndarray, gain: np.ndarray):
    """Teacher-forced forms -> first-order closed-loop forms around the recording.

    closed loop ~ recorded + gain * (teacher-forced change of the step part), so a row
    ``w @ t + oh @ theta + fixed`` becomes ``gain*w @ t + oh @ theta + fixed + (1 - gain) * w @ t_rec``
    (``recorded_part_us`` = ``w @ t_rec``): still linear in the candidate's step times,
    equal to the recording at the recording, and equal to plain teacher forcing where the
    gain is 1.
    """
    return weights * gain[:, None], fixed_us + (1.0 - gain) * recorded_part_us


def probe_steps(features: dict[str, np.ndarray], columns: dict[str, np.ndarray]) -> np.ndarray:
    """Indices of single steps every candidate must give a positive time.

    The replayed rows average blocks of steps, which hides a term that goes negative on
    a rare kind of batch (a search found ``c*(num_decode_reqs - max(decode_tokens, r))``
    with c ~ 3e7: zero on every block, hugely negative on pure-prefill steps, where the
    1 µs floor then made prefill free). Probes: evenly spaced steps, pure-prefill
    steps, and the extremes of every primitive.
    """
    n = len(next(iter(columns.values()))) if columns else 0
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    picks = [np.linspace(0, n - 1, min(n, PROBE_SAMPLE)).astype(np.int64)]
    prefill_only = np.flatnonzero(features.get("decode_tokens", np.ones(n)) == 0)
    if len(prefill_only):
        spread = np.linspace(0, len(prefill_only) - 1, min(len(prefill_only), PROBE_SAMPLE)).astype(np.int64)
        picks.append(prefill_only[spread])
    for v in columns.values():
        picks.append(np.array([int(np.argmin(v)), int(np.argmax(v))]))
    return np.unique(np.concatenate(picks))


def distrust_spurious_queues(labels, recorded_part_us: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """Drop the E2E and TTFT rows of a scope whose recording queued where the server did not.

    Near saturation even an ITL-anchored recording can fill every slot and queue for
    seconds (Llama-2-7B at 20 req/s). Its batches still say how a step's time depends on
    the batch, so the ITL rows stay; but its waits are an artefact, and fitting TTFT/E2E to
    them would shrink every coefficient. A scope is distrusted when the recording's own
    mean TTFT exceeds SPURIOUS_QUEUE_FACTOR times the observed one.
    """
    out = observed.copy()
    own = dict(zip(labels, recorded_part_us.tolist(), strict=True))  # the recording's own means (step part)
    for i, (m, scope) in enumerate(labels):
        ttft_obs = next((observed[j] for j, lab in enumerate(labels) if lab == ("ttft", scope)), np.nan)
        if m in ("e2e", "ttft") and np.isfinite(ttft_obs) and own[("ttft", scope)] > SPURIOUS_QUEUE_FACTOR * ttft_obs:
            out[i] = np.nan
    return out


def compress_steps(columns: dict[str, np.ndarray], weights: np.ndarray, stride: int):
    """Blocks of ``stride`` consecutive steps: mean primitives, summed weights."""
    if stride <= 1:
        return columns, weights
    n = weights.shape[1]
    starts = np.arange(0, n, stride)
    counts = np.diff(np.append(starts, n)).astype(float)
    cols = {k: np.add.reduceat(v, starts) / counts for k, v in columns.items()}
    return cols, np.add.reduceat(weights, starts, axis=1)
