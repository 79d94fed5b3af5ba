"""Is a fitted model physics? Its efficiencies, their bounds, and monotonicity in work.

``archive show`` and the results tables read these: each term of the expression is an
efficiency term (a time in µs; its coefficient says how much slower than the ideal or
measured-kernel time the work runs), a count term (µs per request, per layer, ...), or a
negative time (a µs part with a negative coefficient, which no physical cost has).
"""

from __future__ import annotations

import math

from fitness.monotone import MonotoneProbes
from fitness.scoring import DEFAULT_EFFICIENCY_BOUNDS, term_physics
from fitness.validate import split_terms
from primitives.deployment import Deployment
from primitives.language import evaluate_expr, parse_infix, to_infix


def term_efficiencies(expression: str, bounds: tuple[float, float] = DEFAULT_EFFICIENCY_BOUNDS) -> list[dict]:
    """One row per additive term: its coefficient, kind and which bound it sits on (if any)."""
    _, terms, coefs = split_terms(parse_infix(expression))
    rows = []
    for term, coef in zip(terms, coefs, strict=True):
        physics = term_physics(term)
        kind = "efficiency" if physics else ("count" if physics is False else "negative time")
        if coef < 0 and kind == "efficiency":
            kind = "negative time"
        on = None
        if kind == "efficiency":
            on = next(
                (
                    name
                    for name, b in zip(("lower", "upper"), bounds, strict=True)
                    if math.isclose(coef, b, rel_tol=1e-6)
                ),
                None,
            )
        rows.append({"term": to_infix(term), "coefficient": float(coef), "kind": kind, "on_bound": on})
    return rows


def monotone_on_probes(expression: str, deployments: list[Deployment]) -> bool:
    """Whether the expression never gets faster with more work on the probe steps."""
    expr = parse_infix(expression)
    names = sorted(s.name for s in expr.free_symbols)
    if not names or not deployments:
        return True
    probes = MonotoneProbes.build(deployments, names)
    return probes.holds(lambda cols, n: evaluate_expr(expr, cols))


__all__ = ["monotone_on_probes", "term_efficiencies"]
