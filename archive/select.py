"""Which model on the Pareto front to ship: a PySR-like "best" rule.

The rule (``recommend``), in the order it is applied:

0. **Closed loop first.** When a run validated some entries in the closed-loop
   simulation (``objectives["closed_loop"] == 1``; their latency errors are then the
   closed-loop ones), only those are considered: teacher-forced estimates can be
   optimistic near saturation.

1. **Error to compare.** Each entry's error is the worst of the errors it was scored
   on: ``max(step_mape, e2e_error_max, ttft_error_max, itl_error_max, failure_error_max,
   transfer_error)`` (the ``_max`` latency errors are the worst experiment's; where an
   entry has only the mean, ``e2e_error`` etc., that is used), using only those of the
   objectives that *every* candidate carries (so a model is never preferred just
   because it was not replayed end to end, or not checked for transfer). A model that predicts steps well but
   replays latencies badly is thus judged by the latency it gets wrong — the
   recommended model is the one to ship, not the best per-step fit.
2. **Two-objective front.** Sort by complexity and keep only entries whose error is
   strictly lower than every simpler entry's (at equal complexity, the lower error,
   then the smaller id). Entries with a non-finite error are dropped.
3. **Score.** For each kept entry after the simplest, the score is the drop in
   log(error) per unit of log(complexity) from the previous kept entry::

       score_i = -(ln e_i - ln e_{i-1}) / (ln c_i - ln c_{i-1})

   The simplest entry scores 0. (PySR's "best" divides by the complexity step itself;
   dividing by the log step makes the score independent of how complexity is counted
   — a step from 5 to 10 nodes costs as much as one from 20 to 40.) Errors are
   floored at 1e-12 and complexities at 1 so the logs stay finite.
4. **Accuracy gate.** Only entries with error <= 1.25 x the lowest error of any
   candidate (runaways of step 5 included) are eligible (PySR uses 1.5; a model to ship
   should give away little accuracy): a big relative gain at a crude model does not win.
5. **Transfer gate.** An entry whose constants run away when refitted without a
   workload, a model or the high-rate stages (``transfer_error_worst`` at the cap:
   some held-out experiment 100% or more off, ``evolve.validation.transfer_errors``)
   takes no part in steps 2-4 when a stable entry is within the accuracy gate (``rank``
   says how). The combined error uses the mean held-out error, so that one runaway does
   not sink every candidate; this gate keeps such a model from being shipped when a
   stable one is nearly as accurate. Entries without the figure (old archives, runs
   without experiments) are not gated.
6. **Choice.** The eligible entry with the highest score; ties (scores equal to
   1e-9 relative) go to lower complexity, then to the smaller id, so the choice is
   deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from archive.entry import ArchiveEntry

# failure_error: the closed loop's miss of the failed fraction of requests (a fraction, like the others)
# transfer_error: the mean held-out error (each capped at 100%) when refitted without a
# workload, a model or the high-rate stages (``evolve.validation.transfer_errors``; only
# the entries checked in the closed loop carry it)
ERROR_OBJECTIVES = ("step_mape", "e2e_error", "ttft_error", "itl_error", "failure_error", "transfer_error")
ACCURACY_GATE = 1.25  # eligible: error <= ACCURACY_GATE * lowest error of any candidate
# transfer_error_worst at fitness.transfer.TRANSFER_ERROR_CAP (each held-out error is capped there)
RUNAWAY_TRANSFER_ERROR = 1.0
_ERROR_FLOOR = 1e-12
_SCORE_TIE = 1e-9  # relative


@dataclass(frozen=True)
class Ranked:
    """One entry of the two-objective front with its selection figures."""

    entry: ArchiveEntry
    error: float  # combined (worst-case) error
    score: float  # drop in log error per unit of log complexity
    eligible: bool  # within the accuracy gate
    runaway: bool = False  # a transfer refit ran away (step 5)


def _key_for(entry: ArchiveEntry, k: str) -> str | None:
    """The objective behind error ``k``: its worst-experiment variant when present."""
    if k != "step_mape" and f"{k}_max" in entry.objectives:
        return f"{k}_max"
    return k if k in entry.objectives else None


def error_keys(entries: list[ArchiveEntry]) -> tuple[str, ...]:
    """The error objectives every entry carries (in ERROR_OBJECTIVES order)."""
    keys = [k for k in ERROR_OBJECTIVES if all(_key_for(e, k) for e in entries)]
    return tuple(keys)


def combined_error(entry: ArchiveEntry, keys: tuple[str, ...] | None = None) -> float:
    """Worst-case error over ``keys`` (default: the error objectives the entry has); NaN if none."""
    keys = keys if keys is not None else tuple(k for k in ERROR_OBJECTIVES if _key_for(entry, k))
    values = []
    for k in keys:
        try:
            v = abs(float(entry.objectives[_key_for(entry, k) or k]))  # a signed bias error counts by its size
        except (KeyError, TypeError, ValueError):
            return math.nan
        values.append(v)
    return max(values) if values else math.nan


def closed_loop_first(entries: list[ArchiveEntry]) -> list[ArchiveEntry]:
    """Step 0: closed-loop-validated entries, when there are any; else all."""
    checked = [e for e in entries if e.objectives.get("closed_loop")]
    return checked or list(entries)


def _runaway(entry: ArchiveEntry) -> bool:
    """Step 5: whether a transfer refit of the entry ran away (its worst held-out error at the cap)."""
    try:
        return float(entry.objectives["transfer_error_worst"]) >= RUNAWAY_TRANSFER_ERROR
    except (KeyError, TypeError, ValueError):
        return False


def _front(candidates: list[tuple[int, float, str, ArchiveEntry]]) -> list[tuple[int, float, str, ArchiveEntry]]:
    """Step 2: by complexity, the entries whose error is strictly lower than every simpler one's."""
    front: list[tuple[int, float, str, ArchiveEntry]] = []
    for c in sorted(candidates, key=lambda c: (c[0], c[1], c[2])):
        if front and c[0] == front[-1][0]:
            continue  # same complexity: the first (lowest error, then id) wins
        if front and c[1] >= front[-1][1]:
            continue  # not better than a simpler model
        front.append(c)
    return front


def rank(entries: list[ArchiveEntry]) -> list[Ranked]:
    """Steps 0-5 of the rule: the two-objective front by complexity, with scores and gates.

    The transfer gate (step 5) acts before the front is built, so that a runaway entry
    cannot shadow a slightly less accurate stable one: when every entry carries
    ``transfer_error_worst`` and some stable entry is within the accuracy gate, the front
    is built from the stable entries alone. Otherwise every entry takes part (runaways
    flagged), so that the gate never ships a crude model and old archives rank as before.
    """
    entries = closed_loop_first(list(entries))
    keys = error_keys(list(entries))
    if not keys:
        return []
    candidates = []
    for e in entries:
        err = combined_error(e, keys)
        if math.isfinite(err):
            candidates.append((max(int(e.complexity), 1), err, e.id, e))
    if not candidates:
        return []
    lowest = min(c[1] for c in candidates)  # the accuracy gate's reference (step 4), runaways included
    if all("transfer_error_worst" in c[3].objectives for c in candidates):
        stable = [c for c in candidates if not _runaway(c[3])]
        if any(c[1] <= ACCURACY_GATE * lowest for c in stable):
            candidates = stable
    front = _front(candidates)
    out = []
    for i, (cx, err, _, e) in enumerate(front):
        if i == 0:
            score = 0.0
        else:
            pcx, perr = front[i - 1][0], front[i - 1][1]
            score = -(math.log(max(err, _ERROR_FLOOR)) - math.log(max(perr, _ERROR_FLOOR))) / (
                math.log(cx) - math.log(pcx)
            )
        eligible = err <= ACCURACY_GATE * lowest
        out.append(Ranked(entry=e, error=err, score=score, eligible=eligible, runaway=_runaway(e)))
    return out


def recommend(entries: list[ArchiveEntry]) -> ArchiveEntry:
    """The front entry to ship (see the module docstring for the rule).

    Raises ValueError when no entry has a finite error on the common objectives.
    """
    ranked = [r for r in rank(list(entries)) if r.eligible]
    if not ranked:
        raise ValueError("no entry with a finite error on the objectives all entries share")
    top = max(r.score for r in ranked)
    # scores equal up to rounding count as tied, so the tie-break is not left to float noise
    tied = [r for r in ranked if r.score >= top - _SCORE_TIE * max(1.0, abs(top))]
    return min(tied, key=lambda r: (r.entry.complexity, r.entry.id)).entry
