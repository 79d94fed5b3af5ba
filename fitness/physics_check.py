"""Is a fitted model physics? Its efficiencies, their bounds, and monotonicity in work.

``archive show`` and the results tables read these: each term of the expression is an
efficiency term (a time in µs; its coefficient says how much slower than the ideal or
measured-kernel time the work runs), a count term (µs per request, per layer, ...), a
negative time or count (a part with a negative coefficient, which no physical cost has), a
mixed time (a time combined with counts) or unpriced work (a count of KV tokens or attention
pairs; ``fitness.scoring.term_kind``).
"""

from __future__ import annotations

import math

import numpy as np
import sympy as sp

from fitness.efficiency import DEFAULT_EFFICIENCY_BOUNDS, as_bounds, work_factors
from fitness.physics_probes import PhysicsProbes, monotone
from fitness.scoring import term_kind
from fitness.validate import split_terms
from primitives.deployment import Deployment
from primitives.language import evaluate_expr, parse_infix, to_infix


def term_efficiencies(expression: str, bounds=DEFAULT_EFFICIENCY_BOUNDS) -> list[dict]:
    """One row per additive term: its coefficient, kind, interval (``lower``, ``upper``: an
    efficiency's, with any cap and floor), which bound it sits on (if any) and whether it lies
    outside them."""
    bounds = as_bounds(bounds)
    intercept, terms, coefs = split_terms(parse_infix(expression))
    rows = []
    if intercept < 0:  # an older archive's c*(tp - 1) shows as c*tp and -c: a step that takes less than no time
        terms, coefs = [sp.Integer(1), *terms], [intercept, *coefs]
    for term, coef in zip(terms, coefs, strict=True):
        kind = term_kind(term)
        if coef < 0 and kind in ("efficiency", "count"):
            kind = f"negative {'time' if kind == 'efficiency' or term == 1 else 'count'}"  # 1: the intercept, µs
        on, interval, outside = None, (None, None), False
        if kind == "efficiency":
            # the coefficient's interval: the factors a term puts on its primitives scale it (work_factors)
            interval = bounds.coefficient_interval(work_factors(term)) or (math.nan, math.nan)
            on = next(
                (
                    name
                    for name, b in zip(("upper", "lower"), interval[::-1], strict=True)  # a cap pins: upper
                    if math.isclose(coef, b, rel_tol=1e-6)
                ),
                None,
            )
            # archives from before the search bounded each primitive (term_intervals) hold such terms
            outside = not interval[0] * (1 - 1e-6) <= coef <= interval[1] * (1 + 1e-6)  # NaN: no interval
        rows.append(
            {
                "term": to_infix(term),
                "coefficient": float(coef),
                "kind": kind,
                "lower": interval[0],
                "upper": interval[1],
                "on_bound": on,
                "outside_bounds": outside,
            }
        )
    return rows


def bound_flag(row: dict) -> str:
    """What every view (``archive show``, the HTML report, the primitives table) says of one
    ``term_efficiencies`` row: outside or on a bound, a negative time or count, or nothing."""
    if row["outside_bounds"]:
        if math.isnan(row["lower"]):  # no coefficient keeps its primitives inside, or no factor describes it
            return "OUTSIDE its bounds (at any coefficient)"
        return f"OUTSIDE its bounds ({row['lower']:g}-{row['upper']:g})"
    if row["on_bound"]:
        return f"on the {row['on_bound']} bound ({row[row['on_bound']]:g})"
    return "NEGATIVE" if row["kind"] in ("negative time", "negative count") else ""


def _probed(expression: str, deployments: list[Deployment], floor_fraction: float):
    """The probes of DEPLOYMENTS for an expression's primitives, and its step time on them."""
    expr = parse_infix(expression)
    names = sorted(s.name for s in expr.free_symbols)
    probes = PhysicsProbes.build(deployments, names or ["batch_size"], floor_fraction)
    return probes, lambda cols, n: evaluate_expr(expr, cols, n)


def _floor_ratio(base: np.ndarray, floor_us: np.ndarray, fits: np.ndarray) -> float | None:
    """The lowest step time over kernel floor on the probes that have a floor and fit (None: none)."""
    used = (floor_us > 0) & fits
    return float(np.min(base[used] / floor_us[used])) if used.any() else None


def probe_check(expression: str, deployments: list[Deployment], floor_fraction: float = 0.5) -> dict:
    """The physics probes on a fitted expression: monotone in work, and the lowest ratio of
    its step time to the measured-kernel floor (>= 1: never faster than its kernels allow)."""
    probes, predict = _probed(expression, deployments, floor_fraction)
    base, heavy = probes.predictions(predict)
    ok = monotone(base, heavy, probes.base_fits, probes.heavier_fits)
    ratio = _floor_ratio(base, probes.floor_us, probes.base_fits)
    return {"monotone": ok, "kernel_floor_ratio_min": ratio, "floor_fraction": floor_fraction}


def kernel_floor_by_deployment(
    expression: str, deployments: list[Deployment], floor_fraction: float = 1.0
) -> list[tuple[Deployment, float | None]]:
    """``probe_check``'s lowest ratio of step time to kernel floor on each deployment alone
    (None where the GPU has no kernel tables or no probe fits its KV cache). Below 1, the
    model prices some step of that deployment faster than the measured kernels it must run:
    it does not hold there, whatever it scored on the data it was fitted on."""
    by_gpu: dict[str, list[int]] = {}
    for i, d in enumerate(deployments):
        by_gpu.setdefault(d.gpu.name, []).append(i)
    ratio: dict[int, float | None] = {}
    for members in by_gpu.values():  # one build per GPU: a GPU without kernel tables has no floor at all
        probes, predict = _probed(expression, [deployments[i] for i in members], floor_fraction)
        base = predict(probes.base, len(probes.floor_us))  # no twins: the floor is of the base probes
        n = len(members)  # the rows are deployment-major
        parts = zip(np.split(base, n), np.split(probes.floor_us, n), np.split(probes.base_fits, n), strict=True)
        for i, part in zip(members, parts, strict=True):
            ratio[i] = _floor_ratio(*part)
    return [(d, ratio[i]) for i, d in enumerate(deployments)]


def monotone_on_probes(expression: str, deployments: list[Deployment]) -> bool:
    """Whether the expression never gets faster with more work on the probe steps."""
    return bool(probe_check(expression, deployments)["monotone"])


__all__ = ["bound_flag", "kernel_floor_by_deployment", "monotone_on_probes", "probe_check", "term_efficiencies"]
