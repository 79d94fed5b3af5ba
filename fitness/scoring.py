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

import threading
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Callable, Mapping

import numpy as np
import sympy as sp

from fitness.bounded_lsq import bounded_gram
from fitness.dataset import StepTable
from fitness.efficiency import EfficiencyBounds, Works, as_bounds, term_intervals, work_factors
from fitness.fused import ColumnMatrix, FusedTerms, step_errors
from fitness.physics_probes import PhysicsProbes
from fitness.replay_rows import REPLAY_METRICS, ReplayRows, bound_load_term
from fitness.sim.latency_model import FITTED_NON_STEP_NAMES, full_non_step_terms
from fitness.transfer import held_out_groups, linear_transfer_error
from primitives.language import Program, additive_terms, canonical, evaluate_program, program_to_sympy
from primitives.units import has_negative_part, involves_time, involves_unpriced_work, is_efficiency_term

WORST = 1e9  # the score of a candidate that produced NaN/inf or fitted nothing
# the load term's place among the fitted non-step terms (fitness.replay_rows.load_slope_identified)
LOAD_COLUMN = FITTED_NON_STEP_NAMES.index("queueing_per_running_request_us")


@dataclass
class FitnessContext:
    steps: StepTable | None
    replay: ReplayRows | None = None
    replay_weight: float = 1.0  # weight of one replayed metric row against one experiment's step rows
    efficiency_bounds: EfficiencyBounds = EfficiencyBounds()  # of a µs term's coefficient (fitness.efficiency)
    probes: PhysicsProbes | None = None  # probe steps: monotone in work, above the kernel floor
    # the fitted non-step terms this fit may use (the others stay at 0): BLIS's blackbox
    # baseline has no load term in its QueueingTime. The load term also stays at 0 where no
    # experiment is seen at two loads (fitness.replay_rows.load_slope_identified)
    fitted_non_step: tuple[str, ...] = FITTED_NON_STEP_NAMES

    def __post_init__(self):
        self.efficiency_bounds = as_bounds(self.efficiency_bounds)  # a (lower, upper) pair: no caps
        unknown = set(self.fitted_non_step) - set(FITTED_NON_STEP_NAMES)
        if unknown:
            raise ValueError(f"fitted_non_step: {sorted(unknown)} are not fitted non-step terms")


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
    transfer_error: float = 0.0  # fitness.transfer: first-order error where the constants were not fitted

    @property
    def ok(self) -> bool:
        return self.train_error < WORST


def model_complexity(term_sizes: list[int], coefficients: list[float], intercept: float) -> int:
    """Nodes of the fitted expression: each kept term plus its coefficient and product,
    the additions joining them, and the intercept with its addition."""
    kept = [n for n, c in zip(term_sizes, coefficients, strict=False) if c > 0]
    size = sum(n + 2 for n in kept) + max(len(kept) - 1, 0)
    if intercept > 0:
        size += 2 if kept else 1
    return max(size, 1)


def _worst(program: Program | None = None) -> Score:
    terms = additive_terms(program) if program is not None else []
    size = len(program) + 2 * len(terms) if program is not None else 1
    return Score(WORST, WORST, size, terms, [0.0] * len(terms), 0.0, transfer_error=WORST)


def _ape(pred: np.ndarray, target: np.ndarray) -> np.ndarray:
    return np.abs(pred - target) / target


class _StepPrep:
    """Per-context constants of the step rows, computed once rather than per candidate."""

    def __init__(self, st: StepTable):
        self.n_exp = len(st.experiment_names)
        self.train = np.flatnonzero(st.is_train)
        counts = np.bincount(st.experiment[self.train], minlength=self.n_exp).astype(float)
        # relative error, each experiment weighing the same
        self.w = 1.0 / (st.cycle_time_us[self.train] * np.sqrt(np.maximum(counts[st.experiment[self.train]], 1.0)))
        self.b = st.cycle_time_us[self.train] * self.w
        val = ~st.is_train
        # experiments without a holdout are judged on their training rows
        has_val = np.bincount(st.experiment[val], minlength=self.n_exp) > 0
        self.val_rows = val | ~has_val[st.experiment]
        self.n_train = np.maximum(counts, 1.0)
        self.n_val = np.maximum(np.bincount(st.experiment[self.val_rows], minlength=self.n_exp).astype(float), 1.0)
        self.exp_train = st.experiment[self.train]
        self.exp_val = st.experiment[self.val_rows]
        # the fused passes see the rows grouped by experiment, training rows first (a stable
        # order: each group keeps its rows' order), so that each experiment's training and
        # validation rows are contiguous; w^2 and w * b on every row are 0 off the training set
        in_train = np.zeros(st.n, dtype=bool)
        in_train[self.train] = True
        self.order = np.lexsort((~in_train, st.experiment))
        sorted_exp = st.experiment[self.order]
        starts = np.searchsorted(sorted_exp, np.arange(self.n_exp + 1))
        n_train_rows = np.bincount(st.experiment[self.train], minlength=self.n_exp)
        self.train_rows = np.stack([starts[:-1], starts[:-1] + n_train_rows], axis=1).astype(np.int64)
        self.val_rows_sorted = np.where(  # an experiment without a holdout is judged on its training rows
            has_val[:, None], np.stack([self.train_rows[:, 1], starts[1:]], axis=1), self.train_rows
        ).astype(np.int64)
        w_rows = np.zeros(st.n)
        w_rows[self.train] = self.w
        self.w2 = (w_rows**2)[self.order]
        self.wb = (w_rows**2 * st.cycle_time_us)[self.order]
        self.w2_sum, self.wb_sum = float(self.w2.sum()), float(self.wb.sum())
        self.target = np.ascontiguousarray(st.cycle_time_us[self.order], dtype=np.float64)
        self.sorted_experiment = sorted_exp
        self.sorted_val = self.val_rows[self.order]
        self.columns = ColumnMatrix({k: np.asarray(v)[self.order] for k, v in st.columns.items()}, st.n)
        self._scratch = threading.local()  # per thread: a Dask worker may score in several

    def design_buffer(self, k: int) -> np.ndarray:
        """(k, n) scratch for one candidate's terms, reused: a fresh one costs page faults."""
        buf = getattr(self._scratch, "design", None)
        if buf is None or len(buf) < k:
            buf = self._scratch.design = np.empty((k, len(self.target)))
        return buf[:k]


# the step table last prepared, and its preparation: the table is held so that its id cannot
# pass to another table (refits on subsets make and drop many) while its preparation is kept
_PREP: dict[int, tuple[StepTable, _StepPrep]] = {}


def _prep(st: StepTable) -> _StepPrep:
    key = id(st)
    if key not in _PREP or _PREP[key][0] is not st:
        _PREP.clear()  # one context per process at a time
        _PREP[key] = (st, _StepPrep(st))
    return _PREP[key][1]


TermFn = Callable[[Mapping[str, np.ndarray], int], np.ndarray]


class NumpyTerms:
    """Terms as functions of the columns, one numpy array per node: archived expressions,
    and the plain way the benchmark compares the fused evaluator (``FusedTerms``) with."""

    def __init__(self, fns: list[TermFn]):
        self.fns = fns
        self.k = len(fns)

    def design(self, columns: Mapping[str, np.ndarray], n: int) -> np.ndarray:
        """(n, k + 1): each term on the rows, then the intercept's column of ones."""
        X = np.empty((self.k + 1, n))
        for j, t in enumerate(self.fns):
            X[j] = t(columns, n)
        X[-1] = 1.0
        return X.T

    def normal_equations(self, st: StepTable, prep: _StepPrep) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """As ``_step_normal``: the design matrix, then its products."""
        X = self.design(st.columns, st.n)
        if not np.isfinite(X).all():
            return None
        a = X[prep.train] * prep.w[:, None]
        return X.T[: self.k], a.T @ a, a.T @ prep.b

    @staticmethod
    def step_errors(X: np.ndarray, theta: np.ndarray, st: StepTable, prep: _StepPrep):
        """As ``_step_errors``, with one prediction array and ``np.bincount``."""
        pred = X.T @ theta[:-1] + theta[-1]
        if not np.isfinite(pred).all() or (pred <= 0).any():
            return None
        ape = _ape(pred, st.cycle_time_us)
        tr = np.bincount(prep.exp_train, weights=ape[prep.train], minlength=prep.n_exp)
        va = np.bincount(prep.exp_val, weights=ape[prep.val_rows], minlength=prep.n_exp)
        return tr, va, ape, st.experiment, prep.val_rows


def _step_errors(terms, X: np.ndarray, theta: np.ndarray, st: StepTable, prep: _StepPrep, detail: bool):
    """Sums of the relative error per experiment over the training and the validation rows,
    and (``detail``) each row's error with the rows' experiments and validation flags, in
    the order of X; None if a prediction is not finite or not > 0."""
    if isinstance(terms, NumpyTerms):
        return terms.step_errors(X, theta, st, prep)
    sums = step_errors(X, theta, prep.target, prep.train_rows, prep.val_rows_sorted)
    if sums is None:
        return None
    ape = _ape(X.T @ theta[:-1] + theta[-1], prep.target) if detail else None
    return sums[0], sums[1], ape, prep.sorted_experiment, prep.sorted_val


def _step_normal(terms, st: StepTable, prep: _StepPrep) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The terms on the step rows (k, n), and the normal equations G = A^T A, h = A^T b of the
    weighted training rows with the intercept last; None where a value is not finite (a
    non-finite value on a validation row shows up later, in the prediction)."""
    if isinstance(terms, NumpyTerms):
        return terms.normal_equations(st, prep)
    X = prep.design_buffer(terms.k)
    G, h = terms.normal_equations(prep.columns, prep.w2, prep.wb, X, prep.w2_sum, prep.wb_sum)
    return (X, G, h) if np.isfinite(G).all() and np.isfinite(h).all() else None


def score_program(program: Program, ctx: FitnessContext, detail: bool = False, fused: bool = True) -> Score:
    """Fit and score one candidate. Never raises on numeric trouble: NaN/inf -> WORST.

    ``detail`` adds per-experiment medians (for the archive), which the search skips.
    ``fused=False`` evaluates the plain way, one numpy array per node (the benchmark's reference).
    """
    terms = additive_terms(program)
    keys = [canonical(t) for t in terms]
    physics = [_term_physics(key, t) for key, t in zip(keys, terms, strict=True)]
    if any(p is None for p in physics):  # a negative time or count, a mixed time, unpriced work (term_kind)
        return _worst(program)
    works = [_term_works(key, t) if p else False for key, t, p in zip(keys, terms, physics, strict=True)]
    bounds = term_intervals(works, ctx.efficiency_bounds)
    if bounds is None:  # a primitive priced in two terms, or a term no coefficient keeps inside its bounds
        return _worst(program)
    evaluator = FusedTerms(terms) if fused else [partial(_program_term, t) for t in terms]
    score = fit_terms(evaluator, ctx, detail, [len(t) for t in terms], bounds)
    if not score.ok:
        return _worst(program)
    score.terms = terms
    return score


@lru_cache(maxsize=65536)
def _term_physics(key: str, term: Program) -> bool | None:
    """``term_physics`` of a candidate's term (memoised by its canonical form)."""
    return term_physics(program_to_sympy(term))


@lru_cache(maxsize=65536)
def _term_works(key: str, term: Program) -> Works | None:
    """``work_factors`` of a candidate's term (memoised by its canonical form)."""
    return work_factors(program_to_sympy(term))


def term_kind(expr: sp.Expr) -> str:
    """``efficiency`` (a time in µs: its coefficient is an efficiency factor), ``count`` (no
    time in it: µs per request, layer, ...), ``negative time`` (a time term with a negative
    part: ``a - b`` of two times is a negative efficiency on b), ``mixed time`` (a time
    combined with counts into something that is not a time, e.g. ``kv_io_time_us -
    num_prefill_reqs`` or ``gemm_time_us*tp``: its coefficient has no physical meaning, and
    as a count it would escape the efficiency bounds) or ``unpriced work`` (a count of KV
    tokens or attention pairs: what that work costs depends on the model and GPU, so it
    enters only through the µs primitive that prices it, e.g. ``kv_io_time_us``; as a count
    its µs-per-token would be one price for every model, fitted without bounds) or ``negative
    count`` (a count with a negative part in its form, ``has_negative_part``: in ``2121.7*tp
    - 15.9*allreduce_calls`` an all-reduce saves time; ``tp - 1``, fitted, may leave a
    negative intercept)."""
    if not is_efficiency_term(expr):
        if involves_time(expr):
            return "mixed time"
        if involves_unpriced_work(expr):
            return "unpriced work"
        return "negative count" if has_negative_part(expr) else "count"
    for part in sp.Add.make_args(sp.expand(expr)):
        coef, rest = part.as_coeff_Mul()
        if coef < 0 and (rest == 1 or is_efficiency_term(rest)):  # ``gemm_time_us - 27.7``: -27.7 µs
            return "negative time"
    return "efficiency"


def term_physics(expr: sp.Expr) -> bool | None:
    """True for an efficiency term, False for a count term, None for a term that scores worst
    (a negative time or count, a mixed time, unpriced work: ``term_kind``)."""
    return {"efficiency": True, "count": False}.get(term_kind(expr))


def sympy_term_intervals(terms: list[sp.Expr], bounds: EfficiencyBounds) -> list[tuple[float, float] | None] | None:
    """``term_intervals`` of an expression's terms (sympy; an archived model's, to refit it)."""
    return term_intervals([work_factors(t) if term_physics(t) else False for t in terms], bounds)


def _program_term(term: Program, columns: Mapping[str, np.ndarray], n: int) -> np.ndarray:
    return evaluate_program(term, columns, n)


def fit_terms(
    term_fns: list[TermFn] | FusedTerms,
    ctx: FitnessContext,
    detail: bool = False,
    term_sizes: list[int] | None = None,
    efficiency_terms: list[tuple[float, float] | None] | None = None,
) -> Score:
    """Fit ``intercept + sum(coef_i * term_i)`` and measure its errors.

    Each term is a function of primitive columns (leave-one-model-out passes the terms
    of an archived expression), or the search's evolved terms compiled (``FusedTerms``).
    Coefficients are >= 0; an efficiency term's (a time in µs) lies inside its interval
    ``efficiency_terms[i]`` (``fitness.efficiency.term_intervals``: the bounds of each µs
    primitive it prices, over the factor it puts on it; None for a count). The fitted
    non-step terms are >= 0, the load term 0 where no experiment's rows see two loads
    (``fitness.replay_rows.load_slope_identified``).
    A fit that fails ``ctx.probes`` (not monotone in work, or faster than the measured
    kernels allow) scores worst.
    """
    terms = term_fns if isinstance(term_fns, FusedTerms) else NumpyTerms(list(term_fns))
    st = ctx.steps
    k = terms.k
    n_over = len(FITTED_NON_STEP_NAMES) if ctx.replay is not None else 0
    G = np.zeros((k + 1 + n_over, k + 1 + n_over))
    h = np.zeros(k + 1 + n_over)

    # --- step rows: normal equations ----------------------------------------------
    step_X = None
    if st is not None:
        prep = _prep(st)
        step = _step_normal(terms, st, prep)
        if step is None:
            return _worst()
        step_X, G[: k + 1, : k + 1], h[: k + 1] = step

    # --- replayed experiment rows ---------------------------------------------
    replay_rows = []
    if ctx.replay is not None:
        rp = ctx.replay
        for e in range(len(rp.names)):
            obs = rp.observed_us[e]
            if not np.isfinite(obs).any():
                continue
            cols = rp.columns[e]
            T = terms.design(cols, rp.weights[e].shape[1])
            if not np.isfinite(T).all():
                return _worst()
            rows = np.hstack([rp.weights[e] @ T, rp.overhead[e]])
            for i, (m, scope) in enumerate(rp.labels[e]):
                if np.isfinite(obs[i]) and obs[i] > 0:
                    replay_rows.append((e, m, scope, rows[i], obs[i], rp.fixed_us[e][i]))
        if replay_rows:
            # relative rows: rel_a @ theta - rel_b is a row's signed relative error
            rel_a = np.array([r[3] / r[4] for r in replay_rows])
            rel_b = np.array([(r[4] - r[5]) / r[4] for r in replay_rows])
            scale = np.sqrt(ctx.replay_weight)
            a, b = rel_a * scale, rel_b * scale
            if not np.isfinite(a).all():
                return _worst()
            G += a.T @ a
            h += a.T @ b

    if st is None and not replay_rows:
        raise ValueError("nothing to score: no step rows and no replayed experiments")
    lower, upper = np.zeros(len(G)), np.full(len(G), np.inf)
    for j, interval in enumerate(efficiency_terms or [None] * k):
        if interval is not None:
            lower[j], upper[j] = interval
    for j, name in enumerate(FITTED_NON_STEP_NAMES[:n_over]):
        if name not in ctx.fitted_non_step:
            upper[k + 1 + j] = 0.0
    if replay_rows:  # the load term only where one experiment is seen at two loads
        replay_experiment = np.array([r[0] for r in replay_rows])
        row_running = np.array([r[3][k + 1 + LOAD_COLUMN] for r in replay_rows])
        upper = bound_load_term(upper, replay_experiment, row_running, k + 1 + LOAD_COLUMN)
    theta = bounded_gram(G, h, lower, upper)
    if theta is None:
        return _worst()
    coefs, intercept, over = theta[:k], float(theta[k]), theta[k + 1 :]
    probes = ctx.replay.probes if ctx.replay is not None else None
    if probes is not None and not _positive_on(probes, terms, theta[: k + 1]):
        return _worst()
    if ctx.probes is not None and not ctx.probes.holds(lambda cols, n: terms.design(cols, n) @ theta[: k + 1]):
        return _worst()
    complexity = model_complexity(term_sizes or [1] * k, list(coefs), intercept)

    objectives: dict[str, float] = {"complexity": float(complexity)}
    per_exp: dict[str, dict[str, float]] = {}
    train_error = 0.0
    if st is not None:
        sums = _step_errors(terms, step_X, theta[: k + 1], st, prep, detail)
        if sums is None:  # a prediction not finite or not > 0
            return _worst()
        tr_m, va_m = sums[0] / prep.n_train, sums[1] / prep.n_val
        ape, step_experiment, row_val = sums[2:]
        train_error = float(tr_m.mean())
        objectives["step_mape"] = float(va_m.mean())
        objectives["step_mape_max"] = float(va_m.max())
        objectives["step_mape_train"] = train_error
        for e, name in enumerate(st.experiment_names):
            per_exp[name] = {"step_mape": float(va_m[e]), "step_mape_train": float(tr_m[e])}
            if detail:
                rows = step_experiment == e
                per_exp[name]["step_median_ape"] = float(np.median(ape[rows & row_val]))
                per_exp[name]["n"] = int(rows.sum())

    replay_error = transfer_error = 0.0
    if replay_rows:
        errs: dict[str, list[float]] = {m: [] for m in REPLAY_METRICS}
        all_errs = []
        for e, m, scope, row, obs, fixed in replay_rows:
            err = (float(row @ theta) + fixed) / obs - 1.0
            all_errs.append(abs(err))
            if scope == "all":
                errs[m].append(err)
                per_exp.setdefault(ctx.replay.names[e], {})[f"{m}_error"] = err
        for m, (mean, worst, _) in error_stats(errs).items():
            objectives[f"{m}_error"] = mean
            objectives[f"{m}_error_max"] = worst
        # the search minimises the error over every replayed row, stage rows included:
        # they say how latency grows with load, which decides closed-loop stability
        replay_error = float(np.mean(all_errs))
        objectives["replay_error"] = replay_error
        if st is None:
            train_error = replay_error
        transfer = _transfer_error(
            rel_a, rel_b, replay_rows, replay_experiment, ctx.replay, lower, upper, (row_running, k + 1 + LOAD_COLUMN)
        )
        if transfer is not None:
            objectives["transfer_error_linear"] = transfer_error = transfer
    # with replayed experiments every non-step term is stored, those not fitted at 0 (docs/HOW_IT_WORKS.md:
    # "Non-step terms" says why they cannot be told apart or fitted from these data)
    overheads: dict[str, float] = {}
    if n_over:
        fitted = {name: float(v) for name, v in zip(FITTED_NON_STEP_NAMES, over, strict=True)}
        overheads = full_non_step_terms(fitted)
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
        transfer_error=transfer_error,
    )


def _transfer_error(
    rel_a: np.ndarray,
    rel_b: np.ndarray,
    replay_rows: list,
    row_experiment: np.ndarray,
    rp: ReplayRows,
    lower: np.ndarray,
    upper: np.ndarray,
    load: tuple[np.ndarray, int],
) -> float | None:
    """``fitness.transfer.linear_transfer_error`` of the fitted replay rows (relative: ``rel_a``,
    ``rel_b``); ``load``: each row's running count at sending and the load term's column."""
    groups = _groups(tuple(rp.names), tuple(rp.models))
    if not groups:
        return None
    whole_run = np.array([r[2] == "all" for r in replay_rows])
    metric = [r[1] for r in replay_rows]
    return linear_transfer_error(rel_a, rel_b, row_experiment, metric, whole_run, lower, upper, groups, load)


@lru_cache(maxsize=16)
def _groups(names: tuple[str, ...], models: tuple[str, ...]) -> list[list[int]]:
    return held_out_groups(list(names), list(models))


def error_stats(errors: Mapping[str, list[float | None]]) -> dict[str, tuple[float, float, int]]:
    """Mean and max of the absolute relative errors of each metric, and how many there are.

    ``errors`` maps a metric to its signed relative errors over experiments (None: no
    result to compare with); a metric without any error is left out.
    """
    out: dict[str, tuple[float, float, int]] = {}
    for m, values in errors.items():
        v = [abs(e) for e in values if e is not None]
        if v:
            out[m] = (float(np.mean(v)), float(np.max(v)), len(v))
    return out


def _positive_on(probes: list[dict[str, np.ndarray]], terms, theta: np.ndarray) -> bool:
    """Whether the fitted step time is finite and > 0 on every probe step (no reliance on the floor)."""
    for cols in probes:
        n = len(next(iter(cols.values()))) if cols else 0
        if n == 0:
            continue
        pred = terms.design(cols, n) @ theta
        if not (np.isfinite(pred).all() and (pred > 0).all()):
            return False
    return True


def score_many(programs: list[Program], ctx: FitnessContext) -> list[Score]:
    """A chunk of candidates, for one worker of the fitness pool."""
    return [score_program(p, ctx) for p in programs]
