"""Fitness evaluations per second: 500 random trees on 100k step rows, 1 job and 2.

    python benchmarks/bench_fitness.py [--rows 100000] [--population 500]

Prints figures; it asserts nothing (speed is shown here, never in timed tests).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evolve.evaluator import Evaluator  # noqa: E402
from evolve.toolbox import build_pset, tree_to_program  # noqa: E402
from fitness.dataset import StepTable  # noqa: E402
from fitness.scoring import FitnessContext  # noqa: E402
from primitives.compute import constant_columns, kernel_binding, primitive_columns  # noqa: E402
from primitives.deployment import default_resolver  # noqa: E402
from primitives.registry import AGGREGATE_FEATURES, supported_primitives  # noqa: E402


def synthetic_table(n_rows: int, seed: int = 0) -> StepTable:
    """Random but plausible batches over the four deployments, with a physics target."""
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--population", type=int, default=500)
    args = ap.parse_args()
    table = synthetic_table(args.rows)
    ctx = FitnessContext(table)
    pset = build_pset(table.primitive_names)
    random.seed(0)
    from deap import gp

    programs = [tree_to_program(gp.PrimitiveTree(gp.genHalfAndHalf(pset, 1, 5))) for _ in range(args.population)]
    sizes = [len(p) for p in programs]
    print(f"{args.population} trees (mean size {np.mean(sizes):.1f} nodes) on {args.rows:,} step rows")
    for jobs in (1, 2):
        with Evaluator(ctx, jobs) as ev:
            ev.score(programs[:4])  # start the workers
            ev.memo.clear()
            t = time.perf_counter()
            ev.score(programs)
            dt = time.perf_counter() - t
        print(f"  jobs={jobs}: {dt:6.2f} s  ->  {args.population / dt:8.1f} evaluations/s")


if __name__ == "__main__":
    main()
