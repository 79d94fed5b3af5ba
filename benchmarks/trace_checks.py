"""What the real step traces say about prefill, a fresh server and the queue: three checks.

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

Usage::

    python benchmarks/trace_checks.py [--shared DIR] [--data TRACES]
        [--run-dir D --id ID [--draws N] [--step-scatter TRACES]]
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # trace_queue.py, check 3

from trace_queue import QUEUE_DRAWS, cell, id_rate_cycle_us, queue_by_stage, short  # noqa: E402

from archive.rundir import RunDir  # noqa: E402
from archive.store import ArchiveStore  # noqa: E402
from evolve.cli_parser import OneLineParser, load_draws_arg  # noqa: E402
from evolve.validation import measured_step_scatter  # noqa: E402
from fitness.dataset import build_step_table  # noqa: E402
from fitness.kv_sharing import run_seed, trace_kv_sharing  # noqa: E402
from fitness.step_scatter import run_scatter  # noqa: E402
from primitives.data.experiments import find_experiments  # noqa: E402
from primitives.data.roots import shared_data_root  # noqa: E402
from primitives.data.traces import load_steps  # noqa: E402
from primitives.deployment import default_resolver  # noqa: E402
from primitives.errors import InputError  # noqa: E402
from primitives.language import evaluate_expr, parse_infix  # noqa: E402

LARGE_PREFILL_TOKENS = 100
STEADY_AFTER_S = 60.0  # the first seconds are compared with the windows after the first minute
STEADY_WINDOW_S = 5.0
WINDOW_S = 2.0
WINDOW_STARTS_S = (0, 2, 4, 6, 8, 10, 12, 14)
SPAN_S = 12.0  # the last columns: every step of the first SPAN_S seconds, and without the first window


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


def first_seconds(data, resolver, entry, kv_sharing) -> list[str]:
    """Check 2: a line per experiment."""
    expr = parse_infix(entry.expression)
    names = sorted(s.name for s in expr.free_symbols)
    table = build_step_table(data, resolver, names, 0.0, kv_sharing, every_step=True)
    model_us = evaluate_expr(expr, table.columns, table.n)
    head = " ".join(f"{w:>4}" for w in WINDOW_STARTS_S)
    out = [
        f"measured / {entry.id}'s step time, over the same after {STEADY_AFTER_S:.0f} s",
        f"{'experiment':<26} {head} {f'0-{SPAN_S:.0f}':>5} {f'{WINDOW_S:.0f}-{SPAN_S:.0f}':>5}",
    ]
    for e, name in enumerate(table.experiment_names):
        g = data.steps.loc[data.steps["experiment"] == name]  # the table keeps the data's row order
        start_us = g["ts_start_us"].to_numpy(dtype=np.float64)
        start_s = (start_us - start_us.min()) / 1e6
        busy = (g["num_decode_reqs"].to_numpy() + g["num_prefill_reqs"].to_numpy()) > 0
        ratio = partial(window_ratio, start_s, g["step_id"].to_numpy(), busy, model_us[table.experiment == e])
        steady = [ratio(lo, lo + STEADY_WINDOW_S) for lo in np.arange(STEADY_AFTER_S, start_s.max(), STEADY_WINDOW_S)]
        steady = [r for r in steady if r is not None]
        if not steady:
            out.append(f"{short(name):<26} no steady windows after {STEADY_AFTER_S:.0f} s")
            continue
        base = float(np.median(steady))
        windows = [ratio(lo, lo + WINDOW_S) for lo in WINDOW_STARTS_S]
        text = " ".join(cell(w / base if w is not None else None, 4, ".2f") for w in windows)
        spans = [ratio(lo, SPAN_S) for lo in (0.0, WINDOW_S)]
        tail = " ".join(cell(w / base if w is not None else None, 5, ".3f") for w in spans)
        out.append(f"{short(name):<26} {text} {tail}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python benchmarks/trace_checks.py", description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=Path, default=shared_data_root(), help="the shared folder (default ../shared)")
    ap.add_argument("--data", type=Path, help="step traces to check (default: the shared folder's data/steps)")
    ap.add_argument("--run-dir", type=Path, help="run directory of the archived model for checks 2 and 3 (with --id)")
    ap.add_argument("--id", help="archive entry id (or prefix) for checks 2 and 3 (with --run-dir)")
    ap.add_argument("--draws", type=load_draws_arg, help=f"check 3: draws of the load (default {QUEUE_DRAWS})")
    ap.add_argument(
        "--step-scatter",
        type=Path,
        help="check 3: the simulated steps scatter as these traces' do (default: as the archived run's)",
    )
    args = ap.parse_args(argv)
    if (args.run_dir is None) != (args.id is None):
        print("--run-dir and --id: give both (checks 2 and 3) or neither", file=sys.stderr)
        return 2
    if args.run_dir is None and (args.step_scatter is not None or args.draws is not None):
        print("--draws and --step-scatter are options of check 3: give --run-dir and --id too", file=sys.stderr)
        return 2
    steps_dir = args.data or args.shared / "data" / "steps"
    experiments = args.shared / "data" / "experiments"
    try:  # every input is read and all three tables are made before anything is printed
        entry = None
        if args.run_dir is not None:
            archive = RunDir(args.run_dir).archive
            if not archive.is_file():
                raise InputError(archive, None, "no archive there (--run-dir)")
            with ArchiveStore(archive, create=False, read_only=True) as store:
                entry = store.get(args.id)
        data = load_steps([steps_dir])
        resolver = default_resolver()
        scatter = run_scatter(entry.run_config) if entry is not None else None
        if args.step_scatter is not None:
            try:
                scatter = measured_step_scatter(args.step_scatter, resolver)
            except InputError as err:
                raise InputError(err.path, err.field, f"{err.expected} (--step-scatter)") from None
        tables = [prefill_in_traces(data.steps, resolver)]
        if entry is not None:
            seed = run_seed(entry.run_config)
            sharing = trace_kv_sharing(data, experiments, resolver, seed) if experiments.is_dir() else None
            tables.append(first_seconds(data, resolver, entry, sharing))
            specs = {s.name: s for s in find_experiments(experiments)} if experiments.is_dir() else {}
            tables.append(queue_by_stage(data, specs, resolver, entry, args.draws or QUEUE_DRAWS, scatter))
    except InputError as err:
        print(err, file=sys.stderr)
        return 2
    print("\n\n".join("\n".join(table) for table in tables))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
