"""Closed-loop validation of a model: simulate experiments end to end, compare with what was observed.

Every experiment is simulated with the model's step time and non-step terms
(``fitness.sim.engine``); experiments whose results are withheld are simulated too,
with their observed fields left null. The expression of an archived model can also be
split into its additive terms (``split_terms``, ``SympyTerm``) for a refit of its
constants on chosen replay rows (``refit``; ``evolve.validation``: leave one model or
workload out, stage transfer).

Each item compares the whole run and, under ``stages``, every load stage (the simulator's
requests split by stage against ``results/stage_<N>_lifecycle_metrics.json``). Failures
are a metric too: ``failure_fraction_*`` is failed over all requests (predicted: the
simulator's client-side failures, i.e. timeouts and never-runnable requests; observed:
``failures.count`` over successes plus failures), and the summaries give the absolute
difference in percentage points.

Tails too: for E2E, TTFT, ITL and TPOT, the mean and the percentiles of ``REPORT_STATS``
(``<metric>_<stat>_pred_s``, ``_obs_s``, ``_error``), over the successful requests as the
load generator computes them (``fitness.sim.loadgen.client_distributions``), and every
percentile of both under ``percentiles_s`` (the curves of the report).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import sympy as sp
from joblib import Parallel, delayed

from fitness.efficiency import DEFAULT_EFFICIENCY_BOUNDS, as_bounds
from fitness.replay_rows import REPLAY_METRICS, ReplayRows
from fitness.scoring import FitnessContext, error_stats, fit_terms, sympy_term_intervals
from fitness.sim.engine import simulate
from fitness.sim.latency_model import FITTED_NON_STEP_NAMES
from fitness.sim.loadgen import no_success_reason
from fitness.sim.models import ExpressionLatencyModel
from fitness.step_scatter import StepScatter, step_scales
from primitives.data.experiments import LATENCY_FILE_KEYS, ExperimentSpec
from primitives.deployment import DeploymentResolver
from primitives.language import evaluate_expr, parse_infix, to_infix

LATENCY_METRICS = tuple(LATENCY_FILE_KEYS)  # e2e, ttft, itl, tpot
REPORT_STATS = ("mean", "p50", "p90", "p99")
TAIL_STATS = REPORT_STATS[1:]


def default_jobs() -> int:
    return max(1, min(2, os.cpu_count() or 1))


def parallel_map(fn, tasks: list[tuple], jobs: int) -> list:
    """``fn(*task)`` of every task, in order: in loky worker processes when there is more
    than one job and one task, else in this process (no pool to start for one run)."""
    if jobs > 1 and len(tasks) > 1:
        return Parallel(n_jobs=jobs, backend="loky")(delayed(fn)(*t) for t in tasks)
    return [fn(*t) for t in tasks]


@dataclass(frozen=True)
class ClosedLoopSettings:
    """How every closed-loop simulation of a check or a recording is made: ``load_draws`` draws
    of each load (its seeds ``seed``, ``seed + 1``, ...; compared or fitted by their mean), each
    step scattered as ``scatter`` where given, on ``jobs`` worker processes (None: the default)."""

    seed: int = 0
    load_draws: int = 1
    scatter: StepScatter | None = None
    jobs: int | None = None

    @property
    def seeds(self) -> list[int]:
        return list(range(self.seed, self.seed + max(1, self.load_draws)))

    @property
    def seed_range(self) -> str:
        """The seeds as people read them: '0-4' (one home for what the terminal and report say)."""
        return f"{self.seeds[0]}-{self.seeds[-1]}"


ONE_DRAW = ClosedLoopSettings()  # the default: the load's seed 0, no scatter


def per_draw(fn, runs: list[tuple], settings: ClosedLoopSettings, *after) -> tuple[list[int], list[list]]:
    """``fn(*run, draw_seed, *after)`` for every run and each of the settings' draws of the
    load, in parallel: the seeds, and per run its results in seed order."""
    seeds = settings.seeds
    done = parallel_map(fn, [(*run, k, *after) for run in runs for k in seeds], settings.jobs or default_jobs())
    n = len(seeds)
    return seeds, [done[i * n : (i + 1) * n] for i in range(len(runs))]


def failure_fraction(metrics) -> float | None:
    """Failed requests over all requests of lifecycle metrics (None without any request)."""
    if metrics is None:
        return None
    total = metrics.successes + metrics.failures
    return metrics.failures / total if total else None


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def compare(preds: list, obs) -> dict:
    """Predicted against observed lifecycle metrics (whole run or one stage): means and
    percentiles, signed errors, failures.

    ``preds`` holds one simulation's metrics per draw of the load (``closed_loop_runs``);
    each predicted figure is their mean, and with more than one, ``<metric>_<stat>_pred_min_s``
    and ``_pred_max_s`` give their range: where the server saturates, one draw of arrivals
    can put a tail percentile tens of percent away from another; ``_obs_in_range`` says
    whether the observation (one draw too) lies inside it. A draw that served no
    request has no latency to average: the errors are then the worst score, as for one
    draw, and ``no_success_draws`` counts such draws.
    """
    preds = [p for p in preds if p is not None]
    no_success_draws = sum(p.successes == 0 for p in preds)
    out: dict = {}
    for m in LATENCY_METRICS:
        for stat in REPORT_STATS:
            values = [v for v in (p.stat_s(m, stat) for p in preds) if v is not None]
            p, o = _mean(values), (obs.stat_s(m, stat) if obs is not None else None)
            out[f"{m}_{stat}_pred_s"] = p
            out[f"{m}_{stat}_obs_s"] = o
            out[f"{m}_{stat}_error"] = (p / o - 1.0) if (p is not None and o) else None
            if o and no_success_draws:
                out[f"{m}_{stat}_error"] = float("inf")  # served nothing of what was served: the worst score
            if len(preds) > 1:
                low, high = (min(values), max(values)) if values else (None, None)
                out[f"{m}_{stat}_pred_min_s"], out[f"{m}_{stat}_pred_max_s"] = low, high
                # inside the draws' range, a miss is as large as the load's own randomness makes it
                out[f"{m}_{stat}_obs_in_range"] = bool(low <= o <= high) if (o and values) else None
        if m in REPLAY_METRICS:
            out[f"{m}_error"] = out[f"{m}_mean_error"]  # the mean's error, under its first name
    out["percentiles_s"] = {
        m: {"pred": _mean_curve([p.distributions.get(m, {}) for p in preds]), "obs": _curve(obs, m)}
        for m in LATENCY_METRICS
    }
    out["successes_pred"] = int(round(float(np.mean([p.successes for p in preds])))) if preds else None
    out["failures_pred"] = int(round(float(np.mean([p.failures for p in preds])))) if preds else None
    if len(preds) > 1:
        out["no_success_draws"] = int(no_success_draws)
    out["failures_obs"] = int(obs.failures) if obs is not None else None
    out["failure_fraction_pred"] = _mean([f for f in map(failure_fraction, preds) if f is not None])
    out["failure_fraction_obs"] = failure_fraction(obs)
    return out


def _curve(metrics, m: str) -> dict:
    return dict(metrics.distributions.get(m, {})) if metrics is not None else {}


def _mean_curve(curves: list[dict]) -> dict:
    """Each percentile's mean over the curves that have it (all of them, or none, in practice)."""
    keys = [k for k in curves[0] if all(k in c for c in curves)] if curves else []
    return {k: float(np.mean([c[k] for c in curves])) for k in keys}


def simulate_outcome(
    spec: ExperimentSpec,
    deployment,
    expression: str,
    overheads: dict,
    seed: int,
    tails: bool,
    scatter: StepScatter | None = None,
):
    """(client metrics, preemptions) of one simulation of an experiment with a model.

    ``tails``: the percentiles too (the simulation logs every token: ~20% slower).
    ``scatter``: the steps scatter around the model's times as measured (drawn with SEED).
    """
    model = ExpressionLatencyModel(expression, deployment, overheads)
    scales = step_scales(scatter, seed)
    result = simulate(spec, deployment, model, seed=seed, record=False, distributions=tails, step_scales=scales)
    return result.metrics, int(result.total_preemptions)


def outcome_item(spec: ExperimentSpec, deployment, outcomes: list, seeds: list[int] | None = None) -> dict:
    """The validation item of an experiment from its simulations (one per draw of the load):
    predicted against observed (signed errors), per stage too. Without percentiles in the
    simulations (``tails``), the ``<metric>_<stat>`` fields of the percentiles are null."""
    preds, obs = [m for m, _ in outcomes], spec.observed
    item: dict = {"name": spec.name, "model": deployment.model.name, "workload": spec.workload}
    item.update(compare([p.summary for p in preds], obs.summary if obs is not None else None))
    item["preemptions_pred"] = int(round(float(np.mean([n for _, n in outcomes]))))
    if seeds is not None and len(seeds) > 1:
        item["load_seeds"] = list(seeds)
    if all(p.summary.successes == 0 for p in preds):  # a finding, not a crash: say which limit made it so
        reason = no_success_reason(spec, deployment)
        item["no_success"] = reason[1] if reason else f"every request timed out ({spec.request_timeout_s:g} s)"
    item["stages"] = [
        {
            "stage": i,
            "rate_per_s": rate,
            **compare(
                [p.stages[i] for p in preds],  # every draw has the spec's stages
                obs.stages[i] if obs is not None and i < len(obs.stages) else None,
            ),
        }
        for i, (rate, _) in enumerate(spec.stages)
    ]
    return item


def same_model(specs: list[ExperimentSpec], expression: str, overheads: dict) -> list[tuple[ExperimentSpec, str, dict]]:
    """The runs of :func:`closed_loop_runs` that simulate every experiment with one model."""
    return [(s, expression, overheads) for s in specs]


def closed_loop_runs(
    runs: list[tuple[ExperimentSpec, str, dict]],
    resolver: DeploymentResolver,
    settings: ClosedLoopSettings = ONE_DRAW,
    tails: bool = True,
) -> list[dict]:
    """:func:`outcome_item` of every (experiment, expression, overheads), simulated in parallel
    with the settings' draws of the load generator's randomness (arrival times and re-tokenised
    prompt lengths) and step scatter; ``tails``: percentiles too."""
    runs = [(s, resolver.resolve_experiment(s), e, o) for s, e, o in runs]
    seeds, outcomes = per_draw(simulate_outcome, runs, settings, tails, settings.scatter)
    return [outcome_item(run[0], run[1], got, seeds) for run, got in zip(runs, outcomes, strict=True)]


def every_request_failed(item: dict) -> bool:
    """Whether an item's real run has results in which every request failed (no latency)."""
    return bool(item.get("failures_obs")) and item.get("e2e_mean_obs_s") is None


def summarise(items: list[dict]) -> dict:
    """Mean and max absolute error of each metric (means, and the tails: ``e2e_p99_error_max``)
    over the items with results, and of the failure fraction's difference in percentage points.
    With several draws of the load, ``obs_in_range`` counts, per ``<metric>_<stat>``, the
    observations that lie inside the draws' range, out of those compared."""
    out: dict = {"experiments": len(items), "with_results": sum(i.get("failures_obs") is not None for i in items)}
    served_none = sum(map(every_request_failed, items))
    if served_none:  # results, but no latency to compare: only the failure fraction is scored
        out["all_failed"] = served_none
    for m, (mean, worst, _) in error_stats({m: [i.get(f"{m}_error") for i in items] for m in REPLAY_METRICS}).items():
        out[f"{m}_error_mean"] = mean
        out[f"{m}_error_max"] = worst
    tails = {f"{m}_{stat}": [i.get(f"{m}_{stat}_error") for i in items] for m in LATENCY_METRICS for stat in TAIL_STATS}
    for key, (mean, worst, _) in error_stats(tails).items():
        out[f"{key}_error_mean"] = mean
        out[f"{key}_error_max"] = worst
    diffs = [
        100.0 * abs(i["failure_fraction_pred"] - i["failure_fraction_obs"])
        for i in items
        if i.get("failure_fraction_pred") is not None and i.get("failure_fraction_obs") is not None
    ]
    in_range = {}  # with several draws: [observations inside the draws' range, observations]
    for m in LATENCY_METRICS:
        for stat in REPORT_STATS:
            inside = [i[f"{m}_{stat}_obs_in_range"] for i in items if i.get(f"{m}_{stat}_obs_in_range") is not None]
            if inside:
                in_range[f"{m}_{stat}"] = [int(sum(inside)), len(inside)]
    if in_range:
        out["obs_in_range"] = in_range
    out["failure_fraction_diff_pp_mean"] = float(np.mean(diffs)) if diffs else None
    out["failure_fraction_diff_pp_max"] = float(np.max(diffs)) if diffs else None
    return out


def refit(
    terms: list[sp.Expr],
    rows: ReplayRows,
    keep,
    bounds=DEFAULT_EFFICIENCY_BOUNDS,
    fitted_non_step: tuple[str, ...] = FITTED_NON_STEP_NAMES,
) -> tuple[str, dict] | None:
    """Refit ``intercept + sum(coef * term)`` and the fitted overheads on some replay rows only.

    ``keep(e, label)`` says whether row ``label = (metric, scope)`` of experiment ``e`` of
    ``rows`` enters the fit (the others count as unobserved; experiments left without a
    row are dropped). ``fitted_non_step``: the non-step terms it may fit (the others stay
    at 0; the load term too where the kept rows see no experiment at two loads,
    ``fitness.replay_rows.load_slope_identified``). Returns the refitted expression (infix)
    and overheads, or None when nothing is left to fit or the least squares fails.
    """
    observed, kept = [], []
    for e, labels in enumerate(rows.labels):
        mask = np.array([bool(keep(e, lab)) for lab in labels], dtype=bool)
        obs = np.where(mask, rows.observed_us[e], np.nan)
        if np.isfinite(obs).any():
            observed.append(obs)
            kept.append(e)
    if not kept:
        return None
    sub = rows.subset(kept)
    sub.observed_us = observed
    bounds = as_bounds(bounds)
    fitted = refit_terms(terms, FitnessContext(None, sub, efficiency_bounds=bounds, fitted_non_step=fitted_non_step))
    return None if fitted is None else (to_infix(fitted[0]), fitted[1])


def refit_terms(terms: list[sp.Expr], ctx: FitnessContext) -> tuple[sp.Expr, dict] | None:
    """``intercept + sum(coef * term)`` fitted on CTX's rows (step rows, replay rows or both)
    as the search fits a candidate, its efficiency terms in ``ctx.efficiency_bounds`` (the
    search's bounds and caps hold in refits too), and the fitted overheads; None where the
    terms have no intervals (``fitness.efficiency.term_intervals``: a µs primitive in two of
    them, a term no factor describes) or the least squares fails."""
    efficiency = sympy_term_intervals(terms, ctx.efficiency_bounds)
    if efficiency is None:
        return None
    score = fit_terms([SympyTerm(t) for t in terms], ctx, efficiency_terms=efficiency)
    if not score.ok:
        return None
    expr = sp.Float(score.intercept) + sum(
        (sp.Float(c) * t for c, t in zip(score.coefficients, terms, strict=True)), sp.Integer(0)
    )
    return expr, dict(score.overheads)


def split_terms(expr: sp.Expr) -> tuple[float, list[sp.Expr], list[float]]:
    """intercept, terms and coefficients of ``intercept + sum(coef * term)``."""
    intercept = 0.0
    terms: list[sp.Expr] = []
    coefs: list[float] = []
    for arg in sp.Add.make_args(expr):
        c, t = arg.as_coeff_Mul()
        if t == 1:
            intercept += float(c)
        else:
            terms.append(t)
            coefs.append(float(c))
    return intercept, terms, coefs


class SympyTerm:
    """A term of an archived expression as a picklable column function."""

    def __init__(self, expr: sp.Expr):
        self.text = to_infix(expr)

    def __call__(self, columns, n: int) -> np.ndarray:
        return evaluate_expr(parse_infix(self.text), columns, n)
