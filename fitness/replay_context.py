"""Replayed-experiment rows for the search: closed-loop trajectories -> linear forms.

A reference model drives the closed-loop simulation of every experiment once; the
recorded batches (teacher forcing) then turn each experiment's mean E2E, TTFT and ITL
into linear functions of a candidate's per-step times (``fitness.replay``). The search
refreshes the trajectories with its current best model now and then, so the fixed
batches stay close to the ones the candidates would produce.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from joblib import Parallel, delayed

from primitives.compute import primitive_columns
from primitives.deployment import DeploymentResolver
from primitives.errors import InputError

from .experiments import ExperimentSpec, find_experiments
from .replay import metric_weights
from .scoring import OVERHEAD_COLUMNS, REPLAY_METRICS, ReplayRows
from .simulator import Overheads, simulate

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


def row_labels(spec: ExperimentSpec) -> list[tuple[str, str]]:
    """(metric, scope) rows of an experiment: the whole run, plus each stage if several."""
    scopes = ["all"] + ([f"stage_{i}" for i in range(len(spec.stages))] if len(spec.stages) > 1 else [])
    return [(m, scope) for scope in scopes for m in REPLAY_METRICS]


def observed_us(spec: ExperimentSpec, labels: list[tuple[str, str]]) -> np.ndarray:
    out = np.full(len(labels), np.nan)
    if spec.observed is None:
        return out
    for i, (m, scope) in enumerate(labels):
        src = spec.observed.summary if scope == "all" else _stage(spec.observed, scope)
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
    from .latency import ExpressionLatencyModel

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


ANCHOR_PASSES = 2  # closed-loop passes that refine the ITL anchor before recording
ANCHOR_LIMITS = (0.5, 2.0)


def anchored(spec: ExperimentSpec, deployment, model, seed: int):
    """The model scaled so that the closed loop reproduces the observed mean ITL."""
    obs = spec.observed.summary.itl_mean_s if spec.observed is not None else None
    if not obs:
        return model
    scale = 1.0
    for _ in range(ANCHOR_PASSES):
        pred = simulate(spec, deployment, AnchoredModel(model, scale), seed=seed, record=False).metrics.summary
        if not pred.itl_mean_s:
            break
        scale = float(np.clip(scale * obs / pred.itl_mean_s, *ANCHOR_LIMITS))
    return AnchoredModel(model, scale)


def _trajectory(spec: ExperimentSpec, deployment, model, names: list[str], seed: int) -> ExperimentTrajectory:
    model = anchored(spec, deployment, model, seed)
    result = simulate(spec, deployment, model, seed=seed, record=True)
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
        fixed.append(sum(const.get(n, 0.0) * float(getattr(model, n, getattr(Overheads, n, 0.0))) for n in fixed_names))
    observed = observed_us(spec, labels)
    observed = distrust_spurious_queues(labels, np.asarray(weights), traj.step_time_us, observed)
    cols, weights = compress_steps(cols, np.asarray(weights), STEP_STRIDE)
    return ExperimentTrajectory(
        name=spec.name, model=deployment.model.name, columns=cols, weights=weights,
        overhead=np.asarray(overhead, dtype=float), fixed_us=np.asarray(fixed, dtype=float),
        observed_us=observed, labels=labels,
    )


SPURIOUS_QUEUE_FACTOR = 3.0


def distrust_spurious_queues(labels, weights: np.ndarray, step_time_us: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """Drop the E2E and TTFT rows of a scope whose recording queued where the server did not.

    Near saturation even an ITL-anchored recording can fill every slot and queue for
    seconds (Llama-2-7B at 20 req/s). Its batches still say how a step's time depends on
    the batch, so the ITL rows stay; but its waits are an artefact, and fitting TTFT/E2E to
    them would shrink every coefficient. A scope is distrusted when the recording's own
    mean TTFT exceeds SPURIOUS_QUEUE_FACTOR times the observed one.
    """
    out = observed.copy()
    own = {lab: float(w @ step_time_us) for lab, w in zip(labels, weights)}
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
        labels=[t.labels for t in trajs],
    )


def build_replay_rows(experiments_dir: Path, resolver: DeploymentResolver, table, names: list[str], config) -> ReplayRows:
    """Initial rows: trajectories recorded with the reference physics model."""
    specs = scored_experiments(Path(experiments_dir))
    models = [reference_model(resolver.resolve(s.model, s.tp)) for s in specs]
    return rows_from(trajectories(specs, resolver, models, names, config.seed, config.jobs))


def refresh_replay_rows(experiments_dir: Path, resolver: DeploymentResolver, entry, names: list[str], seed: int,
                        jobs: int) -> ReplayRows:
    """Rows re-recorded with an archived model driving the closed loop."""
    from .latency import ExpressionLatencyModel

    specs = scored_experiments(Path(experiments_dir))
    models = [ExpressionLatencyModel.from_entry(entry, resolver.resolve(s.model, s.tp)) for s in specs]
    return rows_from(trajectories(specs, resolver, models, names, seed, jobs))
