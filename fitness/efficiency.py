"""The interval a µs term's fitted coefficient (its efficiency factor) may take.

A µs primitive's ideal time is a datasheet roofline or a measured kernel, and no step runs
its work faster than either, so 1 (ideal) up to 4x slower by default (``--efficiency-bounds``).
Some work has a tighter measured price: ``caps`` maps a primitive to the most one µs of its
ideal time costs in the GPU's measured kernels (``primitives.kernels.efficiency_caps``: a KV
byte costs at most 1.16x its HBM roofline time in H100's decode-attention kernel), and
``floors`` the least (``efficiency_floors``: its typical price, 1.055x). A term whose only
times are capped (floored) primitives gets that upper (lower) bound. Without the cap, the
price of a KV read is pinned only by the models whose steps it dominates; fitted on the
others, where it trades against per-step overheads, it drifted to 1.5x and Llama-2-7B ran
away. Without the floor, a refit without those steps drops it to 1.0, cheaper than the
kernel that reads the bytes, and Llama-2-7B at 20 req/s comes out 13-15% fast.

A term is bounded through its works (``work_factors``): ``2.6*weight_time_us`` puts 2.6 on
weight streaming, so its coefficient c prices it at 2.6c, and that is what must lie inside
the bounds (``coefficient_interval``). A work may be priced by one term only
(``term_intervals``): in two, its efficiency would be the sum of their coefficients, which
no bound on each holds. The fitted expression shows each work once, at that efficiency.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
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

    def of(self, time_names: Iterable[str]) -> tuple[float, float]:
        """The interval of a term whose µs primitives are ``time_names`` (never empty: a
        floor above the interval's top gives the top)."""
        caps, floors = self._cap_of, self._floor_of
        names = set(time_names)
        lo, hi = self.lower, self.upper
        if names and names <= caps.keys():
            hi = max(lo, min(hi, max(caps[n] for n in names)))
        if names and names <= floors.keys():
            lo = min(hi, max(lo, min(floors[n] for n in names)))
        return lo, hi

    def coefficient_interval(self, works: "Works") -> tuple[float, float] | None:
        """The interval of the coefficient c of a term with these works: c times each work's
        factors inside that work's bounds; None where no c puts every work inside its own."""
        lo, hi = 0.0, float("inf")
        for _, times, least, most in works:
            if least <= 0.0:  # a work at a negative or no factor: no efficiency prices it
                return None
            w_lo, w_hi = self.of(times)
            lo, hi = max(lo, w_lo / least), min(hi, w_hi / most)
        return (lo, hi) if lo <= hi * (1 + 1e-12) else None

    def describe(self, dash: str = "-") -> str:
        """``1-4; kv_io_time_us 1.0549-1.16``: what a table's title says of the bounds."""
        caps, floors = self._cap_of, self._floor_of
        parts = [f"{self.lower:g}{dash}{self.upper:g}"]
        for name in sorted(caps.keys() | floors.keys()):
            lo, hi = self.of({name})
            if name in caps and name in floors:
                parts.append(f"{name} {lo:g}{dash}{hi:g}")
            else:
                parts.append(f"{name} at most {hi:g}" if name in caps else f"{name} at least {lo:g}")
        return "; ".join(parts)


Works = tuple[tuple[str, frozenset[str], float, float], ...]  # (work, its µs primitives, least and most factor)
Factors = dict[str, tuple[float, float]]  # per µs primitive: the least and most factor a work puts on it


def _inner_factors(expr: sp.Expr) -> Factors:
    """The factors an expression puts on each µs primitive in it: a number times it, through
    sums, ``Max``, ``Min``, ``Abs`` and ``pdiv`` by a count. A primitive under any other
    function (``sqrt``, ``log``, a product of times) is taken at 1."""
    if isinstance(expr, sp.Symbol):
        return {expr.name: (1.0, 1.0)} if time_primitives(expr) else {}
    if not time_primitives(expr):
        return {}
    if isinstance(expr, (sp.Add, sp.Max, sp.Min)):
        out: Factors = {}
        for arg in expr.args:
            for name, (f_lo, f_hi) in _inner_factors(arg).items():
                if name not in out:
                    out[name] = (f_lo, f_hi)
                elif isinstance(expr, sp.Add):  # twice in a sum: the factors add
                    out[name] = (out[name][0] + f_lo, out[name][1] + f_hi)
                else:  # in either branch of a Max or Min
                    out[name] = (min(out[name][0], f_lo), max(out[name][1], f_hi))
        return out
    if isinstance(expr, sp.Mul):
        number, rest = expr.as_coeff_Mul()
        timed = [a for a in sp.Mul.make_args(rest) if time_primitives(a)]
        inner = _inner_factors(timed[0]) if len(timed) == 1 else dict.fromkeys(time_primitives(rest), (1.0, 1.0))
        k = float(number)  # other factors are ratios (moe_touched_fraction), which no bound sees
        return {name: tuple(sorted((k * f_lo, k * f_hi))) for name, (f_lo, f_hi) in inner.items()}
    if isinstance(expr, sp.Abs) or (isinstance(expr, pdiv) and not time_primitives(expr.args[1])):
        return _inner_factors(expr.args[0])
    return dict.fromkeys(time_primitives(expr), (1.0, 1.0))


@lru_cache(maxsize=65536)
def work_factors(expr: sp.Expr) -> Works:
    """The works a µs term prices and the factors it puts on them: ``2.6*weight_time_us`` is
    weight streaming at 2.6, ``gemm_time_us + kv_io_time_us`` two works at 1 each (sympy's
    split, as the fitted expression shows it: a number distributes over a sum, not into
    ``Max`` or ``pdiv``), ``Max(gemm_time_us, 2*kv_io_time_us)`` one work whose primitives
    it prices at 1 to 2 (``_inner_factors``). A number in the term (a µs constant) is no
    work: it is left out."""
    out = []
    for part in sp.Add.make_args(sp.sympify(expr)):
        factor, work = part.as_coeff_Mul()
        times = time_primitives(work)
        if times:
            inner = _inner_factors(work).values()
            f_lo, f_hi = min(f for f, _ in inner), max(f for _, f in inner)
            out.append((str(work), times, float(factor) * f_lo, float(factor) * f_hi))
    return tuple(out)


def term_intervals(
    works: Sequence[Works | None], bounds: "EfficiencyBounds"
) -> list[tuple[float, float] | None] | None:
    """Per term, its coefficient's interval (None for a count term, whose works are None); None
    for the whole where a work is priced by two terms or a term cannot put its works inside
    their bounds (``EfficiencyBounds.coefficient_interval``)."""
    seen: set[str] = set()
    out: list[tuple[float, float] | None] = []
    for term_works in works:
        if term_works is None:
            out.append(None)
            continue
        names = {w for w, *_ in term_works}
        if names & seen:
            return None
        seen |= names
        interval = bounds.coefficient_interval(term_works)
        if interval is None:
            return None
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
