"""What would make the simulated queue at a knee as long as the real one: the model at the
trace's cycle time with its steps disturbed, and what the trace says of those disturbances.

At a load stage where the batch fills its ``max_num_seqs`` slots (a knee), the simulator at
the trace's own cycle time queues less than the real server (``trace_checks.py``, check 3).
Two disturbances lengthen a queue without changing the mean cycle time:

* **stalls**: now and then a step takes longer. Every step's time is scaled by
  ``(1 + m * stalled) / (1 + p * m)``, mean 1, where ``m`` is the stall (s) over the stage's
  cycle and ``p`` the chance of a stall per step, set so that stalls take the given share
  of the time. A stall is ``m`` times its own step's modelled time, and the normalisation
  takes that share off every step: at 2% a 0.44 s stall adds about 0.43 s;
* **drift**: every step's time scaled by ``1 + x``, ``x`` a first-order autoregressive series
  of standard deviation ``sd`` whose correlation lasts ``tau`` seconds (in steps at the
  stage's cycle).

Each what-if row: the stage's mean TTFT over the draws (their range), the requests present's
correlation with the count 8 s later (``trace_queue.lagged_correlation``), and the cycle.

The trace's side, with the model's price of every sampled step: the largest excess of the
time between two sampled steps over the price of the steps between them (a stall shows whole
there, whichever steps were sampled), and the spread of real over priced time in 5 and 10 s
windows (drift shows there, with the model's own errors added).

Usage::

    python benchmarks/knee_whatif.py --run-dir D --id ID [--draws N] [--shared DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # trace_queue.py

from trace_model import archived_entry, model_parser, trace_prices_us  # noqa: E402
from trace_queue import (  # noqa: E402
    MEMORY_LAG_S,
    QUEUE_SKIP_S,
    SCALE_MATCH,
    match_cycle,
    mean_stats,
    short,
    stage_draws,
    stage_stats,
    trace_series,
    trace_stage_starts_s,
)

from primitives.data.experiments import find_experiments  # noqa: E402
from primitives.data.traces import load_steps  # noqa: E402
from primitives.deployment import default_resolver  # noqa: E402
from primitives.errors import InputError  # noqa: E402
from primitives.language import scaled_expression  # noqa: E402

DRAWS = 6
WHATIF_SEED = 7  # the disturbances' own randomness, apart from the load's
SCALES = 1 << 18  # step multipliers per run: more steps than a 1,200 s run takes at 5 ms
STALLS = ((0.1, 0.01), (0.44, 0.01), (0.44, 0.02))  # (stall s, share of time stalled)
DRIFTS = ((0.01, 10.0), (0.02, 10.0))  # (sd, correlation time s)
WINDOWS_S = (5.0, 10.0)


class Stalls:
    """Step multipliers with a stall of MULTIPLE steps' time at a chance per step that stalls
    SHARE of the time; mean 1."""

    def __init__(self, multiple: float, share: float):
        self.multiple, self.chance = multiple, share / (multiple * (1.0 - share))

    def scales(self, seed: int, n: int = SCALES) -> np.ndarray:
        stalled = np.random.default_rng([WHATIF_SEED, seed]).random(n) < self.chance
        return (1.0 + self.multiple * stalled) / (1.0 + self.chance * self.multiple)


class Drift:
    """Step multipliers 1 + x, x autoregressive with standard deviation SD and correlation
    time TAU_STEPS; mean 1 (clipped at 0.5, far beyond any SD used here)."""

    def __init__(self, sd: float, tau_steps: float):
        self.sd, self.keep = sd, float(np.exp(-1.0 / max(tau_steps, 1e-9)))

    def scales(self, seed: int, n: int = SCALES) -> np.ndarray:
        from scipy.signal import lfilter

        shocks = np.random.default_rng([WHATIF_SEED, seed]).normal(size=n) * self.sd * np.sqrt(1 - self.keep**2)
        drift = lfilter([1.0], [1.0, -self.keep], shocks)
        return np.clip(1.0 + drift, 0.5, None)


def knee_stage(real, starts_s: list[float], spec) -> int | None:
    """The stage whose real steps most often hold every slot (None: no stage ever fills them)."""
    full = []
    for i, (_, duration_s) in enumerate(spec.stages):
        stats = stage_stats(real, starts_s[i] + QUEUE_SKIP_S, starts_s[i] + duration_s, spec.max_num_seqs)
        full.append(stats["full"] if stats is not None and np.isfinite(stats["full"]) else 0.0)
    return int(np.argmax(full)) if max(full, default=0.0) > 0 else None


def interval_excess(start_s, step_id, priced_s, lo_s: float, hi_s: float) -> tuple[float, dict[float, float]]:
    """Between consecutive sampled steps in [LO_S, HI_S): the largest time beyond the price of
    the steps between them (each priced at the mean of its two ends', PRICED_S), in s; and per
    window of ``WINDOWS_S`` (every whole one) the standard deviation of real over priced time,
    relative to its median."""
    dt_s, steps = np.diff(start_s), np.diff(step_id)
    between_s = steps * 0.5 * (priced_s[:-1] + priced_s[1:])
    inside = (start_s[:-1] >= lo_s) & (start_s[1:] < hi_s) & np.isfinite(between_s)
    largest = float((dt_s - between_s)[inside].max()) if inside.any() else float("nan")
    spread = {}
    for width in WINDOWS_S:
        ratios = []
        for a in np.arange(lo_s, hi_s - width + 1e-9, width):
            k = inside & (start_s[:-1] >= a) & (start_s[1:] < a + width)
            if k.sum() >= 3:
                ratios.append(dt_s[k].sum() / between_s[k].sum())
        spread[width] = float(np.std(ratios) / np.median(ratios)) if len(ratios) >= 3 else float("nan")
    return largest, spread


def whatif_lines(spec, dep, entry, draws: int, i: int, cycle_ms: float, observed_ms: float) -> list[str]:
    """The what-if table of stage I: the model at CYCLE_MS, alone and disturbed."""
    model = stage_draws(spec, dep, entry.expression, entry.overheads, None, i, draws)
    factor, at_cycle, matched = match_cycle(spec, dep, entry, draws, None, i, cycle_ms, model)
    if matched is None or abs(matched["cycle_ms"] / cycle_ms - 1) > SCALE_MATCH:
        return [f"  no fit: x{factor:.3g} does not put the simulated cycle on the trace's {cycle_ms:.2f} ms"]
    expression = scaled_expression(entry.expression, factor)
    steps_per_s = 1e3 / cycle_ms
    cases = [("as modelled", None)]
    cases += [(f"stalls {s:g} s, {share:.0%} of time", Stalls(s * steps_per_s, share)) for s, share in STALLS]
    cases += [(f"drift sd {sd:.0%}, {tau:g} s", Drift(sd, tau * steps_per_s)) for sd, tau in DRIFTS]
    lines = [
        f"  the model at the trace's cycle time (x{factor:.3f}), {draws} draws; real TTFT {observed_ms:.1f} ms",
        f"  {'what if':<28} {'TTFT ms':>8} {'draws':>11} {f'{MEMORY_LAG_S:g} s later':>9} {'cycle ms':>8}",
    ]
    for label, disturbance in cases:
        got = (
            at_cycle
            if disturbance is None
            else stage_draws(spec, dep, expression, entry.overheads, disturbance, i, draws)
        )
        ttft = np.array([d.ttft_ms for d in got])
        stats = mean_stats([d.stats for d in got]) or {"memory": float("nan"), "cycle_ms": float("nan")}
        spread = f"{np.nanmin(ttft):.0f}-{np.nanmax(ttft):.0f}"
        lines.append(
            f"  {label:<28} {np.nanmean(ttft):8.1f} {spread:>11} {stats['memory']:9.3f} {stats['cycle_ms']:8.2f}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = model_parser("knee_whatif.py", __doc__, DRAWS).parse_args(argv)
    experiments = args.shared / "data" / "experiments"
    try:
        entry = archived_entry(args.run_dir, args.id)
        data = load_steps([args.shared / "data" / "steps"])
        resolver = default_resolver()
        specs = {s.name: s for s in find_experiments(experiments)}
        priced_s = trace_prices_us(data, resolver, entry, experiments) / 1e6
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for name in sorted(data.steps["experiment"].unique()):
        spec = specs.get(name)
        rows = (data.steps["experiment"] == name).to_numpy()
        trace = data.steps.loc[rows]
        real = trace_series(trace)
        starts_s = trace_stage_starts_s(real, [d for _, d in spec.stages]) if spec is not None else None
        i = knee_stage(real, starts_s, spec) if starts_s is not None else None
        if i is None:
            print(f"{short(name)}: no knee (no stage fills its slots, or no folder)\n")
            continue
        rate, duration_s = spec.stages[i]
        lo_s, hi_s = starts_s[i] + QUEUE_SKIP_S, starts_s[i] + duration_s
        cycle_ms = stage_stats(real, lo_s, hi_s, spec.max_num_seqs)["cycle_ms"]
        largest_s, spread = interval_excess(real.start_s, real.step_id, priced_s[rows], lo_s, hi_s)
        observed = spec.observed.stages[i].ttft_mean_s * 1e3 if spec.observed else float("nan")
        print(f"{short(name)}, stage {i + 1} at {rate:g} req/s, from {QUEUE_SKIP_S:.0f} s in")
        windows = ", ".join(f"{w:g} s {100 * v:.2f}%" for w, v in spread.items())
        print(f"  trace: largest time between sampled steps beyond {entry.id}'s price {1e3 * largest_s:.0f} ms;")
        print(f"  real over priced time, sd over windows of {windows}")
        dep = resolver.resolve_experiment(spec)
        print("\n".join(whatif_lines(spec, dep, entry, args.draws, i, cycle_ms, observed)))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
