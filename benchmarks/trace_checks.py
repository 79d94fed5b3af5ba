"""What the real step traces say about prefill, a fresh server, the queue, slow stretches and the
holdouts: five checks.

1. **Prefill in the traces.** Per experiment: the sampled steps, those that prefill at least
   ``LARGE_PREFILL_TOKENS`` tokens, and those of them with a cycle time (the next step
   sampled too: ``ts_start[i+1] - ts_start[i]``, ``../shared/NOTES.md``). For each of
   those, its cycle time against the least time its own work needs: the larger of its
   matmul FLOPs at the GPU's peak and one read of the weights a GPU holds. A cycle below
   that floor is not that step's GPU time (under asynchronous scheduling it can be another
   step's).
2. **A fresh server's first seconds** (with ``--run-dir`` and ``--id``). Per 2-s window of
   each trace's first seconds, the mean cycle time of every step, sampled or not (from the
   sampled steps' ids and start times), over the archived model's mean step time for the
   window's sampled steps; divided by the median of the same ratio over 5-s windows after
   the first minute. A 2-s window holds 4-16 sampled steps, so its features are noisy:
   the emulator's synthetic traces (``--data primitives/data/embedded``), which have no
   warm-up, are the control. The last two columns span the first 12 s, and the same
   without the first window (where a run's first, cold-cache prefills sit).
3. **The queue at each load stage** (with ``--run-dir`` and ``--id``; traces whose
   experiment folder is in ``../shared/data/experiments``): the real run against the
   archived model simulated, the slot release, a fresh server's first step and the
   arrivals (``trace_queue.py``, which says how each figure is made).
4. **Does a slow step stay slow?** Near ``max_num_seqs`` the queue follows the server's
   capacity over seconds, so slowness that persists from step to step deepens it far more
   than the same scatter step by step. Per pair of consecutive sampled steps
   (``PERSIST_AFTER_S`` on, engine busy at both ends), the log of its mean cycle over the
   median of the ``NEIGHBOURS`` pairs nearest to it in work (decode requests, prefill tokens,
   KV tokens; their ends' mean) and at least ``PERSIST_APART_S`` away in time: no model
   enters, and lasting slowness cannot hide in its own neighbours. The spread (robust:
   1.4826 median absolute deviations) of the pairs one step apart, sd1; for pairs k steps
   apart, their spread times sqrt(k) over sd1 (1: steps independent; above 1: slowness
   persists; below 1: a slow step is followed by a fast one, as jitter in the start stamps
   does); the rank correlation of a pair with the first pair that starts 0.2, 1 and 4 s
   later (within half as much again, and sharing no step with it).
5. **A formula-free reference for each holdout's step MAPE.** The search judges a model on
   each trace's temporal holdout (its last ``VALIDATION_FRACTION`` of steps). Each holdout
   step priced at the median cycle time of its nearest training steps of the same
   experiment in work (``fitness.step_scatter.holdout_reference``), with 15 and 30
   neighbours: what a lookup of like steps gets, with no formula. Not a bound: a formula
   can land a little below it, and it moves with the neighbours counted. Beside it, the
   standard error of a holdout MAPE: how much the figure moves with which steps (a few
   stalls among them) the held-out block holds.

Usage::

    python benchmarks/trace_checks.py [--shared DIR] [--data TRACES]
        [--run-dir D --id ID [--draws N] [--step-scatter TRACES]]
    (checks 1, 4 and 5 need no archived model)
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # trace_queue.py, check 3

from trace_model import archived_entry, model_parser, trace_prices_us  # noqa: E402
from trace_queue import QUEUE_DRAWS, cell, id_rate_cycle_us, queue_by_stage, short  # noqa: E402

from evolve.config import RunConfig  # noqa: E402
from evolve.validation import measured_step_scatter  # noqa: E402
from fitness.dataset import build_step_table  # noqa: E402
from fitness.step_scatter import FEATURES, NEIGHBOURS, holdout_reference, neighbour_ratios, run_scatter  # noqa: E402
from primitives.data.experiments import find_experiments  # noqa: E402
from primitives.data.traces import load_steps  # noqa: E402
from primitives.deployment import default_resolver  # noqa: E402
from primitives.errors import InputError  # noqa: E402

LARGE_PREFILL_TOKENS = 100
STEADY_AFTER_S = 60.0  # the first seconds are compared with the windows after the first minute
STEADY_WINDOW_S = 5.0
WINDOW_S = 2.0
WINDOW_STARTS_S = (0, 2, 4, 6, 8, 10, 12, 14)
SPAN_S = 12.0  # the last columns: every step of the first SPAN_S seconds, and without the first window
PERSIST_AFTER_S = 30.0  # check 4 leaves out the first seconds (a fresh server: check 2)
PERSIST_STEPS = (2, 3, 5, 8, 13)  # pairs this many steps apart
PERSIST_LAGS_S = (0.2, 1.0, 4.0)
PERSIST_APART_S = 10.0  # a pair's reference: pairs of like work at least this far away in time
PERSIST_IDLE = 3.0  # a pair whose mean cycle is this many times its reference had an idle engine between
PERSIST_MIN_PAIRS = 20  # fewer pairs k steps apart give no figure
VALIDATION_FRACTION = RunConfig.validation_fraction  # check 5: the search's default holdout
REFERENCE_NEIGHBOURS = (NEIGHBOURS, 2 * NEIGHBOURS)


def step_floor_us(deployment, tokens: np.ndarray) -> np.ndarray:
    """The least GPU time of a step of TOKENS tokens: its matmul FLOPs at peak, or one read
    of the weights a GPU holds, whichever is longer (attention and the rest only add)."""
    flops = 2 * deployment.model.active_matmul_params / deployment.tp * np.asarray(tokens, dtype=np.float64)
    weights_us = deployment.weight_bytes_per_gpu / deployment.gpu.hbm_bytes_per_s * 1e6
    return np.maximum(flops / deployment.gpu.dense_flops_per_s * 1e6, weights_us)


def prefill_in_traces(steps, resolver) -> list[str]:
    """Check 1: a line per experiment, then one per large-prefill step with a cycle time."""
    out = [
        f"sampled steps that prefill {LARGE_PREFILL_TOKENS}+ tokens; cycle time of those with one",
        f"{'experiment':<26} {'steps':>6} {'large':>6} {'timed':>6} {'prefill':>8} {'cycle ms':>8} {'floor ms':>8}",
    ]
    for name, g in steps.groupby("experiment", sort=True):
        first = g.iloc[0]
        dep = resolver.resolve_in(
            "the step traces", f"experiment {name!r}", first["model"], int(first["tp"]), first["gpu"] or None
        )
        large = g[g["prefill_tokens"] >= LARGE_PREFILL_TOKENS]
        timed = large[np.isfinite(large["cycle_time_us"].to_numpy(dtype=np.float64))]
        out.append(f"{short(name):<26} {len(g):>6} {len(large):>6} {len(timed):>6}")
        floor_us = step_floor_us(dep, timed["prefill_tokens"] + timed["decode_tokens"])
        for prefill, cycle_us, least_us in zip(timed["prefill_tokens"], timed["cycle_time_us"], floor_us, strict=True):
            mark = " below" if cycle_us < least_us else ""
            out.append(f"{'':<47} {prefill:>8.0f} {cycle_us / 1e3:>8.1f} {least_us / 1e3:>8.1f}{mark}")
    return out


def window_cycle(start_s, step_id, busy, model_us, lo_s: float, hi_s: float):
    """(mean cycle µs over every step, mean model time µs of the sampled ones) in [LO_S, HI_S),
    or None with under 3 sampled steps or an idle engine between two of them."""
    k = np.flatnonzero((start_s >= lo_s) & (start_s < hi_s))
    if len(k) < 3 or not busy[k[:-1]].all():  # an empty engine idles: that is no cycle
        return None
    return id_rate_cycle_us(start_s, step_id, k), model_us[k[:-1]].mean()  # the last sample's step is outside


def window_ratio(start_s, step_id, busy, model_us, lo_s: float, hi_s: float) -> float | None:
    """Measured over model mean cycle in [LO_S, HI_S) s (``window_cycle``), or None."""
    w = window_cycle(start_s, step_id, busy, model_us, lo_s, hi_s)
    if w is None or not (np.isfinite(w[1]) and w[1] > 0):  # a model that prices the window at nothing
        return None
    return w[0] / w[1]


def trace_clock(g):
    """(start s from the trace's first step, step ids, engine busy) of one experiment's rows."""
    start_us = g["ts_start_us"].to_numpy(dtype=np.float64)
    busy = (g["num_decode_reqs"].to_numpy() + g["num_prefill_reqs"].to_numpy()) > 0
    return (start_us - start_us.min()) / 1e6, g["step_id"].to_numpy(), busy


def first_seconds(data, entry, model_us: np.ndarray) -> list[str]:
    """Check 2: a line per experiment (MODEL_US: the entry's price of every sampled step)."""
    head = " ".join(f"{w:>4}" for w in WINDOW_STARTS_S)
    out = [
        f"measured / {entry.id}'s step time, over the same after {STEADY_AFTER_S:.0f} s",
        f"{'experiment':<26} {head} {f'0-{SPAN_S:.0f}':>5} {f'{WINDOW_S:.0f}-{SPAN_S:.0f}':>5}",
    ]
    for name in sorted(data.steps["experiment"].unique()):
        rows = (data.steps["experiment"] == name).to_numpy()
        got = warm_up(data.steps.loc[rows], model_us[rows])
        if got is None:
            out.append(f"{short(name):<26} no steady windows after {STEADY_AFTER_S:.0f} s")
            continue
        windows, spans = got
        text = " ".join(cell(w, 4, ".2f") for w in windows)
        tail = " ".join(cell(w, 5, ".3f") for w in spans)
        out.append(f"{short(name):<26} {text} {tail}")
    return out


def warm_up(g, model_us: np.ndarray) -> tuple[list[float | None], list[float | None]] | None:
    """One trace's first seconds: per window of ``WINDOW_STARTS_S`` its measured over model
    cycle, and the same over the spans from 0 and from ``WINDOW_S`` to ``SPAN_S``, each over
    the median of the ``STEADY_WINDOW_S`` windows after ``STEADY_AFTER_S`` (None where a
    window has too few steps; None without steady windows). MODEL_US: the model's price of
    each of the trace's sampled steps G."""
    start_s, step_id, busy = trace_clock(g)
    ratio = partial(window_ratio, start_s, step_id, busy, model_us)
    steady = [ratio(lo, lo + STEADY_WINDOW_S) for lo in np.arange(STEADY_AFTER_S, start_s.max(), STEADY_WINDOW_S)]
    steady = [r for r in steady if r is not None]
    if not steady:
        return None
    base = float(np.median(steady))
    windows = [ratio(lo, lo + WINDOW_S) for lo in WINDOW_STARTS_S]
    spans = [ratio(lo, SPAN_S) for lo in (0.0, WINDOW_S)]
    return [w / base if w is not None else None for w in windows], [w / base if w is not None else None for w in spans]


def pair_residuals(start_s, step_id, busy, work):
    """Per pair of consecutive sampled steps kept by check 4: (steps apart, start s, log of
    the mean cycle over its reference). The steps in time order (``load_steps`` sorts and
    checks them); ``work``: (rows, 3) decode requests, prefill tokens and KV tokens of each;
    a pair's is its ends' mean. Its reference: the median mean cycle of the ``NEIGHBOURS``
    pairs nearest in work, ``PERSIST_APART_S`` or more away (none where under half qualify)."""
    apart = np.diff(step_id)
    with np.errstate(divide="ignore", invalid="ignore"):
        cycle_us = np.diff(start_s) * 1e6 / apart
    keep = (apart > 0) & busy[:-1] & busy[1:] & (start_s[:-1] >= PERSIST_AFTER_S) & (cycle_us > 0)
    keep &= np.isfinite(cycle_us)
    if keep.sum() <= NEIGHBOURS:
        return apart[:0], start_s[:0], cycle_us[:0]
    pair_work = ((work[:-1] + work[1:]) / 2)[keep]
    ratio = neighbour_ratios(pair_work, cycle_us[keep], start_s[:-1][keep], PERSIST_APART_S)
    ok = np.isfinite(ratio) & (ratio < PERSIST_IDLE)  # an idle engine between two samples: no cycle
    return apart[keep][ok], start_s[:-1][keep][ok], np.log(ratio[ok])


def robust_sd(values: np.ndarray) -> float:
    """The spread of VALUES' body: median absolute deviations scaled to a normal's sd (a few
    stalls do not move it)."""
    from scipy.stats import median_abs_deviation

    return float(median_abs_deviation(values, scale="normal"))


def persistence(apart, start_s, residual) -> dict | None:
    """Check 4's figures of one experiment (``pair_residuals``), or None with too few pairs
    one step apart: ``sd1`` (their spread), ``ratio[k]`` per ``PERSIST_STEPS`` and
    ``corr[lag]`` per ``PERSIST_LAGS_S`` (None where too few pairs)."""
    from scipy.stats import spearmanr  # ranks: a few stalls do not make a correlation

    one = residual[apart == 1]
    if len(one) < PERSIST_MIN_PAIRS or robust_sd(one) <= 0:
        return None
    sd1 = robust_sd(one)
    ratio = {}
    for k in PERSIST_STEPS:
        r = residual[apart == k]
        ratio[k] = robust_sd(r) * np.sqrt(k) / sd1 if len(r) >= PERSIST_MIN_PAIRS else None
    corr = {}
    index = np.arange(len(start_s))
    for lag in PERSIST_LAGS_S:
        later = np.searchsorted(start_s, start_s + lag)  # the first pair starting LAG s later
        later = np.maximum(later, index + 2)  # pair i + 1 shares a step (and its stamp) with pair i
        ok = later < len(start_s)
        ok[ok] &= start_s[later[ok]] - start_s[ok] <= 1.5 * lag  # not across a long gap
        enough = ok.sum() >= PERSIST_MIN_PAIRS
        corr[lag] = float(spearmanr(residual[ok], residual[later[ok]])[0]) if enough else None
    return {"sd1": sd1, "ratio": ratio, "corr": corr}


def slow_stretches(steps) -> list[str]:
    """Check 4: a line per experiment."""
    head = " ".join(f"{f'k={k}':>5}" for k in PERSIST_STEPS)
    lags = " ".join(f"{f'{lag:g}s':>5}" for lag in PERSIST_LAGS_S)
    ks = ", ".join(str(k) for k in PERSIST_STEPS)
    when = ", ".join(f"{lag:g}" for lag in PERSIST_LAGS_S)
    out = [
        "does a slow step stay slow? per pair of sampled steps k apart, log(cycle /",
        f"like work >= {PERSIST_APART_S:g} s away). sd1: its spread at k = 1; k = {ks}: the",
        "spread x sqrt(k) / sd1 (1: independent steps; above: slowness persists);",
        f"{when} s: rank correlation with the pair that starts that much later",
        f"{'experiment':<26} {'sd1':>5} {head} {lags}",
    ]
    for name, g in steps.groupby("experiment", sort=True):  # load_steps keeps each trace in time order
        work = g[["num_decode_reqs", "prefill_tokens", "kv_tokens"]].to_numpy(dtype=np.float64)
        p = persistence(*pair_residuals(*trace_clock(g), work))
        if p is None:
            out.append(f"{short(name):<26} under {PERSIST_MIN_PAIRS} pairs of consecutive steps")
            continue
        ratios = " ".join(cell(p["ratio"][k], 5, ".2f") for k in PERSIST_STEPS)
        corrs = " ".join(cell(p["corr"][lag], 5, ".2f") for lag in PERSIST_LAGS_S)
        out.append(f"{short(name):<26} {cell(p['sd1'], 5, '.3f')} {ratios} {corrs}")
    return out


def holdout_references(data, resolver) -> list[str]:
    """Check 5: a line per experiment with a holdout."""
    table = build_step_table(data, resolver, list(FEATURES), VALIDATION_FRACTION)
    references = [holdout_reference(table, k) for k in REFERENCE_NEIGHBOURS]
    k1, k2 = REFERENCE_NEIGHBOURS
    out = [
        f"the last {VALIDATION_FRACTION:.0%} of each trace priced by its nearest earlier steps, no formula:",
        "a reference for a holdout's step MAPE (%), and that MAPE's standard error",
        f"{'experiment':<26} {'held out':>8} {f'{k1} nearest':>10} {f'{k2} nearest':>10} {'std err':>7}",
    ]
    for name, (rows, reference, se) in references[0].items():
        other = references[1].get(name)
        wider = f"{other[1]:>10.2f}" if other is not None else f"{'—':>10}"
        out.append(f"{short(name):<26} {rows:>8} {reference:>10.2f} {wider} {se:>7.2f}")
    if not references[0]:
        out.append(f"no experiment with a holdout and {k1} or more earlier steps")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = model_parser("trace_checks.py", __doc__, QUEUE_DRAWS, required=False)  # the model: checks 2 and 3
    ap.add_argument("--data", type=Path, help="step traces to check (default: the shared folder's data/steps)")
    ap.add_argument(
        "--step-scatter",
        type=Path,
        help="check 3: the simulated steps scatter as these traces' do (default: as the archived run's)",
    )
    args = ap.parse_args(argv)
    if (args.run_dir is None) != (args.id is None):
        ap.error("--run-dir and --id: give both (checks 2 and 3) or neither")
    if args.run_dir is None and (args.step_scatter is not None or args.draws is not None):
        ap.error("--draws and --step-scatter are options of check 3: give --run-dir and --id too")
    steps_dir = args.data or args.shared / "data" / "steps"
    experiments = args.shared / "data" / "experiments"
    try:  # every input is read and every table is made before anything is printed
        entry = archived_entry(args.run_dir, args.id) if args.run_dir is not None else None
        try:
            data = load_steps([steps_dir])
        except InputError as err:
            option = "--data" if args.data is not None else "--shared"
            raise InputError(err.path, err.field, f"{err.expected} ({option})") from None
        resolver = default_resolver()
        scatter = run_scatter(entry.run_config) if entry is not None else None
        if args.step_scatter is not None:
            try:
                scatter = measured_step_scatter(args.step_scatter, resolver)
            except InputError as err:
                raise InputError(err.path, err.field, f"{err.expected} (--step-scatter)") from None
        tables = [prefill_in_traces(data.steps, resolver), slow_stretches(data.steps)]
        tables.append(holdout_references(data, resolver))
        if entry is not None:
            prices_us = trace_prices_us(data, resolver, entry, experiments if experiments.is_dir() else None)
            tables.append(first_seconds(data, entry, prices_us))
            specs = {s.name: s for s in find_experiments(experiments)} if experiments.is_dir() else {}
            tables.append(queue_by_stage(data, specs, resolver, entry, args.draws or QUEUE_DRAWS, scatter))
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n\n".join("\n".join(table) for table in tables))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
