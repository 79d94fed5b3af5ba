"""An archive entry's non-step terms (``overheads``) and their Go constants.

The seven terms, their Go constant names and their docs are defined once, in
``fitness.sim.latency_model.NON_STEP_TERMS``; this module only validates an entry's
values and prints the const block.
"""

from __future__ import annotations

import math

from archive.entry import ArchiveEntry
from fitness.sim.latency_model import NON_STEP_NAMES, NON_STEP_TERMS
from primitives.errors import InputError
from translate_go.gosource import align_rows
from translate_go.printer import go_float_literal


def resolve_overheads(entry: ArchiveEntry) -> tuple[dict[str, float], list[str]]:
    """All seven non-step terms (µs) and the names that fell back to BLIS's default 0."""
    given = dict(entry.overheads or {})
    unknown = sorted(set(given) - set(NON_STEP_NAMES))
    if unknown:
        raise InputError(
            f"archive entry {entry.id}", "overheads", f"unknown keys {unknown}; expected some of {list(NON_STEP_NAMES)}"
        )
    out, defaulted = {}, []
    for key in NON_STEP_NAMES:
        if key in given:
            value = given[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
                raise InputError(
                    f"archive entry {entry.id}", f"overheads.{key}", f"expected a finite number of µs, got {value!r}"
                )
            out[key] = float(value)
        else:
            out[key] = 0.0
            defaulted.append(key)
    return out, defaulted


def non_step_go_names() -> dict[str, str]:
    """Term name -> Go constant name (the templates' placeholders are the term names)."""
    return {t.name: t.go_name for t in NON_STEP_TERMS}


def overheads_source(overheads: dict[str, float]) -> str:
    """The const block of the non-step terms, aligned as gofmt aligns it."""
    rows = [(t.go_name, "float64", f"= {go_float_literal(overheads[t.name])}", f"// {t.doc}") for t in NON_STEP_TERMS]
    lines = ["// Non-step latency terms, µs (archive entry overheads; see fitness/sim/latency_model.py)."]
    lines.append("const (")
    lines += align_rows(rows)
    lines.append(")")
    return "\n".join(lines) + "\n"


__all__ = ["non_step_go_names", "overheads_source", "resolve_overheads"]
