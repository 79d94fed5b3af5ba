"""Fitness evaluations per second: 500 random trees on 100k step rows, fused and plain, 1 job and 2.

    python benchmarks/bench_fitness.py [--rows 100000] [--population 500]

Every evaluation fits the coefficients and scores the errors. The same trees are scored
the plain way (one numpy array per node, ``score_program(..., fused=False)``) and the
fused way (``fitness.fused``) in the same run, so the speed-up reads as a ratio on any
machine, however busy. Each term's unit check (sympy, memoised per term as in a search,
where terms recur) is warmed first and timed apart: it is not the evaluation. Prints
figures; it asserts nothing (speed is shown here, never in timed tests).
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evolve.cli_parser import OneLineParser, positive_int  # noqa: E402

if TYPE_CHECKING:
    from fitness.dataset import StepTable


def synthetic_table(n_rows: int, seed: int = 0) -> StepTable:
    """Random but plausible batches over the four deployments, with a physics target."""
    from fitness.dataset import StepTable
    from primitives.compute import constant_columns, kernel_binding, primitive_columns
    from primitives.deployment import default_resolver
    from primitives.registry import AGGREGATE_FEATURES, supported_primitives

    rng = np.random.default_rng(seed)
    r = default_resolver()
    deps = [
        r.resolve(m, tp)
        for m, tp in [("llama-2-7b", 1), ("llama-2-70b", 4), ("codellama-34b", 2), ("mixtral-8x7b-v0-1", 2)]
    ]
    exp = rng.integers(0, 4, n_rows)
    decode = rng.integers(1, 128, n_rows).astype(float)
    feats = {
        "decode_tokens": decode,
        "num_decode_reqs": decode,
        "prefill_tokens": rng.choice([0.0, 16.0, 500.0, 2000.0], n_rows),
        "num_prefill_reqs": rng.integers(0, 3, n_rows).astype(float),
        "kv_tokens": decode * rng.uniform(300, 900, n_rows),
    }
    names = supported_primitives(AGGREGATE_FEATURES)
    cols = primitive_columns(feats, constant_columns(deps, exp), names, kernel_binding(names, deps, exp))
    target = 1.3 * cols["weight_time_us"] + 1.5 * cols["kv_io_time_us"] + 40 * cols["allreduce_calls"] + 1500
    target *= rng.lognormal(0, 0.03, n_rows)
    return StepTable(
        cols, target, exp, [f"exp{i}" for i in range(4)], rng.random(n_rows) < 0.8, names, deps, [0, 1, 2, 3], "bench"
    )


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _wall_and_cpu(fn) -> tuple[float, float]:
    """Wall and this process's CPU seconds of ``fn()``: on a shared machine the CPU time is
    the steadier figure (the wall time includes waiting for a core)."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def main(argv: list[str] | None = None) -> None:
    ap = OneLineParser(prog="python benchmarks/bench_fitness.py", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=positive_int, default=100_000, metavar="N", help="step rows (default 100000)")
    ap.add_argument("--population", type=positive_int, default=500, metavar="P", help="random trees (default 500)")
    args = ap.parse_args(argv)  # bad input stops here, before the slow imports and work below
    from evolve.evaluator import Evaluator
    from evolve.toolbox import build_pset, tree_to_program
    from fitness.scoring import FitnessContext, score_program

    table = synthetic_table(args.rows)
    ctx = FitnessContext(table)
    pset = build_pset(table.primitive_names)
    random.seed(0)
    from deap import gp

    programs = [tree_to_program(gp.PrimitiveTree(gp.genHalfAndHalf(pset, 1, 5))) for _ in range(args.population)]
    n = len(programs)
    print(
        f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (figures from a busy machine are low)"
    )
    print(f"{n} trees (mean size {np.mean([len(p) for p in programs]):.1f} nodes) on {args.rows:,} step rows")
    t_compile = _timed(lambda: score_program(programs[0], ctx))
    t_units = _timed(lambda: [score_program(p, ctx) for p in programs])
    print(f"  first call (numba compile or cache load): {t_compile:.2f} s")
    print(f"  first pass, each new term's sympy unit check included: {n / t_units:8.1f} evaluations/s")

    scores: dict[bool, list] = {False: [], True: []}
    times: dict[bool, list] = {False: [], True: []}
    for _ in range(3):  # interleaved, best of three: both ways meet the same load
        for way in (False, True):
            times[way].append(
                _wall_and_cpu(lambda w=way: scores.__setitem__(w, [score_program(p, ctx, fused=w) for p in programs]))
            )
    best = {way: (min(t[0] for t in ts), min(t[1] for t in ts)) for way, ts in times.items()}
    for way, label in ((False, "plain numpy"), (True, "fused      ")):
        wall, cpu = best[way]
        print(
            f"  {label}, 1 job: {wall:6.2f} s wall, {cpu:6.2f} s CPU  ->  {n / wall:7.1f} evaluations/s "
            f"({n / cpu:7.1f} per CPU second)"
        )
    ratio_wall, ratio_cpu = best[False][0] / best[True][0], best[False][1] / best[True][1]
    print(f"  speed-up fused / plain (same run): {ratio_wall:.1f}x wall, {ratio_cpu:.1f}x CPU")
    _agreement(scores[False], scores[True])
    for jobs in (1, 2):
        with Evaluator(ctx, jobs) as ev:
            for _ in range(3):  # workers compile, and classify the terms of the chunks they are dealt
                ev.score(programs)
                ev.memo.clear()
            dt = _timed(lambda ev=ev: ev.score(programs))
        print(f"  fused, Evaluator jobs={jobs}: {dt:6.2f} s  ->  {n / dt:8.1f} evaluations/s")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


def _agreement(plain: list, fused: list) -> None:
    """How far the fused errors are from the plain ones, and whether they rank the trees alike.

    Two trees whose fits are equal in exact arithmetic (``x * 2`` and ``x + x``) get errors
    that differ in the last bits, and which comes first depends on the order of summation:
    such a swap is a tie, not a change of ranking. The pairs ranked differently are counted
    with the largest relative gap between their errors.
    """
    ok = np.array([a.ok for a in plain]) & np.array([b.ok for b in fused])
    same_ok = all(a.ok == b.ok for a, b in zip(plain, fused, strict=True))
    a = np.array([s.train_error for s in plain])[ok]
    b = np.array([s.train_error for s in fused])[ok]
    rel = float(np.max(np.abs(a - b) / a)) if ok.any() else 0.0
    swapped = np.sign(a[:, None] - a[None, :]) != np.sign(b[:, None] - b[None, :])
    gap = np.abs(a[:, None] - a[None, :]) / np.minimum(a[:, None], a[None, :])
    print(f"  fused vs plain: same pass/fail on all {len(plain)}: {same_ok}; {int(ok.sum())} scored")
    print(f"    largest relative difference of an error: {rel:.1e}")
    print(
        f"    pairs ranked differently: {int(swapped.sum()) // 2} of {len(a) * (len(a) - 1) // 2}, "
        f"their errors at most {float(gap[swapped].max()) if swapped.any() else 0.0:.1e} apart (relative)"
    )


if __name__ == "__main__":
    main()
