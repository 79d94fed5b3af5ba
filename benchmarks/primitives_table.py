"""The measured-kernel primitives against the datasheet ones, on the real step traces.

For each pair (new primitive, the old ones it replaces) one fixed-structure model is
fitted on the training rows of the two real step traces (first 80% of each experiment in
time; trace KV scaled to per-request sums, ``fitness.kv_sharing``) with the search's own
least squares (efficiencies bounded, counts >= 0), and judged on the held-out last 20%:

* old:  ``c0 + a*weight_time_us + b*matmul_time_us + c*kv_io_time_us + d*allreduce_calls``
* new:  ``c0 + a*gemm_time_us + b*decode_attention_time_us + c*prefill_attention_time_us
  + d*allreduce_calls``

It prints a markdown table: each efficiency (what the fit says the real step costs
against the primitive's ideal or measured-kernel time), per-step MAPE on each holdout.

Usage::

    python benchmarks/primitives_table.py [--shared DIR] [--no-kv-sharing]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evolve.cli_parser import OneLineParser  # noqa: E402
from primitives.data.roots import shared_data_root  # noqa: E402
from primitives.errors import InputError  # noqa: E402

MODELS = {
    "old (datasheet)": "weight_time_us + matmul_time_us + kv_io_time_us + allreduce_calls + 1",
    "new (measured kernels)": "gemm_time_us + decode_attention_time_us + prefill_attention_time_us"
    " + allreduce_calls + 1",
    "both": "weight_time_us + gemm_time_us + decode_attention_time_us + prefill_attention_time_us + kv_io_time_us"
    " + allreduce_calls + 1",
}


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python benchmarks/primitives_table.py", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--shared", type=Path, default=None, help="the shared folder (default: $STEPSYNTH_SHARED or ../shared)"
    )
    ap.add_argument("--no-kv-sharing", action="store_true", help="fit on the traces' distinct-block KV as is")
    args = ap.parse_args(argv)
    shared = args.shared or shared_data_root()
    root = shared / "data"
    if not (root / "steps").is_dir():
        what = "no such folder" if not shared.exists() else "no data/steps folder in it"
        option = "--shared" if args.shared else "the shared folder (--shared, or set STEPSYNTH_SHARED)"
        print(f"error: {shared}: {option}: {what}; expected the shared folder", file=sys.stderr)
        return 2
    from fitness.dataset import build_step_table
    from fitness.efficiency import DEFAULT_EFFICIENCY_BOUNDS, as_bounds
    from fitness.kv_sharing import trace_kv_sharing
    from fitness.physics_check import bound_flag, term_efficiencies
    from fitness.scoring import FitnessContext, fit_terms, sympy_term_intervals
    from fitness.validate import SympyTerm, split_terms
    from primitives.data.traces import load_steps
    from primitives.deployment import default_resolver
    from primitives.kernels import efficiency_caps, efficiency_floors
    from primitives.language import parse_infix

    try:  # the inputs, read before anything is fitted or printed
        data = load_steps([root / "steps"])
        resolver = default_resolver()
        sharing = {} if args.no_kv_sharing else trace_kv_sharing(data, root / "experiments", resolver, 0)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    names = sorted({s.name for text in MODELS.values() for s in parse_infix(text).free_symbols})
    table = build_step_table(data, resolver, names, 0.2, sharing)
    gpus = [d.gpu for d in table.deployments]
    bounds = as_bounds(DEFAULT_EFFICIENCY_BOUNDS, efficiency_caps(gpus), efficiency_floors(gpus))  # as a run
    print(f"KV sharing factors applied to the traces: {sharing or 'none'}\n")
    exps = [e.split("-tp")[0].split("-", 2)[-1] for e in table.experiment_names]
    print("| model | term | efficiency / cost | " + " | ".join(f"holdout MAPE {e}" for e in exps) + " |")
    print("|---|---|---|" + "---|" * len(exps))
    for label, text in MODELS.items():
        _, terms, _ = split_terms(parse_infix(text))
        intervals = sympy_term_intervals(terms, bounds)
        if intervals is None:  # fit_terms would take None as unbounded
            raise SystemExit(f"{label}: a µs primitive in two terms, or a term no bound can price")
        score = fit_terms(
            [SympyTerm(t) for t in terms],
            FitnessContext(table, efficiency_bounds=bounds),
            detail=True,
            efficiency_terms=intervals,
        )
        fitted = " + ".join(f"{c!r}*{t}" for c, t in zip(score.coefficients, terms, strict=True))
        rows = term_efficiencies(f"{score.intercept!r} + {fitted}", bounds)
        mape = [score.per_experiment[e]["step_mape"] for e in table.experiment_names]
        for i, r in enumerate(rows):
            flag = f", {bound_flag(r)}" if bound_flag(r) else ""
            value = f"{r['coefficient']:g}{' x' if r['kind'] == 'efficiency' else ' µs each'}{flag}"
            cells = [f"{m:.2%}" for m in mape] if i == 0 else [""] * len(mape)
            print(f"| {label if i == 0 else ''} | `{r['term']}` | {value} | " + " | ".join(cells) + " |")
        print(f"| | intercept | {score.intercept:.0f} µs | " + " | ".join([""] * len(mape)) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
