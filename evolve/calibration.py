"""Trajectory calibration and refresh: the closed-loop recordings behind the replay rows.

A model drives the closed-loop simulation of every experiment, scaled to the
experiment's observed ITL (``anchor``); the recorded batches (teacher forcing) then
turn each experiment's mean E2E, TTFT and ITL into linear functions of a candidate's
per-step times (``fitness.replay_rows``). A second closed-loop run 3% apart measures
how much more the closed loop moves each mean than teacher forcing does, and the forms
are linearised around the recording with that gain. The first recording is made with a
hand-calibrated physics model (``fitness.sim.models.reference_model``), then with the best seed fitted on
it (``calibrated_replay_rows``); the search refreshes the trajectories with its current
best model now and then (``refresh_replay_rows``), so the fixed batches stay close to
the ones the candidates would produce.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from evolve.config import RunConfig
from evolve.search import search_error
from evolve.toolbox import build_pset, seed_trees, tree_to_program
from fitness.replay_rows import (
    ExperimentTrajectory,
    ReplayRows,
    closed_loop_gain,
    compress_steps,
    distrust_spurious_queues,
    linearise,
    mean_of_draws,
    observed_us,
    probe_steps,
    row_labels,
    rows_from,
)
from fitness.scoring import FitnessContext, score_program
from fitness.sim.engine import simulate
from fitness.sim.latency_model import FITTED_NON_STEP_NAMES
from fitness.sim.loadgen import NoSuccessfulRequest, require_success
from fitness.sim.models import AnchoredModel, ExpressionLatencyModel, reference_model
from fitness.sim.replay import OVERHEAD_NAMES, metric_weights
from fitness.step_scatter import recorded_scatter, step_scales
from fitness.validate import ClosedLoopSettings, per_draw
from primitives.compute import kernel_binding, primitive_columns
from primitives.data.experiments import ExperimentSpec, find_experiments
from primitives.deployment import DeploymentResolver
from primitives.errors import InputError
from primitives.language import linear_model_sympy, to_infix

# Consecutive steps change little, so the replayed sums keep one row per block of
# STEP_STRIDE steps (block means of the primitives, block sums of the weights): the
# search evaluates ~90k rows instead of ~700k, for a relative error far below 1e-3.
STEP_STRIDE = 8
ANCHOR_PASSES = 7  # closed-loop passes at most while solving for the ITL anchor
ANCHOR_TOLERANCE = 0.01  # |predicted / observed ITL - 1| that counts as anchored
ANCHOR_LIMITS = (0.5, 2.0)
GAIN_STEP = 0.03  # relative step-time change behind the closed-loop gain


@dataclass
class Anchor:
    """The scale that puts an experiment's closed loop at its observed ITL, and the passes that found it."""

    scale: float
    passes: list[tuple[float, object]]  # (scale, ObservedMetrics) of every closed-loop pass
    recording: object = None  # the SimResult of the pass at ``scale``, recorded (when asked for)


def anchor(spec: ExperimentSpec, deployment, model, seed: int, record: bool = False, step_scales=None) -> Anchor:
    """Solve ``ITL_closed_loop(scale * model) = ITL_observed`` for the scale.

    ``record``: every pass records its batches and the best one is kept, so that the
    recording at the anchored scale is not run again (a recorded pass of the compiled core
    costs about 1.4x an unrecorded one, a pass more costs 2x).

    ``step_scales``: the simulated steps' multipliers (the measured scatter, ``fitness.step_scatter``).

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
    x, best, recording = 0.0, (np.inf, 1.0), None
    for _ in range(ANCHOR_PASSES):
        result = simulate(
            spec, deployment, AnchoredModel(model, np.exp(x)), seed=seed, record=record, step_scales=step_scales
        )
        metrics = result.metrics
        passes.append((float(np.exp(x)), metrics))
        pred = metrics.summary.itl_mean_s
        if not pred:
            break
        g = float(np.log(pred / obs))
        if abs(g) < best[0]:
            best = (abs(g), float(np.exp(x)))
            recording = result if record else None
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
    return Anchor(best[1], passes, recording)


def record_trajectory(
    spec: ExperimentSpec, deployment, model, names: list[str], seed: int, scatter=None
) -> ExperimentTrajectory:
    """One experiment's replay rows, recorded with MODEL anchored at the observed ITL."""
    scales = step_scales(scatter, seed)  # the same stalls in every pass
    a = anchor(spec, deployment, model, seed, record=True, step_scales=scales)
    recorder = AnchoredModel(model, a.scale) if a.passes else model
    result = a.recording or simulate(spec, deployment, recorder, seed=seed, record=True, step_scales=scales)
    require_success(spec, deployment, result.metrics.summary, "the recording model")
    traj = result.trajectory
    feats = traj.features()
    cols = primitive_columns(feats, deployment.constants, names, kernel_binding(names, [deployment]))
    labels = row_labels(spec)
    forms = metric_weights(traj, stages=len(spec.stages) > 1)
    fixed_names = [n for n in OVERHEAD_NAMES if n not in FITTED_NON_STEP_NAMES]
    weights, overhead, fixed = [], [], []
    for m, scope in labels:
        w, const = forms[m if scope == "all" else f"{scope}/{m}"]
        weights.append(w)
        overhead.append([const.get(c, 0.0) for c in FITTED_NON_STEP_NAMES])
        # the overheads the search does not fit enter at the model's own values
        fixed.append(sum(const.get(n, 0.0) * float(getattr(recorder, n)) for n in fixed_names))
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
            nudged = AnchoredModel(model, s2)
            m2 = simulate(spec, deployment, nudged, seed=seed, record=False, step_scales=scales).metrics
        gain = closed_loop_gain(labels, result.metrics, m2, s2 / a.scale, recorded_part_us)
        weights, fixed = linearise(weights, fixed, recorded_part_us, gain)
    probes = {k: v[probe_steps(feats, cols)] for k, v in cols.items()}
    cols, weights = compress_steps(cols, weights, STEP_STRIDE)
    return ExperimentTrajectory(
        name=spec.name,
        model=deployment.model.name,
        columns=cols,
        weights=weights,
        overhead=np.asarray(overhead, dtype=float),
        fixed_us=fixed,
        observed_us=observed,
        labels=labels,
        gain=gain,
        probes=probes,
    )


def scored_experiments(experiments_dir: Path) -> list[ExperimentSpec]:
    """The experiments under the directory that have results to fit against."""
    specs = find_experiments(experiments_dir)
    if not specs:
        raise InputError(experiments_dir, None, "no experiment directories (with exp-config.yaml) found here")
    with_results = [s for s in specs if s.observed is not None]
    if not with_results:
        raise InputError(experiments_dir, "results", "no experiment here has lifecycle metrics to fit against")
    return with_results


def experiments_fingerprint(directory: Path) -> str:
    """Names and observed results of the experiments the run is scored against."""
    h = hashlib.sha256()
    for spec in scored_experiments(directory):
        h.update(repr((spec.name, spec.model, spec.tp, spec.stages, spec.observed)).encode())
    return h.hexdigest()[:12]


def trajectories(
    specs,
    resolver: DeploymentResolver,
    models: list,
    names: list[str],
    settings: ClosedLoopSettings,
):
    """Closed-loop runs of each experiment with its model, in parallel, as ``settings`` say;
    with several draws of the load, each experiment's rows are their mean
    (``fitness.replay_rows.mean_of_draws``)."""
    deps = [resolver.resolve_experiment(s) for s in specs]
    runs = [(s, d, m, names) for s, d, m in zip(specs, deps, models, strict=True)]
    _, draws = per_draw(record_trajectory, runs, settings, settings.scatter)
    return [mean_of_draws(d) for d in draws]


def record_rows(
    specs: list[ExperimentSpec],
    resolver: DeploymentResolver,
    entry,
    names: list[str],
    settings: ClosedLoopSettings,
) -> ReplayRows:
    """Rows of these experiments, recorded with a model (expression and overheads) driving the
    closed loop; ``entry`` None: the hand-calibrated reference physics model (the first rows)."""
    deployments = [resolver.resolve_experiment(s) for s in specs]
    if entry is None:
        models = [reference_model(d) for d in deployments]
    else:
        models = [ExpressionLatencyModel.from_entry(entry, d) for d in deployments]
    return rows_from(trajectories(specs, resolver, models, names, settings))


def refresh_replay_rows(
    experiments_dir: Path, resolver: DeploymentResolver, entry, names: list[str], settings: ClosedLoopSettings
) -> ReplayRows:
    """``record_rows`` of every experiment with results under ``experiments_dir``."""
    return record_rows(scored_experiments(Path(experiments_dir)), resolver, entry, names, settings)


# --- the search's side: which model records, and when ---------------------------------
def replay_model_of(score) -> tuple[str, dict]:
    """(expression, overheads) of a scored candidate: what drives a closed loop."""
    return to_infix(linear_model_sympy(score.terms, score.coefficients, score.intercept)), dict(score.overheads)


def model_entry(replay_model: tuple[str, dict]):
    """What the closed loop needs of a model: its expression and overheads."""
    return SimpleNamespace(expression=replay_model[0], overheads=replay_model[1])


def run_settings(config: RunConfig) -> ClosedLoopSettings:
    """How a run simulates in the closed loop: its seed, draws of the load, measured step scatter
    and jobs (its recordings and its final check alike)."""
    return ClosedLoopSettings(config.seed, config.load_draws, recorded_scatter(config.step_scatter), config.jobs)


def run_rows(config: RunConfig, resolver: DeploymentResolver, model: tuple[str, dict] | None, names: list[str]):
    """The run's replay rows recorded with MODEL (None: the reference physics), as every recording
    of a run is made: its experiments, seed, jobs, measured step scatter and draws of the load."""
    entry = model_entry(model) if model is not None else None
    return refresh_replay_rows(Path(config.experiments), resolver, entry, names, run_settings(config))


def best_seed(ctx: FitnessContext, names: list[str]):
    """The seed model (``seeds/``) with the lowest search error in this context, and its score."""
    programs = [tree_to_program(t) for t in seed_trees(names, build_pset(names))]
    return min(((p, score_program(p, ctx)) for p in programs), key=lambda it: search_error(it[1]))


def calibrated_replay_rows(
    config: RunConfig,
    resolver: DeploymentResolver,
    ctx: FitnessContext,
    names: list[str],
    replay_model: tuple[str, dict] | None,
    ui,
):
    """Replay rows from the closed loop of ``replay_model``, or calibrated from scratch.

    Calibration: the reference physics records first trajectories; the best seed is
    fitted on them and drives the closed loop again, ``calibration_rounds`` times, so
    the search starts from batches close to what a fitted model produces.
    Returns (rows, the model that recorded them).
    """
    if replay_model is not None:
        ui.log("re-recording trajectories of the checkpointed replay model")
        return run_rows(config, resolver, replay_model, names), replay_model
    ui.log("recording reference trajectories (closed loop, every experiment)")
    rows = run_rows(config, resolver, None, names)
    recorded_by: tuple[str, dict] | None = None
    _, score = best_seed(replace(ctx, replay=rows), names)
    best = (score.replay_error, rows, recorded_by)
    for r in range(config.calibration_rounds):
        model = replay_model_of(score)
        ui.log(
            f"calibration {r + 1}/{config.calibration_rounds}: best seed's replay error {score.replay_error:.3f};"
            " re-recording with it"
        )
        try:
            rows = run_rows(config, resolver, model, names)
        except NoSuccessfulRequest as exc:
            ui.log(f"calibration {r + 1}: keeping the previous trajectories: {exc}")
            break
        _, score = best_seed(replace(ctx, replay=rows), names)
        if not score.replay_error < best[0]:
            # near saturation the fixed point can overshoot: keep the better trajectories
            ui.log(f"calibration {r + 1}: replay error {score.replay_error:.3f} is no better; keeping the previous")
            break
        best = (score.replay_error, rows, model)
    return best[1], best[2]


def refresh_every(config: RunConfig) -> int:
    """Generations between trajectory refreshes: ``--refresh-every``, else a third of the run."""
    return config.refresh_every or max(config.generations // 3, 1)


def record_refresh(search, config: RunConfig, resolver: DeploymentResolver, names: list[str], ui):
    """(replay rows, model) that the search's current best model records in the closed loop;
    None where it recorded the current ones or serves no request. The search is not touched:
    an interrupt or the time limit here leaves it whole."""
    model = replay_model_of(search.best_item()[1])
    if model == search.state.replay_model:  # the same closed loop would record the same trajectories
        ui.log(f"generation {search.state.generation}: the best model recorded the trajectories already; kept")
        return None
    ui.log(f"generation {search.state.generation}: refreshing trajectories with the current best model")
    try:
        return run_rows(config, resolver, model, names), model
    except NoSuccessfulRequest as exc:  # the model's own failure: keep the trajectories of the last one
        ui.log(f"refresh skipped, keeping the previous trajectories: {exc}")
        return None


def adopt_refresh(search, rows, model) -> None:
    """Continue the search under ROWS, recorded by MODEL: rescore its population and hall."""
    search.replace_context(replace(search.ctx, replay=rows))
    search.state.replay_model = model
