"""Units of step-time terms, so that fitted constants can be held to physical bounds.

A term whose unit is µs (a µs primitive, possibly scaled by dimensionless ratios such
as ``moe_touched_fraction``) has a coefficient that is an efficiency factor: how much
slower than its ideal (datasheet or measured-kernel) time the work really runs. Other
terms are counts (per request, per layer, ...) whose coefficients are costs in µs per
unit: those only have to be >= 0.

Units are dictionaries of base-unit exponents; numbers are dimensionless but may be
added to anything (``x + 3`` keeps x's unit). A sum of unlike units has no unit (None).
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache

import sympy as sp

from primitives.language import pdiv
from primitives.registry import PRIMITIVE_BY_NAME

Unit = tuple[tuple[str, Fraction], ...]  # sorted (base, exponent) pairs; () is dimensionless
DIMENSIONLESS: Unit = ()
MICROSECONDS: Unit = (("us", Fraction(1)),)
_BASE = {
    "us": MICROSECONDS,
    "tokens": (("tokens", Fraction(1)),),
    "token^2": (("tokens", Fraction(2)),),
    "requests": (("requests", Fraction(1)),),
    "calls": (("calls", Fraction(1)),),
    "layers": (("layers", Fraction(1)),),
    "GPUs": (("gpus", Fraction(1)),),
    "ratio": DIMENSIONLESS,
}
_ANY = "any"  # a bare number: takes the unit of what it is added to


def _times(a: Unit, b: Unit, power: Fraction = Fraction(1)) -> Unit:
    out = dict(a)
    for base, e in b:
        out[base] = out.get(base, Fraction(0)) + e * power
    return tuple(sorted((k, v) for k, v in out.items() if v != 0))


def _unit(expr: sp.Basic):
    if expr.is_Number:
        return _ANY
    if isinstance(expr, sp.Symbol):
        p = PRIMITIVE_BY_NAME.get(expr.name)
        return _BASE.get(p.unit) if p is not None else None
    args = [_unit(a) for a in expr.args]
    if any(a is None for a in args):
        return None
    if isinstance(expr, (sp.Add, sp.Max, sp.Min)):
        known = {a for a in args if a != _ANY}
        return _ANY if not known else (known.pop() if len(known) == 1 else None)
    if isinstance(expr, (sp.Mul, pdiv)):
        out: Unit = DIMENSIONLESS
        for i, a in enumerate(args):
            if a != _ANY:
                out = _times(out, a, Fraction(-1) if isinstance(expr, pdiv) and i == 1 else Fraction(1))
        return out
    if isinstance(expr, sp.Pow):
        base, exp = args[0], expr.args[1]
        if base == _ANY:
            return _ANY
        if not exp.is_Rational:
            return None if base != DIMENSIONLESS else DIMENSIONLESS
        return _times(DIMENSIONLESS, base, Fraction(int(exp.p), int(exp.q)))
    if isinstance(expr, sp.Abs):
        return args[0]
    if isinstance(expr, (sp.log, sp.exp)):
        return DIMENSIONLESS if args[0] in (_ANY, DIMENSIONLESS) else None
    return None


@lru_cache(maxsize=65536)
def term_unit(expr: sp.Expr) -> Unit | None:
    """The term's unit (None where it mixes units or applies a function to a dimensioned value)."""
    u = _unit(sp.sympify(expr))
    return DIMENSIONLESS if u == _ANY else u


def is_efficiency_term(expr: sp.Expr) -> bool:
    """Whether the term is a time in µs, so its coefficient is an efficiency factor."""
    return term_unit(expr) == MICROSECONDS


def time_primitives(expr: sp.Expr) -> frozenset[str]:
    """The primitives measured in µs that the term contains."""
    return frozenset(
        s.name
        for s in sp.sympify(expr).free_symbols
        if (p := PRIMITIVE_BY_NAME.get(s.name)) is not None and p.unit == "us"
    )


def involves_time(expr: sp.Expr) -> bool:
    """Whether the term contains a primitive measured in µs."""
    return bool(time_primitives(expr))


# Work whose price depends on the deployment (KV bytes per token, attention FLOPs per pair):
# a step-time term may only use it through the µs primitive that prices it.
UNPRICED_WORK = frozenset({"kv_tokens", "max_kv_tokens", "attention_work"})


def involves_unpriced_work(expr: sp.Expr) -> bool:
    """Whether the term contains a count of KV tokens or attention pairs (``UNPRICED_WORK``)."""
    return any(s.name in UNPRICED_WORK for s in sp.sympify(expr).free_symbols)


def has_negative_part(expr: sp.Expr) -> bool:
    """Whether a term's form holds a negative number: a subtraction or a negative constant
    anywhere, inside pdiv, Max and Min too, but not an exponent (a division) nor anything
    under an absolute value (psqrt and plog take one). The form, not the values:
    ``batch_size - num_decode_reqs`` has one, though it is ``num_prefill_reqs``."""
    e = sp.sympify(expr)
    if e.is_Number:
        return bool(e < 0)
    if isinstance(e, sp.Abs):
        return False
    if e.is_Pow:
        return has_negative_part(e.base)
    return any(has_negative_part(a) for a in e.args)


__all__ = [
    "DIMENSIONLESS",
    "MICROSECONDS",
    "UNPRICED_WORK",
    "has_negative_part",
    "involves_time",
    "involves_unpriced_work",
    "is_efficiency_term",
    "time_primitives",
    "term_unit",
]
