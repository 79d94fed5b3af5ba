"""How far each experiment is from losing requests (``validate --headroom``).

Whether a run loses requests to the client's timeout turns on a few percent of step time
near saturation: the blind reasoning runs sit on that edge (``docs/RESULTS.md``, "How close
the reasoning runs are to overload"). A planner needs the margin, not only the point: per
experiment and per knob, the factor at which more than ``threshold`` of the requests
(default 1%) are predicted to fail. The knobs:

* ``step_time``: every step that factor slower (the model's expression scaled, as
  ``validate --step-time-scale`` does; the non-step terms as they are);
* ``load``: every load stage's rate times the factor, its duration kept (more requests in
  the same time).

Above 1, the margin left: the least factor found at which the run tips. Below 1, an
experiment that already fails: the largest factor found at which it no longer does, so how
much faster (or lighter) it would have to be. Each factor is found by bisection on a log
scale over ``FACTOR_RANGE``: the predicted failed fraction (the mean over the draws of the
load) is evaluated at 1, then at the end of the range on the side of the crossing, then
``ROUNDS`` times at the bracket's geometric middle; all experiments of a round are
simulated in parallel. The JSON keeps the bracket ``[below, above]``: at ``below`` no more
than the threshold fail, at ``above`` more do. Each side of 1 spans a factor of 4 (the
range is symmetric about 1 on a log scale), so the bracket ends at a ratio of
4^(1/2^ROUNDS), about 0.5%. Where the failed fraction at the end of the range is on the
same side of the threshold as at 1, the factor is None and ``beyond`` says on which side
(``">"``: none fail even at the top; ``"<"``: they fail even at the bottom); a curve that
crosses and comes back inside the range counts so too. An experiment without any request
has no failed fraction: every field None. The failed fraction of a seeded simulation is
not strictly monotone in either knob; the bisection finds one crossing. With ``validate
--step-time-scale F`` the factors are of the scaled model.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from fitness.validate import ONE_DRAW, ClosedLoopSettings, closed_loop_runs
from primitives.data.experiments import ExperimentSpec
from primitives.deployment import DeploymentResolver
from primitives.language import scaled_expression

FAILED_THRESHOLD = 0.01  # more than 1% of the requests failed: the run has tipped
FACTOR_RANGE = (0.25, 4.0)
ROUNDS = 8
KNOBS = ("step_time", "load")
COLUMNS = ("experiment", "failed", "step time", "load")  # of the terminal's table and the report's


def title(threshold: float) -> str:
    return f"Headroom: factor at which >{100 * threshold:g}% of requests fail"


def scaled_run(spec: ExperimentSpec, expression: str, knob: str, factor: float) -> tuple[ExperimentSpec, str]:
    """The experiment and expression with ``knob`` scaled by ``factor``."""
    if factor == 1.0:
        return spec, expression
    if knob == "step_time":
        return spec, scaled_expression(expression, factor)
    if knob == "load":
        return replace(spec, stages=tuple((rate * factor, duration) for rate, duration in spec.stages)), expression
    raise ValueError(f"unknown knob {knob!r}; valid: {', '.join(KNOBS)}")


def headroom(
    specs: list[ExperimentSpec],
    resolver: DeploymentResolver,
    expression: str,
    overheads: dict,
    settings: ClosedLoopSettings = ONE_DRAW,
    threshold: float = FAILED_THRESHOLD,
    failed_now: list[float] | None = None,
) -> dict:
    """Per experiment: the predicted failed fraction as modelled, and per knob the factor at
    which more than ``threshold`` of the requests fail (see the module doc). ``failed_now``:
    the failed fractions at factor 1 where a validation has them already."""

    def failed(points: list[tuple[int, str, float]]) -> list[float | None]:
        runs = [(*scaled_run(specs[i], expression, knob, factor), overheads) for i, knob, factor in points]
        items = closed_loop_runs(runs, resolver, settings, tails=False)
        return [item["failure_fraction_pred"] for item in items]  # None: no request at all

    now = failed_now if failed_now is not None else failed([(i, KNOBS[0], 1.0) for i in range(len(specs))])
    low, high = FACTOR_RANGE
    pairs = [(i, knob) for i in range(len(specs)) for knob in KNOBS if now[i] is not None]
    ends = {(i, knob): (low if now[i] > threshold else high) for i, knob in pairs}
    at_end = dict(zip(pairs, failed([(i, knob, ends[i, knob]) for i, knob in pairs]), strict=True))
    bracket: dict[tuple[int, str], list[float]] = {}  # [below, above]: failed <= threshold at below, > at above
    beyond: dict[tuple[int, str], str] = {}
    for i, knob in pairs:
        if ((at_end[i, knob] or 0.0) > threshold) == (now[i] > threshold):
            beyond[i, knob] = "<" if now[i] > threshold else ">"
        else:
            bracket[i, knob] = [ends[i, knob], 1.0] if now[i] > threshold else [1.0, ends[i, knob]]
    for _ in range(ROUNDS):
        open_pairs = list(bracket)
        if not open_pairs:
            break
        middles = [float(np.sqrt(bracket[p][0] * bracket[p][1])) for p in open_pairs]
        got = failed([(i, knob, x) for (i, knob), x in zip(open_pairs, middles, strict=True)])
        for p, x, f in zip(open_pairs, middles, got, strict=True):
            bracket[p][1 if (f or 0.0) > threshold else 0] = x
    experiments = []
    for i, spec in enumerate(specs):
        item: dict = {"name": spec.name, "failure_fraction_pred": now[i]}
        for knob in KNOBS:
            b = bracket.get((i, knob))
            # the end on the far side of 1: where it tips, or where it would stop failing
            factor = None if b is None else (b[1] if now[i] <= threshold else b[0])
            item[knob] = {"factor": factor, "bracket": b, "beyond": beyond.get((i, knob))}
        experiments.append(item)
    return {
        "failed_threshold": threshold,
        "factor_range": list(FACTOR_RANGE),
        "rounds": ROUNDS,
        "knobs": list(KNOBS),
        "experiments": experiments,
    }


def factor_text(knob_result: dict) -> str:
    """A knob's result as the reports print it: ``x1.64``, ``>4`` / ``<0.25`` off the range,
    ``—`` for an experiment without requests."""
    low, high = FACTOR_RANGE
    if knob_result["factor"] is not None:
        return f"x{knob_result['factor']:.2f}"
    return {">": f">{high:g}", "<": f"<{low:g}"}.get(knob_result["beyond"], "—")


__all__ = [
    "COLUMNS",
    "FACTOR_RANGE",
    "FAILED_THRESHOLD",
    "KNOBS",
    "ROUNDS",
    "factor_text",
    "headroom",
    "scaled_run",
    "title",
]
