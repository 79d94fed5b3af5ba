"""Replayed-experiment rows for the search: closed-loop trajectories -> linear forms.

A reference model drives the closed-loop simulation of every experiment once, scaled to
the experiment's observed ITL (``anchor``); the recorded batches (teacher forcing) then
turn each experiment's mean E2E, TTFT and ITL into linear functions of a candidate's
per-step times (``fitness.sim.replay``). A second closed-loop run 3% apart measures how much
more the closed loop moves each mean than teacher forcing does, and the forms are
linearised around the recording with that gain (``linearise``): near saturation the
search then sees the closed loop's sensitivity. The search refreshes the trajectories
with its current best model now and then, so the fixed batches stay close to the ones
the candidates would produce.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from joblib import Parallel, delayed

from primitives.compute import primitive_columns
from primitives.deployment import DeploymentResolver
from primitives.errors import InputError

from primitives.data.experiments import ExperimentSpec, find_experiments
from fitness.sim.replay import metric_weights
from .scoring import OVERHEAD_COLUMNS, REPLAY_METRICS, ReplayRows
from fitness.sim.simulator import Overheads, simulate

US = 1e6
# Consecutive steps change little, so the replayed sums keep one row per block of
# STEP_STRIDE steps (block means of the primitives, block sums of the weights): the
# search evaluates ~90k rows instead of ~700k, for a relative error far below 1e-3.
STEP_STRIDE = 8
# Observed means (seconds) behind each replayed metric.
OBSERVED_FIELDS = {"e2e": "e2e_mean_s", "ttft": "ttft_mean_s", "itl": "itl_mean_s"}


@dataclass
class ExperimentTrajectory:
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


def row_labels(spec: ExperimentSpec) -> list[tuple[str, str]]:
    """(metric, scope) rows of an experiment: the whole run, plus each stage if several."""
    scopes = ["all"] + ([f"stage_{i}" for i in range(len(spec.stages))] if len(spec.stages) > 1 else [])
    return [(m, scope) for scope in scopes for m in REPLAY_METRICS]


def observed_us(spec: ExperimentSpec, labels: list[tuple[str, str]]) -> np.ndarray:
    out = np.full(len(labels), np.nan)
    if spec.observed is None:
        return out
    for i, (m, scope) in enumerate(labels):
        src = _scope(spec.observed, scope)
        v = getattr(src, OBSERVED_FIELDS[m]) if src is not None else None
        if v is not None:
            out[i] = float(v) * US
    return out


def _stage(observed, scope: str):
    i = int(scope.split("_")[1])
    return observed.stages[i] if i < len(observed.stages) else None


REFERENCE_EXPRESSION = (
    "1000 + 1.0*weight_time_us + 1.0*kv_io_time_us + 0.3*matmul_time_us + 30*n_layers"
    " + 20*allreduce_calls + 10*batch_size"
)
REFERENCE_OVERHEADS = {"queueing_base_us": 10_000.0}


def reference_model(deployment):
    """A hand-calibrated physics model to record the first trajectories with.

    Roughly: weights and KV at full HBM bandwidth, ~30 µs per layer of launch and
    synchronisation, ~20 µs per all-reduce, ~1 ms of CPU per step, ~10 ms of API
    overhead. It errs on the fast side, so that no experiment starts in a spurious
    overload; only the batches it produces matter, and they are refreshed with fitted
    models (``calibrated_replay_rows``).
    """
    from fitness.sim.models import ExpressionLatencyModel

    return ExpressionLatencyModel(REFERENCE_EXPRESSION, deployment, REFERENCE_OVERHEADS)


class AnchoredModel:
    """A latency model whose step times are scaled by a constant (recording only).

    Teacher forcing needs batches like the real ones. Near the 128-slot cap a model a few
    percent slow queues without bound in the closed loop, and its batches then say more
    about that error than about the server. So trajectories are recorded with the
    candidate scaled to reproduce the experiment's observed ITL (about half a cycle):
    the batches have the observed concurrency, and the candidate is then judged on them.
    The scale never enters a model; validation runs the closed loop unscaled.
    """

    def __init__(self, model, scale: float):
        self.model = model
        self.scale = float(scale)

    def step_time_us(self, *batch) -> float:
        return self.scale * self.model.step_time_us(*batch)

    def __getattr__(self, name):
        if name == "model":  # not yet set (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self.model, name)


ANCHOR_PASSES = 7  # closed-loop passes at most while solving for the ITL anchor
ANCHOR_TOLERANCE = 0.01  # |predicted / observed ITL - 1| that counts as anchored
ANCHOR_LIMITS = (0.5, 2.0)
GAIN_STEP = 0.03  # relative step-time change behind the closed-loop gain
GAIN_LIMITS = (0.5, 10.0)


@dataclass
class Anchor:
    """The scale that puts an experiment's closed loop at its observed ITL, and the passes that found it."""

    scale: float
    passes: list[tuple[float, object]]  # (scale, ObservedMetrics) of every closed-loop pass


def anchor(spec: ExperimentSpec, deployment, model, seed: int) -> Anchor:
    """Solve ``ITL_closed_loop(scale * model) = ITL_observed`` for the scale.

    Near saturation the closed-loop ITL grows much faster than the scale (Llama-2-7B at
    20 req/s), so a plain fixed-point iteration overshoots and oscillates; this brackets
    the root in log scale and narrows it by secant steps kept inside the bracket.
    """
    obs = spec.observed.summary.itl_mean_s if spec.observed is not None else None
    passes: list[tuple[float, object]] = []
    if not obs:
        return Anchor(1.0, passes)
    lo_x, hi_x = np.log(ANCHOR_LIMITS[0]), np.log(ANCHOR_LIMITS[1])
    below: tuple[float, float] | None = None  # (log scale, log ITL ratio) of a pass with ITL too low
    above: tuple[float, float] | None = None
    x, best = 0.0, (np.inf, 1.0)
    for _ in range(ANCHOR_PASSES):
        metrics = simulate(spec, deployment, AnchoredModel(model, np.exp(x)), seed=seed, record=False).metrics
        passes.append((float(np.exp(x)), metrics))
        pred = metrics.summary.itl_mean_s
        if not pred:
            break
        g = float(np.log(pred / obs))
        if abs(g) < best[0]:
            best = (abs(g), float(np.exp(x)))
        if abs(g) < np.log1p(ANCHOR_TOLERANCE):
            break
        if g < 0:
            below = (x, g)
        else:
            above = (x, g)
        if below is not None and above is not None:
            (xb, gb), (xa, ga) = below, above
            width = xa - xb
            x_new = xb - gb * width / (ga - gb)
            lo, hi = sorted((xb, xa))
            x_new = float(np.clip(x_new, lo + 0.1 * abs(width), hi - 0.1 * abs(width)))
        else:
            x_new = x - g  # ITL proportional to the scale: exact far from saturation
        x_new = float(np.clip(x_new, lo_x, hi_x))
        if x_new == x:
            break
        x = x_new
    return Anchor(best[1], passes)


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
        a, b = _scope(at, scope), _scope(nearby, scope)
        va = getattr(a, OBSERVED_FIELDS[m]) if a is not None else None
        vb = getattr(b, OBSERVED_FIELDS[m]) if b is not None else None
        forced = (ratio - 1.0) * step_part_us[i]
        if va and vb and abs(forced) > 0:
            out[i] = (vb - va) * US / forced
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


def _scope(metrics, scope: str):
    return metrics.summary if scope == "all" else _stage(metrics, scope)


def _trajectory(spec: ExperimentSpec, deployment, model, names: list[str], seed: int) -> ExperimentTrajectory:
    a = anchor(spec, deployment, model, seed)
    recorder = AnchoredModel(model, a.scale) if a.passes else model
    result = simulate(spec, deployment, recorder, seed=seed, record=True)
    traj = result.trajectory
    feats = traj.features()
    cols = primitive_columns(feats, deployment.constants, names)
    labels = row_labels(spec)
    forms = metric_weights(traj, stages=len(spec.stages) > 1)
    fixed_names = [n for n in Overheads.names() if n not in OVERHEAD_COLUMNS]
    weights, overhead, fixed = [], [], []
    for m, scope in labels:
        w, const = forms[m if scope == "all" else f"{scope}/{m}"]
        weights.append(w)
        overhead.append([const.get(c, 0.0) for c in OVERHEAD_COLUMNS])
        # the overheads the search does not fit enter at the model's own values
        fixed.append(sum(const.get(n, 0.0) * float(getattr(recorder, n, getattr(Overheads, n, 0.0))) for n in fixed_names))
    weights, fixed = np.asarray(weights), np.asarray(fixed, dtype=float)
    observed = observed_us(spec, labels)
    recorded_part_us = weights @ traj.step_time_us  # each row's step-time part on the recording
    observed = distrust_spurious_queues(labels, recorded_part_us, observed)
    gain = np.ones(len(labels))
    if a.passes:
        # the nearest other pass if close enough for a local slope, else one more run
        near = [(s, m) for s, m in a.passes if 0.005 < abs(np.log(s / a.scale)) < 0.04]
        if near:
            s2, m2 = min(near, key=lambda it: abs(np.log(it[0] / a.scale)))
        else:
            s2 = a.scale * (1 + GAIN_STEP)
            m2 = simulate(spec, deployment, AnchoredModel(model, s2), seed=seed, record=False).metrics
        gain = closed_loop_gain(labels, result.metrics, m2, s2 / a.scale, recorded_part_us)
        weights, fixed = linearise(weights, fixed, recorded_part_us, gain)
    probes = {k: v[probe_steps(feats, cols)] for k, v in cols.items()}
    cols, weights = compress_steps(cols, weights, STEP_STRIDE)
    return ExperimentTrajectory(
        name=spec.name, model=deployment.model.name, columns=cols, weights=weights,
        overhead=np.asarray(overhead, dtype=float), fixed_us=fixed,
        observed_us=observed, labels=labels, gain=gain, probes=probes,
    )


PROBE_SAMPLE = 256  # evenly spaced steps, and as many of the pure-prefill ones


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
        picks.append(prefill_only[np.linspace(0, len(prefill_only) - 1, min(len(prefill_only), PROBE_SAMPLE)).astype(np.int64)])
    for v in columns.values():
        picks.append(np.array([int(np.argmin(v)), int(np.argmax(v))]))
    return np.unique(np.concatenate(picks))


SPURIOUS_QUEUE_FACTOR = 3.0


def distrust_spurious_queues(labels, recorded_part_us: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """Drop the E2E and TTFT rows of a scope whose recording queued where the server did not.

    Near saturation even an ITL-anchored recording can fill every slot and queue for
    seconds (Llama-2-7B at 20 req/s). Its batches still say how a step's time depends on
    the batch, so the ITL rows stay; but its waits are an artefact, and fitting TTFT/E2E to
    them would shrink every coefficient. A scope is distrusted when the recording's own
    mean TTFT exceeds SPURIOUS_QUEUE_FACTOR times the observed one.
    """
    out = observed.copy()
    own = dict(zip(labels, recorded_part_us.tolist()))  # the recording's own means (step part)
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


def scored_experiments(experiments_dir: Path) -> list[ExperimentSpec]:
    specs = find_experiments(experiments_dir)
    if not specs:
        raise InputError(experiments_dir, None, "no experiment directories (with exp-config.yaml) found here")
    with_results = [s for s in specs if s.observed is not None]
    if not with_results:
        raise InputError(experiments_dir, "results", "no experiment here has lifecycle metrics to fit against")
    return with_results


def trajectories(specs, resolver: DeploymentResolver, models: list, names: list[str], seed: int, jobs: int):
    """Closed-loop runs of each experiment with its model, in parallel."""
    deps = [resolver.resolve(s.model, s.tp) for s in specs]
    if jobs > 1 and len(specs) > 1:
        return Parallel(n_jobs=jobs, backend="loky")(
            delayed(_trajectory)(s, d, m, names, seed) for s, d, m in zip(specs, deps, models)
        )
    return [_trajectory(s, d, m, names, seed) for s, d, m in zip(specs, deps, models)]


def rows_from(trajs: list[ExperimentTrajectory]) -> ReplayRows:
    return ReplayRows(
        names=[t.name for t in trajs], models=[t.model for t in trajs], columns=[t.columns for t in trajs],
        weights=[t.weights for t in trajs], overhead=[t.overhead for t in trajs],
        fixed_us=[t.fixed_us for t in trajs], observed_us=[t.observed_us for t in trajs],
        labels=[t.labels for t in trajs], probes=[t.probes for t in trajs],
    )


def build_replay_rows(experiments_dir: Path, resolver: DeploymentResolver, table, names: list[str], config) -> ReplayRows:
    """Initial rows: trajectories recorded with the reference physics model."""
    specs = scored_experiments(Path(experiments_dir))
    models = [reference_model(resolver.resolve(s.model, s.tp)) for s in specs]
    return rows_from(trajectories(specs, resolver, models, names, config.seed, config.jobs))


def refresh_replay_rows(experiments_dir: Path, resolver: DeploymentResolver, entry, names: list[str], seed: int,
                        jobs: int) -> ReplayRows:
    """Rows re-recorded with an archived model driving the closed loop."""
    from fitness.sim.models import ExpressionLatencyModel

    specs = scored_experiments(Path(experiments_dir))
    models = [ExpressionLatencyModel.from_entry(entry, resolver.resolve(s.model, s.tp)) for s in specs]
    return rows_from(trajectories(specs, resolver, models, names, seed, jobs))
