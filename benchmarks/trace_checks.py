"""What the real step traces say beyond a fit: three checks, printed as tables.

1. **Which step's prefill a cycle time carries.** A trace's cycle time of step i is
   ``ts_start[i+1] - ts_start[i]`` (``../shared/NOTES.md``). Least squares of it on step
   i's decode tokens and on the prefill tokens of step i and i+1 (pairs of sampled steps),
   and of step i-1 too (triples, about a tenth as many): µs per prefill token, ± one
   standard error. The FLOP bound of a prefill token (2 × matmul parameters per GPU over
   the peak) is beside it.
2. **A fresh server's first seconds** (with ``--run-dir`` and ``--id``): the mean cycle time
   of every step (sampled or not: from the sampled steps' ids and start times) in the
   first seconds of each trace, over the archived model's mean step time for the sampled
   steps of the same window, relative to the same ratio over 5-s windows after the first
   minute. Windows of 2 s hold 5-10 sampled steps, so their features are noisy.
3. **How stalls scale**: each step's cycle time over the median of its neighbours' in
   (decode requests, prefill tokens, KV tokens) (``fitness.step_scatter``), as a ratio and
   as the excess in ms.

Usage::

    python benchmarks/trace_checks.py [--shared DIR] [--data TRACES] [--run-dir D --id ID]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from archive.rundir import RunDir  # noqa: E402
from archive.store import ArchiveStore  # noqa: E402
from fitness.dataset import build_step_table  # noqa: E402
from fitness.kv_sharing import trace_kv_sharing  # noqa: E402
from fitness.step_scatter import FEATURES, neighbour_ratios  # noqa: E402
from primitives.data.roots import shared_data_root  # noqa: E402
from primitives.data.traces import load_steps  # noqa: E402
from primitives.deployment import default_resolver  # noqa: E402
from primitives.language import evaluate_expr, parse_infix  # noqa: E402

STEADY_AFTER_S = 60.0
WINDOWS_S = (0, 2, 4, 6, 8, 10, 12, 14)


def short(experiment: str) -> str:
    """An experiment's name without its date and time stamp, at most 26 characters (its end,
    where the workload is)."""
    parts = str(experiment).split("-", 2)
    name = parts[2] if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit() else str(experiment)
    return name if len(name) <= 26 else "…" + name[-25:]


def ols(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Coefficients and their standard errors; NaN where the rows cannot tell them (too few,
    or a column that never varies, as a trace without prefill)."""
    nan = np.full(X.shape[1], np.nan)
    if len(y) <= X.shape[1] or np.linalg.matrix_rank(X) < X.shape[1]:
        return nan, nan
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ coef
    s2 = resid @ resid / (len(y) - X.shape[1])
    return coef, np.sqrt(np.diag(s2 * np.linalg.inv(X.T @ X)))


def prefill_alignment(steps, resolver) -> list[str]:
    """Check 1, one line per experiment."""
    out = [
        "µs per prefill token in a trace's cycle time of step i (± 1 s.e.)",
        f"{'experiment':<26} {'pairs':>5} {'step i':>11} {'step i+1':>11} {'triples':>6} {'step i-1':>10} {'FLOP':>4}",
    ]
    for name, g in steps.groupby("experiment", sort=True):
        ids = g["step_id"].to_numpy()
        ts = g["ts_start_us"].to_numpy(dtype=np.float64)
        pre = g["prefill_tokens"].to_numpy(dtype=np.float64)
        dec = g["decode_tokens"].to_numpy(dtype=np.float64)
        row = {v: i for i, v in enumerate(ids)}
        pairs = [(i, row[v + 1], row.get(v - 1)) for i, v in enumerate(ids) if v + 1 in row]
        i, j = (np.array([p[k] for p in pairs]) for k in (0, 1))
        cycle = ts[j] - ts[i]
        c2, se2 = ols(np.column_stack([np.ones(len(i)), dec[i], pre[i], pre[j]]), cycle)
        tri = [(a, b, c) for a, b, c in pairs if c is not None]
        a, b, c = (np.array([t[k] for t in tri]) for k in (0, 1, 2))
        c3, se3 = ols(np.column_stack([np.ones(len(a)), dec[a], pre[c], pre[a], pre[b]]), ts[b] - ts[a])
        first = g.iloc[0]
        dep = resolver.resolve(first["model"], int(first["tp"]), first["gpu"] or None)
        flop_us = 2 * dep.model.active_matmul_params / dep.tp / dep.gpu.dense_flops_per_s * 1e6

        def cell(v, s):
            if not np.isfinite(v):
                return f"{'-':>11}"
            return f"{v:6.1f}±{s:<4.1f}" if abs(v) < 1000 and s < 100 else f"{v:6.0f}±{s:<4.0f}"

        out.append(
            f"{short(name):<26} {len(i):>5} {cell(c2[2], se2[2])} {cell(c2[3], se2[3])} {len(a):>6} "
            f"{cell(c3[2], se3[2])}{flop_us:5.1f}"
        )
    return out


def window_cycle(ts_s, ids, busy, pred_us, lo: float, hi: float):
    """(mean cycle µs over every step, mean model time of the sampled ones) in [LO, HI) s, or None."""
    k = np.flatnonzero((ts_s >= lo) & (ts_s < hi))
    if len(k) < 3 or not busy[k[:-1]].all():  # an idle engine between two samples is no cycle
        return None
    return (ts_s[k[-1]] - ts_s[k[0]]) * 1e6 / (ids[k[-1]] - ids[k[0]]), pred_us[k[:-1]].mean()


def window_ratio(ts_s, ids, busy, pred_us, lo: float, hi: float) -> float | None:
    """Measured over model mean cycle in [LO, HI) s (``window_cycle``), or None."""
    w = window_cycle(ts_s, ids, busy, pred_us, lo, hi)
    return None if w is None else w[0] / w[1]


def first_seconds(data, resolver, entry, kv_sharing) -> list[str]:
    """Check 2, one line per experiment."""
    expr = parse_infix(entry.expression)
    names = sorted(s.name for s in expr.free_symbols)
    every = replace(data, steps=data.steps.assign(cycle_time_us=data.steps["cycle_time_us"].fillna(-1.0)))
    table = build_step_table(every, resolver, names, 0.0, kv_sharing)  # every sampled step, in the data's order
    pred = evaluate_expr(expr, table.columns)
    head = " ".join(f"{w:>4}" for w in WINDOWS_S)
    out = [
        f"measured / {entry.id}'s step time, over the same after {STEADY_AFTER_S:.0f} s; 2-s windows",
        f"{'experiment':<26} {head} {'0-12':>5}",
    ]
    for e, name in enumerate(table.experiment_names):
        rows = table.experiment == e
        g = data.steps.loc[data.steps["experiment"] == name]
        ts = g["ts_start_us"].to_numpy(dtype=np.float64)
        ts = (ts - ts.min()) / 1e6
        ids = g["step_id"].to_numpy()
        busy = (g["num_decode_reqs"].to_numpy() + g["num_prefill_reqs"].to_numpy()) > 0
        ratio = partial(window_ratio, ts, ids, busy, pred[rows])

        steady = [ratio(lo, lo + 5) for lo in np.arange(STEADY_AFTER_S, ts.max(), 5.0)]
        base = float(np.median([r for r in steady if r is not None]))
        cells = [ratio(lo, lo + 2) for lo in WINDOWS_S]
        text = " ".join(f"{c / base:4.2f}" if c is not None else "   -" for c in cells)
        out.append(f"{short(name):<26} {text} {ratio(0, 12) / base:5.3f}")
    return out


def stall_scaling(data, resolver) -> list[str]:
    """Check 3, one line per experiment."""
    table = build_step_table(data, resolver, None, 0.0)
    out = [
        "a step's cycle time over its neighbours' median: ratio, and excess (ms)",
        f"{'experiment':<26} {'median':>6} {'p95':>5} {'p99':>5} {'p99.5':>5} {'p95 ms':>6} {'p99 ms':>6} {'p99.5':>6}",
    ]
    for e, name in enumerate(table.experiment_names):
        rows = table.experiment == e
        feats = np.column_stack([table.columns[f][rows] for f in FEATURES]).astype(np.float64)
        cycle = table.cycle_time_us[rows].astype(np.float64)
        r = neighbour_ratios(feats, cycle)
        excess_ms = (cycle - cycle / r) / 1e3
        qr = np.percentile(r, [95, 99, 99.5])
        qe = np.percentile(excess_ms, [95, 99, 99.5])
        out.append(
            f"{short(name):<26} {np.median(cycle) / 1e3:6.1f} "
            + " ".join(f"{v:5.2f}" for v in qr)
            + " "
            + " ".join(f"{v:6.2f}" for v in qe)
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=Path, default=shared_data_root(), help="the shared folder (default ../shared)")
    ap.add_argument("--data", type=Path, help="step traces to check (default: the shared folder's data/steps)")
    ap.add_argument("--run-dir", help="run directory of the archived model for check 2")
    ap.add_argument("--id", help="archive entry id (or prefix) for check 2")
    args = ap.parse_args(argv)
    steps_dir = args.data or args.shared / "data" / "steps"
    experiments = args.shared / "data" / "experiments"
    if not steps_dir.exists():
        print(f"{steps_dir}: no step traces there ({'--data' if args.data else '--shared'})", file=sys.stderr)
        return 2
    resolver = default_resolver()
    data = load_steps([steps_dir])
    print("\n".join(prefill_alignment(data.steps, resolver)) + "\n")
    if args.run_dir and args.id:
        with ArchiveStore(RunDir(Path(args.run_dir)).archive, create=False, read_only=True) as store:
            entry = store.get(args.id)
        seed = int((entry.run_config or {}).get("seed") or 0)
        sharing = trace_kv_sharing(data, experiments, resolver, seed) if experiments.is_dir() else None
        print("\n".join(first_seconds(data, resolver, entry, sharing)) + "\n")
    print("\n".join(stall_scaling(data, resolver)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
