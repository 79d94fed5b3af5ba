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

Above 1, the margin left; below 1, an experiment that already fails, and how much faster
(or lighter) it would have to be to stop. Each factor is found by bisection on a log scale
over ``FACTOR_RANGE``: the predicted failed fraction (the mean over the draws of the load)
is evaluated at 1, then at the end of the range on the side of the crossing, then
``ROUNDS`` times at the bracket's geometric middle; all experiments of a round are
simulated in parallel. The result is the bracket ``(below, above]``: at ``below`` no more
than the threshold fail, at ``above`` more do (ratio 4^(1/2^ROUNDS), about 0.5%). Where the
failed fraction does not cross inside the range, the factor is None and ``beyond`` says on
which side (``">"``: none fail even at the top; ``"<"``: they fail even at the bottom).
The failed fraction of a seeded simulation is not strictly monotone in either knob; the
bisection finds one crossing.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from fitness.step_scatter import StepScatter
from fitness.validate import closed_loop_runs
from primitives.data.experiments import ExperimentSpec
from primitives.deployment import DeploymentResolver
from primitives.language import scaled_expression

FAILED_THRESHOLD = 0.01  # more than 1% of the requests failed: the run has tipped
FACTOR_RANGE = (0.25, 4.0)
ROUNDS = 8
KNOBS = ("step_time", "load")


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
    seed: int = 0,
    jobs: int | None = None,
    load_draws: int = 1,
    scatter: StepScatter | None = None,
    threshold: float = FAILED_THRESHOLD,
    failed_now: list[float] | None = None,
) -> dict:
    """Per experiment: the predicted failed fraction as modelled, and per knob the factor at
    which more than ``threshold`` of the requests fail (see the module doc). ``failed_now``:
    the failed fractions at factor 1 where a validation has them already."""

    def failed(points: list[tuple[int, str, float]]) -> list[float]:
        runs = [(*scaled_run(specs[i], expression, knob, factor), overheads) for i, knob, factor in points]
        items = closed_loop_runs(runs, resolver, seed, jobs, False, load_draws, scatter)
        return [item["failure_fraction_pred"] or 0.0 for item in items]  # None: no request at all

    now = failed_now if failed_now is not None else failed([(i, KNOBS[0], 1.0) for i in range(len(specs))])
    low, high = FACTOR_RANGE
    pairs = [(i, knob) for i in range(len(specs)) for knob in KNOBS]
    ends = {(i, knob): (low if now[i] > threshold else high) for i, knob in pairs}
    at_end = dict(zip(pairs, failed([(i, knob, ends[i, knob]) for i, knob in pairs]), strict=True))
    bracket: dict[tuple[int, str], list[float]] = {}  # [below, above]: failed <= threshold at below, > at above
    beyond: dict[tuple[int, str], str] = {}
    for i, knob in pairs:
        if (at_end[i, knob] > threshold) == (now[i] > threshold):
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
            bracket[p][1 if f > threshold else 0] = x
    experiments = []
    for i, spec in enumerate(specs):
        item: dict = {"name": spec.name, "failure_fraction_pred": now[i]}
        for knob in KNOBS:
            b = bracket.get((i, knob))
            item[knob] = {
                "factor": b[1] if b else None,
                "bracket": b,
                "beyond": beyond.get((i, knob)),
            }
        experiments.append(item)
    return {
        "failed_threshold": threshold,
        "factor_range": list(FACTOR_RANGE),
        "rounds": ROUNDS,
        "knobs": list(KNOBS),
        "experiments": experiments,
    }


def factor_text(knob_result: dict) -> str:
    """A knob's result as the reports print it: ``x1.64``, or ``>4`` / ``<0.25`` off the range."""
    if knob_result["factor"] is not None:
        return f"x{knob_result['factor']:.2f}"
    low, high = FACTOR_RANGE
    return f">{high:g}" if knob_result["beyond"] == ">" else f"<{low:g}"


__all__ = ["FACTOR_RANGE", "FAILED_THRESHOLD", "KNOBS", "ROUNDS", "factor_text", "headroom", "scaled_run"]
