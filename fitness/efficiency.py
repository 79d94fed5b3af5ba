"""The interval a µs term's fitted coefficient (its efficiency factor) may take.

A µs primitive's ideal time is a datasheet roofline or a measured kernel, and no step runs
its work faster than either, so 1 (ideal) up to 4x slower by default (``--efficiency-bounds``).
Some work has a tighter measured price: ``caps`` maps a primitive to the most one µs of its
ideal time costs in the GPU's measured kernels (``primitives.kernels.efficiency_caps``: a KV
byte costs at most 1.16x its HBM roofline time in H100's decode-attention kernel), and
``floors`` the least (``efficiency_floors``: its typical price, 1.055x). Each primitive a
term prices is held to its own bounds. Without the cap, the
price of a KV read is pinned only by the models whose steps it dominates; fitted on the
others, where it trades against per-step overheads, it drifted to 1.5x and Llama-2-7B ran
away. Without the floor, a refit without those steps drops it to 1.0, cheaper than the
kernel that reads the bytes, and Llama-2-7B at 20 req/s comes out 13-15% fast.

A term is bounded through the factor it puts on each µs primitive (``work_factors``):
``2.6*weight_time_us`` streams weights at 2.6, so its coefficient c prices them at 2.6c,
and that is what must lie inside weight streaming's bounds (``coefficient_interval``);
``Max(gemm_time_us, kv_io_time_us)`` prices whichever wins at c, so c must suit both. A
primitive may be priced by one additive part of one term only (``term_intervals``): in two,
its efficiency would be the sum of their coefficients, which no bound on each holds. A
term whose price of a work no factor describes (a literal inside a ratio or a denominator,
a product of times) has no efficiency at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import sympy as sp

from primitives.language import pdiv
from primitives.units import time_primitives

DEFAULT_EFFICIENCY_BOUNDS = (1.0, 4.0)


@dataclass(frozen=True)
class EfficiencyBounds:
    """The run's interval for every µs term, and the caps and floors of some primitives' terms.

    Unpacks like ``(lower, upper)``, so ``lo, hi = bounds`` reads the run's interval.
    """

    lower: float = DEFAULT_EFFICIENCY_BOUNDS[0]
    upper: float = DEFAULT_EFFICIENCY_BOUNDS[1]
    caps: tuple[tuple[str, float], ...] = ()  # (primitive, upper bound), sorted
    floors: tuple[tuple[str, float], ...] = ()  # (primitive, lower bound), sorted

    def __iter__(self):
        return iter((self.lower, self.upper))

    @cached_property
    def _cap_of(self) -> dict[str, float]:  # the caps as a mapping, built once (``of`` is on the scoring path)
        return dict(self.caps)

    @cached_property
    def _floor_of(self) -> dict[str, float]:
        return dict(self.floors)

    def of(self, name: str) -> tuple[float, float]:
        """The interval of the µs primitive ``name``'s efficiency (never empty: a floor
        above the interval's top gives the top)."""
        lo, hi = self.lower, self.upper
        if name in self._cap_of:
            hi = max(lo, min(hi, self._cap_of[name]))
        if name in self._floor_of:
            lo = min(hi, max(lo, self._floor_of[name]))
        return lo, hi

    def coefficient_interval(self, works: "Works | None") -> tuple[float, float] | None:
        """The interval of the coefficient c of a term with these works: c times the factors
        the term puts on each µs primitive inside that primitive's bounds; None where no c
        does, or the term prices a work at no factor (``work_factors`` gave None or one <= 0)."""
        if works is None:
            return None
        lo, hi = 0.0, float("inf")
        for name, least, most in works:
            if least <= 0.0:  # a work at a negative or no factor: no efficiency prices it
                return None
            w_lo, w_hi = self.of(name)
            lo, hi = max(lo, w_lo / least), min(hi, w_hi / most)
        return (lo, hi) if lo <= hi * (1 + 1e-12) else None

    def describe(self, dash: str = "-") -> str:
        """``1-4; kv_io_time_us 1.0549-1.16``: what a table's title says of the bounds."""
        caps, floors = self._cap_of, self._floor_of
        parts = [f"{self.lower:g}{dash}{self.upper:g}"]
        for name in sorted(caps.keys() | floors.keys()):
            lo, hi = self.of(name)
            if name in caps and name in floors:
                parts.append(f"{name} {lo:g}{dash}{hi:g}")
            else:
                parts.append(f"{name} at most {hi:g}" if name in caps else f"{name} at least {lo:g}")
        return "; ".join(parts)


Works = tuple[tuple[str, float, float], ...]  # (µs primitive, least and most factor a term puts on it)
# per µs primitive: the least positive and the largest factor, and whether a Max/Min branch leaves it out
Factors = dict[str, tuple[float, float, bool]]


def _sum(a: Factors, b: Factors) -> Factors:
    out = dict(a)
    for name, (b_lo, b_hi, b_gone) in b.items():
        if name not in out:
            out[name] = (b_lo, b_hi, b_gone)
            continue
        a_lo, a_hi, a_gone = out[name]
        lows = [a_lo + b_lo] + ([a_lo] if b_gone else []) + ([b_lo] if a_gone else [])
        out[name] = (min(lows), a_hi + b_hi, a_gone and b_gone)
    return out


def _either(branches: list[Factors]) -> Factors:
    """A Max or Min prices one branch: each primitive at a factor of a branch holding it, or not at all."""
    out: Factors = {}
    for name in set().union(*branches):
        held = [f[name] for f in branches if name in f]
        gone = len(held) < len(branches) or any(g for _, _, g in held)
        out[name] = (min(lo for lo, _, _ in held), max(hi for _, hi, _ in held), gone)
    return out


def _factors(expr: sp.Expr) -> Factors | None:
    """The factors EXPR puts on each µs primitive in it, through numbers times it, sums,
    ``Max``, ``Min``, ``Abs`` and ``pdiv`` by a product of ratios; None where no factor
    describes it: a literal inside a ratio factor or a denominator (``pdiv(w, 0.5*r)``), a
    product or ratio of times, a time under any other function."""
    if not time_primitives(expr):
        return {}
    if isinstance(expr, sp.Symbol):
        return {expr.name: (1.0, 1.0, False)}
    if isinstance(expr, (sp.Add, sp.Max, sp.Min)):
        parts = [_factors(a) for a in expr.args]
        if any(f is None for f in parts):
            return None
        if isinstance(expr, sp.Add):
            out: Factors = {}
            for f in parts:
                out = _sum(out, f)
            return out
        return _either(parts)
    if isinstance(expr, sp.Mul):
        number, rest = expr.as_coeff_Mul()
        args = sp.Mul.make_args(rest)
        timed = [a for a in args if time_primitives(a)]
        if len(timed) != 1 or any(a.atoms(sp.Number) for a in args if a is not timed[0]):
            return None
        inner, k = _factors(timed[0]), float(number)
        if inner is None:
            return None
        return {name: (k * min(lo, hi), k * max(lo, hi), gone) for name, (lo, hi, gone) in inner.items()}
    if isinstance(expr, pdiv):
        num, den = expr.args
        return None if time_primitives(den) or den.atoms(sp.Number) else _factors(num)
    if isinstance(expr, sp.Abs):
        inner = _factors(expr.args[0])
        return None if inner is None or any(lo <= 0 for lo, _, _ in inner.values()) else inner
    return None


@lru_cache(maxsize=65536)
def work_factors(expr: sp.Expr) -> Works | None:
    """Per µs primitive of a term, the least and most factor the term puts on it:
    ``2.6*weight_time_us`` streams weights at 2.6; ``Max(189.0, 2*gemm_time_us +
    3*decode_attention_time_us)`` prices matmuls at 2 and attention at 3 when it prices them
    at all. None where a primitive is in two of the term's additive parts as sympy splits it
    (the fitted expression shows them as two terms, refitted apart), or where no factor
    describes the term (``_factors``). A number in the term (a µs constant) is no work."""
    seen: Factors = {}
    for part in sp.Add.make_args(sp.sympify(expr)):
        f = _factors(part)
        if f is None or f.keys() & seen.keys():
            return None
        seen.update(f)
    return tuple((name, lo, hi) for name, (lo, hi, _) in sorted(seen.items()))


def term_intervals(
    works: Sequence[Works | None | bool], bounds: "EfficiencyBounds"
) -> list[tuple[float, float] | None] | None:
    """Per term, its coefficient's interval (None for a count term, given as False); None for
    the whole where a µs primitive is priced by two terms, or a term by no factor or at no
    coefficient inside its bounds (``EfficiencyBounds.coefficient_interval``)."""
    seen: set[str] = set()
    out: list[tuple[float, float] | None] = []
    for term_works in works:
        if term_works is False:
            out.append(None)
            continue
        interval = bounds.coefficient_interval(term_works)
        names = {name for name, *_ in term_works or ()}
        if interval is None or names & seen:
            return None
        seen |= names
        out.append(interval)
    return out


def as_bounds(
    bounds, caps: Mapping[str, float] | None = None, floors: Mapping[str, float] | None = None
) -> EfficiencyBounds:
    """``bounds`` as EfficiencyBounds: one already, or a (lower, upper) pair with ``caps`` and ``floors``."""
    if isinstance(bounds, EfficiencyBounds):
        return bounds
    lo, hi = bounds
    return EfficiencyBounds(
        float(lo), float(hi), tuple(sorted((caps or {}).items())), tuple(sorted((floors or {}).items()))
    )


def run_efficiency_bounds(run_config: Mapping | None) -> EfficiencyBounds:
    """The bounds a run searched with (its ``run.json``), else the default (a run from before
    the caps, or the floors, has none)."""
    rc = run_config or {}
    return as_bounds(
        rc.get("efficiency_bounds") or DEFAULT_EFFICIENCY_BOUNDS, rc.get("efficiency_caps"), rc.get("efficiency_floors")
    )


__all__ = [
    "DEFAULT_EFFICIENCY_BOUNDS",
    "EfficiencyBounds",
    "Works",
    "as_bounds",
    "run_efficiency_bounds",
    "term_intervals",
    "work_factors",
]
