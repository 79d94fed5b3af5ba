"""Closed-loop validation of a model: simulate experiments end to end, compare with what was observed.

Every experiment is simulated with the model's step time and non-step terms
(``fitness.sim.engine``); experiments whose results are withheld are simulated too,
with their observed fields left null. The expression of an archived model can also be
split into its additive terms (``split_terms``, ``SympyTerm``) for a refit of its
constants (``evolve.validation``: leave one model out).
"""

from __future__ import annotations

import os

import numpy as np
import sympy as sp
from joblib import Parallel, delayed

from fitness.replay_rows import OBSERVED_FIELDS, REPLAY_METRICS
from fitness.scoring import error_stats
from fitness.sim.engine import simulate
from fitness.sim.models import ExpressionLatencyModel
from primitives.data.experiments import ExperimentSpec
from primitives.deployment import DeploymentResolver
from primitives.language import evaluate_expr, parse_infix, to_infix


def default_jobs() -> int:
    return max(1, min(2, os.cpu_count() or 1))


def closed_loop_item(spec: ExperimentSpec, deployment, expression: str, overheads: dict, seed: int = 0) -> dict:
    """One experiment simulated with a model; predicted against observed (signed errors)."""
    model = ExpressionLatencyModel(expression, deployment, overheads)
    result = simulate(spec, deployment, model, seed=seed, record=False)
    pred = result.metrics.summary
    obs = spec.observed.summary if spec.observed is not None else None
    item: dict = {"name": spec.name, "model": deployment.model.name, "workload": spec.workload}
    for m in REPLAY_METRICS:
        p = getattr(pred, OBSERVED_FIELDS[m])
        o = getattr(obs, OBSERVED_FIELDS[m]) if obs is not None else None
        item[f"{m}_mean_pred_s"] = p
        item[f"{m}_mean_obs_s"] = o
        item[f"{m}_error"] = (p / o - 1.0) if (p is not None and o) else None
    item["successes_pred"] = int(pred.successes)
    item["failures_pred"] = int(pred.failures)
    item["failures_obs"] = int(obs.failures) if obs is not None else None
    item["preemptions_pred"] = int(result.total_preemptions)
    return item


def closed_loop_items(
    specs: list[ExperimentSpec],
    resolver: DeploymentResolver,
    expression: str,
    overheads: dict,
    seed: int = 0,
    jobs: int | None = None,
) -> list[dict]:
    deps = [resolver.resolve(s.model, s.tp) for s in specs]
    jobs = jobs or default_jobs()
    if jobs > 1 and len(specs) > 1:
        return Parallel(n_jobs=jobs, backend="loky")(
            delayed(closed_loop_item)(s, d, expression, overheads, seed) for s, d in zip(specs, deps, strict=True)
        )
    return [closed_loop_item(s, d, expression, overheads, seed) for s, d in zip(specs, deps, strict=True)]


def summarise(items: list[dict]) -> dict:
    """Mean and max absolute error of each metric over the experiments with results."""
    out: dict = {"experiments": len(items), "with_results": 0}
    for m, (mean, worst, n) in error_stats({m: [i.get(f"{m}_error") for i in items] for m in REPLAY_METRICS}).items():
        out["with_results"] = n
        out[f"{m}_error_mean"] = mean
        out[f"{m}_error_max"] = worst
    return out


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
        return evaluate_expr(parse_infix(self.text), columns)
