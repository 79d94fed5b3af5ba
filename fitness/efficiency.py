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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

import sympy as sp

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

    def of_term(self, expr: sp.Expr) -> tuple[float, float]:
        return self.of(time_primitives(expr))

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


__all__ = ["DEFAULT_EFFICIENCY_BOUNDS", "EfficiencyBounds", "as_bounds", "run_efficiency_bounds"]
