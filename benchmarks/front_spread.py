"""How far do the blind predictions move between models the visible runs cannot tell apart?

    python benchmarks/front_spread.py --run-dir D --experiments ../shared/data/experiments \
        [--max-e2e 0.10] [--jobs 2]

Takes every entry of the run's latest front that the run checked in the closed loop and
whose worst mean-E2E error over the experiments with results is at most --max-e2e, and
simulates the experiments without results (the withheld reasoning runs) with each, as
``validate`` does (one draw of the load, seed 0, the run's step scatter). It prints, per
such experiment, each model's predicted mean E2E, TTFT, ITL and failed share, and their
range over the models.

The range is structural uncertainty: models that fit the visible runs about as well but
price the unseen regime differently. It is not a bound. A cost that none of the models
has (one the visible runs never exercise) moves all of them alike.
"""

from __future__ import annotations

import math
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evolve.cli_parser import OneLineParser, number_arg, positive_int  # noqa: E402

share_arg = number_arg(float, lambda v: v >= 0, "a share >= 0 (0.10: 10%)", "a number")
METRICS = (("e2e_mean_pred_s", "E2E s", 1.0), ("ttft_mean_pred_s", "TTFT s", 1.0), ("itl_mean_pred_s", "ITL ms", 1e3))


def plausible(front: list, max_e2e: float) -> list:
    """The front's entries checked in the closed loop whose worst mean-E2E error is at most MAX_E2E, simplest first."""
    kept = [
        e
        for e in front
        if e.objectives.get("closed_loop") and e.objectives.get("e2e_error_max", float("inf")) <= max_e2e
    ]
    return sorted(kept, key=lambda e: (e.complexity, e.id))


def same_predictions(a: list[dict], b: list[dict], rel: float = 1e-6) -> bool:
    """Two models' items agree on every predicted figure (the same arithmetic in another form)."""
    keys = [k for k, _, _ in METRICS] + ["failure_fraction_pred"]

    def close(u, v) -> bool:
        return u is v if u is None or v is None else math.isclose(u, v, rel_tol=rel)

    return all(close(x.get(k), y.get(k)) for x, y in zip(a, b, strict=True) for k in keys)


def distinct(
    predictions: dict[str, list[dict]], prefer: str | None = None
) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """(the models with predictions of their own, in order; each dropped model -> the kept one it
    repeats). Of twins the first is kept, and PREFER (the recommended model) before any other."""
    order = sorted(predictions, key=lambda m: m != prefer)  # stable: PREFER first, then as given
    chosen: dict[str, list[dict]] = {}
    repeats: dict[str, str] = {}
    for model in order:
        twin = next((k for k, v in chosen.items() if same_predictions(v, predictions[model])), None)
        if twin is None:
            chosen[model] = predictions[model]
        else:
            repeats[model] = twin
    return {m: predictions[m] for m in predictions if m in chosen}, repeats


def spread_lines(predictions: dict[str, list[dict]], recommended: str | None = None) -> list[str]:
    """Per experiment, a line per model (id -> its ``closed_loop_runs``) and one of the range; 80 columns."""
    from evolve.validation_view import experiment_label, fmt_share, fmt_value

    header = f"  {'model':<14}{'E2E s':>12}{'TTFT s':>12}{'ITL ms':>12}{'failed':>12}{'fit E2E':>9}"
    by_experiment: dict[str, list[tuple[str, dict]]] = {}
    for model, items in predictions.items():
        for item in items:
            by_experiment.setdefault(item["name"], []).append((model, item))
    lines = []
    for name, rows in by_experiment.items():
        lines += [experiment_label({"name": name}), header]
        for model, item in rows:
            cells = "".join(f"{fmt_value(item.get(k), scale):>12}" for k, _, scale in METRICS)
            mark = "*" if model == recommended else " "
            fail, fit = fmt_share(item.get("failure_fraction_pred")), fmt_share(item.get("fit_e2e_error_max"))
            lines.append(f"{mark} {model:<14}{cells}{fail:>12}{fit:>9}")
        cells = "".join(f"{_range(rows, k, lambda v, s=scale: fmt_value(v, s)):>12}" for k, _, scale in METRICS)
        lines += [f"  {'range':<14}{cells}{_range(rows, 'failure_fraction_pred', fmt_share):>12}", ""]
    return lines


def _range(rows: list[tuple[str, dict]], key: str, fmt) -> str:
    """The lowest and highest of the models' ``key``, each written as the model rows write it."""
    values = [item[key] for _, item in rows if item.get(key) is not None]
    if not values:
        return "—"
    low, high = fmt(min(values)), fmt(max(values))
    return low if low == high else f"{low.removesuffix('%')}–{high}"  # a unit shows once, at the end


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python benchmarks/front_spread.py", description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True, metavar="DIR", help="a replay run's directory")
    ap.add_argument("--experiments", required=True, type=Path, metavar="DIR", help="the experiments folder")
    ap.add_argument("--max-e2e", type=share_arg, default=0.10, metavar="F", help="worst mean-E2E error kept (0.10)")
    ap.add_argument("--jobs", type=positive_int, default=2, metavar="J", help="parallel simulations (2)")
    args = ap.parse_args(argv)

    from archive.rundir import locate_archive
    from archive.select import recommend
    from archive.store import ArchiveStore
    from evolve.report import display_expression
    from fitness.step_scatter import run_scatter
    from fitness.validate import ClosedLoopSettings, closed_loop_runs, same_model
    from primitives.data.experiments import find_experiments
    from primitives.deployment import DeploymentResolver
    from primitives.errors import InputError

    try:
        with ArchiveStore(locate_archive(args.run_dir), create=False, read_only=True) as store:
            front = store.front()
        withheld = [s for s in find_experiments(args.experiments) if s.observed is None]
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    models = plausible(front, args.max_e2e)
    if not models:
        print(f"error: {args.run_dir}: no front entry checked in the closed loop within --max-e2e", file=sys.stderr)
        return 2
    if not withheld:
        print(f"error: {args.experiments}: every experiment has results; nothing is predicted blind", file=sys.stderr)
        return 2
    resolver = DeploymentResolver.from_options()
    predictions = {}
    for e in models:
        runs = same_model(withheld, e.expression, e.overheads)
        settings = ClosedLoopSettings(scatter=run_scatter(e.run_config), jobs=args.jobs)
        fit = e.objectives["e2e_error_max"]
        items = closed_loop_runs(runs, resolver, settings, tails=False)
        predictions[e.id] = [{**item, "fit_e2e_error_max": fit} for item in items]
    recommended = recommend(front).id
    kept, repeats = distinct(predictions, prefer=recommended)
    print(f"{len(kept)} models of the front with their own predictions, worst mean-E2E error on")
    print(f"the runs with results at most {100 * args.max_e2e:g}% (fit E2E); * recommended:")
    for e in models:
        same = f" (the predictions of {repeats[e.id]})" if e.id in repeats else ""
        text = f"{e.id}  {display_expression(e.expression)}{same}"
        print(textwrap.fill(text, 80, initial_indent="  ", subsequent_indent=" " * 16, break_long_words=False))
    print()
    print("\n".join(spread_lines(kept, recommended)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
