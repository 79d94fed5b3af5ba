"""Scoring a candidate: fit its constants by least squares, then measure its errors.

A candidate program is split at its root into additive terms; the step time is
``intercept + sum(coef_i * term_i)`` with every coefficient >= 0 (costs add up), fitted
by non-negative least squares on relative error. When replayed experiments are given,
their mean E2E, TTFT and ITL are linear in the step times along fixed (teacher-forced)
trajectories, so they join the same least-squares problem as extra rows, together
with the API-overhead terms. One set of constants serves every model: no per-model
intercepts, the primitives carry the differences.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import nnls

from evolve.expression import Program, additive_terms, evaluate_program, variables
from .dataset import StepTable

WORST = 1e9  # the score of a candidate that produced NaN/inf or fitted nothing
REPLAY_METRICS = ("e2e", "ttft", "itl")
# Non-step terms fitted from the replayed TTFT/E2E (µs); see fitness.overheads for semantics.
OVERHEAD_COLUMNS = ("queueing_base_us", "queueing_per_input_token_us")


@dataclass
class ReplayRows:
    """Per-experiment linear forms of the replayed means (from fitness.replay.metric_weights).

    For experiment e and metric m: mean_m = w[e][m] @ step_time_us + overhead[e][m] @ theta,
    where theta are the OVERHEAD_COLUMNS values.
    """

    names: list[str]
    columns: list[dict[str, np.ndarray]]  # per experiment: primitive -> per-step values
    weights: list[dict[str, np.ndarray]]  # per experiment: metric -> per-step weights
    overhead: list[dict[str, np.ndarray]]  # per experiment: metric -> coefficients of OVERHEAD_COLUMNS
    observed: list[dict[str, float]]  # per experiment: metric -> observed mean (s)


@dataclass
class FitnessContext:
    steps: StepTable | None
    replay: ReplayRows | None = None
    replay_weight: float = 1.0  # weight of one replayed metric row against one experiment's step rows


@dataclass
class Score:
    train_error: float
    replay_error: float
    complexity: int
    terms: list[Program]
    coefficients: list[float]
    intercept: float
    overheads: dict[str, float] = field(default_factory=dict)
    objectives: dict[str, float] = field(default_factory=dict)
    per_experiment: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.train_error < WORST


def model_complexity(terms: list[Program], coefficients: list[float], intercept: float) -> int:
    """Nodes of the fitted expression: each kept term plus its coefficient and product,
    the additions joining them, and the intercept with its addition."""
    kept = [t for t, c in zip(terms, coefficients) if c > 0]
    size = sum(len(t) + 2 for t in kept) + max(len(kept) - 1, 0)
    if intercept > 0:
        size += 2 if kept else 1
    return max(size, 1)


def _worst(program: Program) -> Score:
    terms = additive_terms(program)
    return Score(WORST, WORST, len(program) + 2 * len(terms), terms, [0.0] * len(terms), 0.0)


def _ape(pred: np.ndarray, target: np.ndarray) -> np.ndarray:
    return np.abs(pred - target) / target


def score_program(program: Program, ctx: FitnessContext) -> Score:
    """Fit and score one candidate. Never raises on numeric trouble: NaN/inf -> WORST."""
    terms = additive_terms(program)
    st = ctx.steps
    blocks_a: list[np.ndarray] = []
    blocks_b: list[np.ndarray] = []
    k = len(terms)
    n_over = len(OVERHEAD_COLUMNS) if ctx.replay is not None else 0

    # --- step rows ------------------------------------------------------------
    step_X = None
    if st is not None:
        step_X = np.empty((st.n, k + 1))
        for j, t in enumerate(terms):
            step_X[:, j] = evaluate_program(t, st.columns, st.n)
        step_X[:, k] = 1.0
        if not np.isfinite(step_X).all():
            return _worst(program)
        tr = st.is_train
        counts = np.bincount(st.experiment[tr], minlength=len(st.experiment_names)).astype(float)
        # relative error, each experiment weighing the same
        w = 1.0 / (st.cycle_time_us[tr] * np.sqrt(np.maximum(counts[st.experiment[tr]], 1.0)))
        a = step_X[tr] * w[:, None]
        blocks_a.append(np.hstack([a, np.zeros((len(a), n_over))]))
        blocks_b.append(st.cycle_time_us[tr] * w)

    # --- replayed experiment rows ---------------------------------------------
    replay_rows = []
    if ctx.replay is not None:
        rp = ctx.replay
        for e in range(len(rp.names)):
            cols = rp.columns[e]
            n_e = len(next(iter(cols.values())))
            T = np.empty((n_e, k + 1))
            for j, t in enumerate(terms):
                T[:, j] = evaluate_program(t, cols, n_e)
            T[:, k] = 1.0
            if not np.isfinite(T).all():
                return _worst(program)
            for m in REPLAY_METRICS:
                obs = rp.observed[e].get(m)
                if obs is None or not np.isfinite(obs) or obs <= 0:
                    continue
                row = np.concatenate([rp.weights[e][m] @ T, rp.overhead[e][m]])
                replay_rows.append((e, m, row, obs))
        if replay_rows:
            scale = np.sqrt(ctx.replay_weight)
            blocks_a.append(np.array([r[2] / r[3] * scale for r in replay_rows]))
            blocks_b.append(np.full(len(replay_rows), scale))

    if not blocks_a:
        raise ValueError("nothing to score: no step rows and no replayed experiments")
    A = np.vstack(blocks_a)
    b = np.concatenate(blocks_b)
    if not np.isfinite(A).all():
        return _worst(program)
    norms = np.linalg.norm(A, axis=0)
    keep = norms > 1e-12
    if not keep.any():
        return _worst(program)
    try:
        sol, _ = nnls(A[:, keep] / norms[keep], b, maxiter=50 * A.shape[1])
    except (RuntimeError, ValueError):
        return _worst(program)
    theta = np.zeros(A.shape[1])
    theta[keep] = sol / norms[keep]
    coefs, intercept, over = theta[:k], float(theta[k]), theta[k + 1 :]
    complexity = model_complexity(terms, list(coefs), intercept)

    objectives: dict[str, float] = {"complexity": float(complexity)}
    per_exp: dict[str, dict[str, float]] = {}
    train_error = 0.0
    if st is not None:
        pred = step_X @ theta[: k + 1]
        if not np.isfinite(pred).all() or (pred <= 0).any():
            return _worst(program)
        ape = _ape(pred, st.cycle_time_us)
        tr_m, va_m, va_med = [], [], []
        for e, name in enumerate(st.experiment_names):
            rows = st.experiment == e
            tr_rows, va_rows = rows & st.is_train, rows & ~st.is_train
            tr_m.append(ape[tr_rows].mean() if tr_rows.any() else np.nan)
            va = ape[va_rows] if va_rows.any() else ape[tr_rows]
            va_m.append(va.mean())
            va_med.append(np.median(va))
            per_exp[name] = {"step_mape": float(va.mean()), "step_median_ape": float(np.median(va)),
                             "step_mape_train": float(tr_m[-1]), "n": int(rows.sum())}
        train_error = float(np.nanmean(tr_m))
        objectives["step_mape"] = float(np.mean(va_m))
        objectives["step_mape_max"] = float(np.max(va_m))
        objectives["step_mape_train"] = train_error

    replay_error = 0.0
    if replay_rows:
        errs: dict[str, list[float]] = {m: [] for m in REPLAY_METRICS}
        for e, m, row, obs in replay_rows:
            pred_m = float(row @ theta)
            err = pred_m / obs - 1.0
            errs[m].append(abs(err))
            per_exp.setdefault(ctx.replay.names[e], {})[f"{m}_error"] = err
        for m, v in errs.items():
            if v:
                objectives[f"{m}_error"] = float(np.mean(v))
                objectives[f"{m}_error_max"] = float(np.max(v))
        replay_error = float(np.mean([objectives[f"{m}_error"] for m in REPLAY_METRICS if errs[m]]))
        if st is None:
            train_error = replay_error
    overheads = {name: float(v) for name, v in zip(OVERHEAD_COLUMNS, over)}
    return Score(
        train_error=train_error if np.isfinite(train_error) else WORST,
        replay_error=replay_error,
        complexity=complexity,
        terms=terms,
        coefficients=[float(c) for c in coefs],
        intercept=intercept,
        overheads=overheads,
        objectives=objectives,
        per_experiment=per_exp,
    )


def score_many(programs: list[Program], ctx: FitnessContext) -> list[Score]:
    """A chunk of candidates, for one worker of the fitness pool."""
    return [score_program(p, ctx) for p in programs]


def used_primitives(program: Program) -> list[str]:
    return variables(program)
