"""A fresh server's first seconds, as the real step traces measured them, on the first load stage
of every experiment of a traced deployment: the first stage's TTFT tail, simulated as modelled
and with that start, against what the clients measured.

A server that has just started runs its first steps slower than later (``trace_checks.py``,
checks 2 and 3): its steps in the first seconds take longer than the model's price of them
(relative to the steady state after the first minute), and before the first sampled step
more requests have arrived than a simulation holds by then. Per traced deployment:

* **the slow start**: measured over model cycle time per 2-s window of the first 16 s
  (``trace_checks.warm_up``), each simulated step in a window scaled by its ratio (a window
  the trace cannot price is left at 1);
* **the stall**: the requests present at the trace's first sampled step beyond the mean of
  ``DRAWS`` simulated draws at the same step, over the first stage's rate: how many seconds
  of arrivals the real server fell behind before it; the first simulated step takes that
  much longer.

The windows are placed on the start times of a run with the start (a stall delays every
later step), found from a plain run in ``PLACE_PASSES`` passes. Deployments without a trace
have no measured start and are listed as such; where a deployment has several traces, the
first by name measures it.
The server's start is not part of a latency model (BLIS's has no clock since start): this is
a what-if on the simulator, not something the search fits or the export carries.

Usage::

    python benchmarks/fresh_server.py --run-dir D --id ID [--draws N] [--shared DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # trace_checks.py, trace_queue.py

from trace_checks import WINDOW_S, WINDOW_STARTS_S, warm_up  # noqa: E402
from trace_model import archived_entry, model_parser, trace_prices_us  # noqa: E402
from trace_queue import first_step_present_count, simulate_stages  # noqa: E402

from evolve.validation_view import experiment_label  # noqa: E402
from fitness.sim.engine import simulate  # noqa: E402
from fitness.sim.models import ExpressionLatencyModel  # noqa: E402
from primitives.data.experiments import find_experiments  # noqa: E402
from primitives.data.traces import load_steps  # noqa: E402
from primitives.deployment import default_resolver  # noqa: E402
from primitives.errors import InputError  # noqa: E402

DRAWS = 3
FIRST_STAGE_STATS = ("p99", "p99.9")  # of the first stage's TTFT
PLACE_PASSES = 1  # runs with the start that place its windows on the steps' own times


def start_scales(
    step_start_s: np.ndarray, first_step_us: float, window_ratios: list[float | None], stall_s: float
) -> np.ndarray:
    """Per simulated step (its start, s from the first), the multiplier of a fresh server's start:
    the measured ratio of the ``WINDOW_S`` window it starts in (``WINDOW_STARTS_S``, contiguous
    from 0; 1 past them or where unknown), and on the first step the stall as a multiple of that
    step's modelled time FIRST_STEP_US. Padded with 1s to twice the steps given (the simulator
    reuses multipliers cyclically past their end)."""
    ratios = np.array([w if w is not None and np.isfinite(w) else 1.0 for w in window_ratios] + [1.0])
    index = np.clip(((step_start_s - WINDOW_STARTS_S[0]) // WINDOW_S).astype(int), 0, len(ratios) - 1)
    scales = np.concatenate([ratios[index], np.ones(len(index))])
    scales[0] += stall_s * 1e6 / max(first_step_us, 1.0)
    return scales


def run_clock_s(result) -> np.ndarray:
    """A simulated run's step start times, s from its first step."""
    start_us = result.trajectory.step_start_us
    return (start_us - start_us[0]) / 1e6


def start_run_scales(spec, dep, model, seed: int, start: tuple[list, float]) -> np.ndarray:
    """START's step multipliers for the run of load seed SEED, its windows placed on the start
    times of a run with it (``PLACE_PASSES`` passes from a plain run)."""
    plain = simulate(spec, dep, model, seed=seed)
    first_step_us, times_s = float(plain.trajectory.step_time_us[0]), run_clock_s(plain)
    for _ in range(PLACE_PASSES):
        with_start = simulate(spec, dep, model, seed=seed, step_scales=start_scales(times_s, first_step_us, *start))
        times_s = run_clock_s(with_start)
    return start_scales(times_s, first_step_us, *start)


def measured_starts(
    data, resolver, entry, experiments: Path, specs: dict, draws: int
) -> dict[tuple[str, int], tuple[list, float]]:
    """(model, TP) -> (the slow start's window ratios, the stall in s) of every trace whose
    experiment is in SPECS (by name; their folders in EXPERIMENTS)."""
    priced_us = trace_prices_us(data, resolver, entry, experiments)
    starts = {}
    for name in sorted(data.steps["experiment"].unique()):
        spec = specs.get(name)
        rows = (data.steps["experiment"] == name).to_numpy()
        trace = data.steps.loc[rows]
        got, first = warm_up(trace, priced_us[rows]), first_step_present_count(trace)
        if spec is None or got is None:
            continue
        dep = resolver.resolve_experiment(spec)
        if (dep.model.name, dep.tp) in starts:  # another trace of this deployment measured it
            continue
        stall_s = 0.0
        if first is not None:  # the draws that reach step k (as check 3 counts them)
            k, present = first
            runs = [simulate_stages(spec, dep, entry.expression, entry.overheads, s, None) for s in range(draws)]
            at_k = [float(run.present[k]) for run in runs if k < len(run.present)]
            stall_s = max(0.0, present - float(np.mean(at_k))) / spec.stages[0][0] if at_k else 0.0
        starts[(dep.model.name, dep.tp)] = (got[0], stall_s)
    return starts


def first_stage_tails(spec, dep, entry, draws: int, start: tuple[list, float] | None) -> dict[str, float]:
    """The first stage's TTFT tails (ms, mean over the draws), as modelled or with START."""
    got: dict[str, list[float]] = {s: [] for s in FIRST_STAGE_STATS}
    for seed in range(draws):
        model = ExpressionLatencyModel(entry.expression, dep, entry.overheads)
        scales = start_run_scales(spec, dep, model, seed, start) if start is not None else None
        result = simulate(spec, dep, model, seed=seed, record=False, distributions=True, step_scales=scales)
        for stat in FIRST_STAGE_STATS:
            got[stat].append(result.metrics.stages[0].stat_s("ttft", stat) * 1e3)
    return {stat: float(np.mean(v)) for stat, v in got.items()}


def main(argv: list[str] | None = None) -> int:
    args = model_parser("fresh_server.py", __doc__, DRAWS).parse_args(argv)
    try:
        entry = archived_entry(args.run_dir, args.id)
        data = load_steps([args.shared / "data" / "steps"])
        resolver = default_resolver()
        experiments = args.shared / "data" / "experiments"
        specs = {s.name: s for s in find_experiments(experiments)}
        starts = measured_starts(data, resolver, entry, experiments, specs, args.draws)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"a fresh server's start, measured in the traces, with {entry.id} ({args.draws} draws)")
    for (model, tp), (window_ratios, stall_s) in sorted(starts.items()):
        ratios = " ".join("-" if w is None else f"{w:.2f}" for w in window_ratios)
        print(f"  {model} TP{tp}: stall {stall_s:.2f} s; per 2-s window from 0 s:\n    {ratios}")
    print("first stage's TTFT (ms): observed / as modelled / with the measured start")
    print(f"{'experiment':<30} {'p99':>23} {'p99.9':>23}")
    scored = [s for s in specs.values() if s.observed is not None]
    for spec in sorted(scored, key=lambda s: experiment_label({"name": s.name})):
        dep = resolver.resolve_experiment(spec)
        start = starts.get((dep.model.name, dep.tp))
        if start is None:
            print(f"{experiment_label({'name': spec.name}):<30} no trace of this deployment: no measured start")
            continue
        plain = first_stage_tails(spec, dep, entry, args.draws, None)
        warm = first_stage_tails(spec, dep, entry, args.draws, start)
        cells = [
            f"{spec.observed.stages[0].stat_s('ttft', stat) * 1e3:7.0f}{plain[stat]:8.0f}{warm[stat]:8.0f}"
            for stat in FIRST_STAGE_STATS
        ]
        print(f"{experiment_label({'name': spec.name}):<30} {cells[0]} {cells[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
