"""Closed-loop validation of archived models: ``python -m evolve validate``, and the run's final check.

Every experiment under the directory is simulated end to end (``fitness.validate``)
with the model's step time and overheads; experiments whose results are withheld are
simulated too, with their observed fields left null. The closed-loop validation also
checks how the model orders the experiments' tails (``fitness.ranking``), beside the BLIS
blackbox baseline when asked (``evolve.baseline``).

Transfer checks refit the expression's constants on part of the data and validate on
the rest, in the closed loop. The expression's structure is kept; only its coefficients,
intercept and overheads are refitted (the same least squares as the search,
``fitness.validate.refit``), on replay rows recorded with the entry itself (teacher
forcing), then ``REFIT_ROUNDS`` times on rows the refitted model re-records of the
training experiments (``refit_fold``). One function (``_transfer``) runs every check; a
check is a list of folds, each naming the replay rows it fits on and the experiments (or
stages) it reports:

* ``lomo``: leave one model out, for each model in turn;
* ``lowo``: leave one workload out (general, codegen, ...: the end of the experiment's
  name), across all models, for each workload with results in turn;
* ``stage-transfer``: fit on the low-rate stages only, report the high-rate stages. An
  experiment's high-rate stages are those at its highest stage rate, its low-rate stages
  all the others; only their per-stage rows enter the fit (the whole-run rows contain
  the high-rate stages). Experiments whose stages all run at one rate (a single stage)
  have no such split and take no part (``skipped``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np

from evolve.baseline import blackbox_baseline
from evolve.calibration import record_rows, scored_experiments
from evolve.config import REFIT_ROUNDS
from evolve.validation_view import VALIDATE_MODES as MODES
from evolve.validation_view import plot_predicted_vs_observed
from fitness.dataset import build_step_table
from fitness.efficiency import DEFAULT_EFFICIENCY_BOUNDS, run_efficiency_bounds
from fitness.headroom import headroom as find_headroom
from fitness.ranking import ranking_check
from fitness.replay_rows import REPLAY_METRICS, ReplayRows
from fitness.scoring import error_stats
from fitness.sim.loadgen import NoSuccessfulRequest
from fitness.step_scatter import RUN_SCATTER, StepScatter, measure_scatter, run_scatter
from fitness.transfer import TRANSFER_ERROR_CAP, experiment_error
from fitness.validate import ONE_DRAW, ClosedLoopSettings, closed_loop_runs, refit, same_model, split_terms, summarise
from primitives.data.experiments import ExperimentSpec, find_experiments
from primitives.data.traces import load_steps
from primitives.deployment import DeploymentResolver
from primitives.errors import InputError
from primitives.language import parse_infix, scaled_expression


def _plot_path(entry, suffix: str, plot_dir: Path | None = None) -> Path:
    """In PLOT_DIR (the command line picks the run's plots folder), else the current directory."""
    return Path(plot_dir or Path.cwd()) / f"validate-{entry.id}{suffix}.png"


def measured_step_scatter(steps_dir, resolver: DeploymentResolver) -> StepScatter:
    """The scatter of the real steps in the traces under STEPS_DIR (``fitness.step_scatter``)."""
    table = build_step_table(load_steps([Path(steps_dir)]), resolver, validation_fraction=0.0)
    return measure_scatter(table, str(steps_dir))


def validate_entry(
    entry,
    experiments_dir,
    mode: str | None,
    resolver: DeploymentResolver,
    jobs: int | None = None,
    seed: int = 0,
    baseline: bool = False,
    plot_dir: Path | None = None,
    refit_rounds: int = REFIT_ROUNDS,
    load_draws: int = 1,
    step_time_scale: float = 1.0,
    step_scatter: StepScatter | str | None = RUN_SCATTER,
    headroom: bool = False,
) -> dict:
    """Closed-loop validation of an entry (``mode`` None), or one of the transfer checks (``MODES``).

    ``load_draws``: each experiment is simulated with that many draws of the load generator's
    randomness, arrival times and prompt lengths (seeds ``seed``, ``seed + 1``, ...), and
    compared by their mean (``fitness.validate.compare``); the transfer checks' refits and the
    baseline are fitted to the mean of as many draws (``fitness.replay_rows.mean_of_draws``).
    ``step_time_scale`` (closed loop only): a what-if, every step that factor slower or faster
    (how far a run is from overload); the result's ``expression`` is the scaled one.
    ``step_scatter``: each simulated step (the transfer checks' recordings and the baseline's
    too) takes the model's time times a draw from a scatter measured in real traces
    (``fitness.step_scatter``): by default (``RUN_SCATTER``) the one the entry's run measured
    and searched with; None: none. ``headroom`` (closed loop only): per experiment, the factors
    on step time and on load at which more than 1% of the requests fail (``fitness.headroom``).

    The closed-loop validation also checks how the entry ranks the experiments' tails
    (``fitness.ranking``); ``baseline`` adds the BLIS blackbox baseline (``evolve.baseline``)
    beside it. ``plot_dir``: where the plot goes (default: see ``_plot_path``).
    """
    if mode not in MODES:
        raise InputError(mode, "mode", f"expected one of {', '.join(m for m in MODES if m)}")
    if (step_time_scale != 1.0 or headroom) and mode is not None:
        raise InputError("step_time_scale/headroom", None, "only with the closed-loop validation")
    if step_scatter == RUN_SCATTER:
        step_scatter = run_scatter(entry.run_config)
    settings = ClosedLoopSettings(seed, load_draws, step_scatter, jobs)
    experiments_dir = Path(experiments_dir)
    specs = find_experiments(experiments_dir)
    if not specs:
        raise InputError(experiments_dir, None, "no experiment directories (with exp-config.yaml) found here")
    if mode is not None:
        return _transfer(entry, experiments_dir, mode, resolver, settings, plot_dir, refit_rounds)
    expression = entry.expression if step_time_scale == 1.0 else scaled_expression(entry.expression, step_time_scale)
    items = closed_loop_runs(same_model(specs, expression, entry.overheads), resolver, settings)
    what_if = "" if step_time_scale == 1.0 else f"-x{step_time_scale:g}"  # a what-if keeps the real plot
    title = f"{entry.id}: closed-loop validation" + (f", step time x{step_time_scale:g}" if what_if else "")
    plot = plot_predicted_vs_observed(items, _plot_path(entry, what_if, plot_dir), title)
    base = blackbox_baseline(experiments_dir, resolver, settings) if baseline else None
    result = {
        "id": entry.id,
        "expression": expression,
        "mode": "closed-loop",
        "load_seed": seed,
        "load_draws": load_draws,
        "step_time_scale": step_time_scale,
        "step_scatter": step_scatter.summary() if step_scatter is not None else None,
        "experiments": items,
        "summary": summarise(items),
        "ranking": ranking_check(items, base["experiments"] if base else None),
        "plot": str(plot) if plot else None,
    }
    if base:
        result["baseline"] = {**base, "summary": summarise(base["experiments"])}
    if headroom:
        now = [item["failure_fraction_pred"] for item in items]
        result["headroom"] = find_headroom(specs, resolver, expression, entry.overheads, settings, failed_now=now)
    return result


# --- transfer checks ------------------------------------------------------------------
@dataclass
class Fold:
    """One refit of a transfer check: the rows it fits on, what it validates and reports."""

    held: str  # what is held out: a model, a workload, "high-rate stages"
    keep: Callable[[str, tuple[str, str]], bool]  # (experiment name, (metric, scope)) -> row enters the refit
    specs: list[ExperimentSpec]  # simulated in the closed loop with the refitted constants
    report: Callable[[dict], list[dict]] = field(default=lambda item: [item])  # items reported per experiment


def group_folds(scored: list[ExperimentSpec], group: Callable[[ExperimentSpec], str]) -> list[Fold]:
    """Leave one group out: per group, refit on every other group's experiments, validate on its own."""
    of = {s.name: group(s) for s in scored}
    return [
        Fold(g, lambda name, _label, g=g: of[name] != g, [s for s in scored if of[s.name] == g])
        for g in sorted(set(of.values()))
    ]


def stage_split(spec: ExperimentSpec) -> tuple[list[int], list[int]]:
    """(low-rate, high-rate) stage indices: high-rate at the highest stage rate, low-rate below it.

    ``([], [])`` when every stage runs at one rate: nothing to transfer from.
    """
    rates = [rate for rate, _ in spec.stages]
    low = [i for i, r in enumerate(rates) if r < max(rates)]
    return (low, [i for i, r in enumerate(rates) if r == max(rates)]) if low else ([], [])


def stage_fold(scored: list[ExperimentSpec]) -> Fold:
    """Refit on the low-rate stage rows only; report each experiment's high-rate stages."""
    split = {s.name: stage_split(s) for s in scored if stage_split(s)[0]}
    fit_scopes = {name: {f"stage_{i}" for i in low} for name, (low, _) in split.items()}

    def report(item: dict) -> list[dict]:
        keep = ("name", "model", "workload")
        high = split[item["name"]][1]
        return [
            {**{k: item[k] for k in keep}, **st, "held_out_stage": st["stage"], "held_out_stages": len(high)}
            for st in item["stages"]
            if st["stage"] in high
        ]

    return Fold(
        "high-rate stages",
        lambda name, label: label[1] in fit_scopes.get(name, ()),
        [s for s in scored if s.name in split],
        report,
    )


def transfer_folds(mode: str, scored: list[ExperimentSpec], resolver: DeploymentResolver) -> tuple[str, list[Fold]]:
    """(what a fold holds out, the folds) of a transfer check."""
    if mode in ("lomo", "lowo"):
        kind = "model" if mode == "lomo" else "workload"
        of = (lambda s: resolver.resolve_experiment(s).model.name) if mode == "lomo" else (lambda s: s.workload)
        folds = group_folds(scored, of)
        if len(folds) < 2:  # holding the only group out leaves nothing to refit on
            only = folds[0].held if folds else "none"
            raise InputError(
                f"--{mode}", None, f"needs experiments with results of two {kind}s or more; found one: {only}"
            )
        return kind, folds
    fold = stage_fold(scored)
    if not fold.specs:
        raise InputError(
            "--stage-transfer", "load.stages", "no experiment with results has stages at different request rates"
        )
    return "stage", [fold]


Rerecord = Callable[[str, dict, list[str]], ReplayRows]  # (expression, overheads, experiment names) -> rows


def refit_fold(fold: Fold, terms: list, rows, bounds, rounds: int = 0, rerecord: Rerecord | None = None):
    """(expression, overheads) refitted on the fold's rows of ``rows``, or None.

    The rows are first-order forms around the batches of the model that recorded them, and
    a refit that moves the constants far from it (a held-out workload or model can move them
    a lot) is judged on batches it would not have made. ``rounds`` times, the refitted model
    re-records the fold's training experiments (``rerecord``) and the constants are refitted
    on its own batches, as the search's calibration does. A round whose model serves none
    of a training experiment's requests keeps the previous refit.
    """
    keep = lambda rp: lambda e, label: fold.keep(rp.names[e], label)  # noqa: E731
    fitted = refit(terms, rows, keep(rows), bounds)
    training = sorted({n for e, n in enumerate(rows.names) if any(fold.keep(n, lab) for lab in rows.labels[e])})
    for _ in range(rounds if rerecord is not None else 0):
        if fitted is None:
            break
        try:
            again = rerecord(*fitted, training)
        except NoSuccessfulRequest:
            break
        fitted = refit(terms, again, keep(again), bounds) or fitted
    return fitted


def transfer_items(
    terms: list,
    rows,
    folds: list[Fold],
    kind: str,
    resolver,
    settings: ClosedLoopSettings,
    bounds,
    tails: bool = True,
    rounds: int = 0,
    rerecord: Rerecord | None = None,
) -> tuple[list[dict], dict[str, dict]]:
    """Refit the terms' constants on each fold's rows (``refit_fold``), simulate its held-out experiments.

    Returns the reported items (each with ``held_out_<kind>`` and the refitted model) and
    the summary per fold. A fold whose rows cannot be refitted raises ``InputError``.
    """
    items: list[dict] = []
    per_group: dict[str, dict] = {}
    for fold in folds:
        fitted = refit_fold(fold, terms, rows, bounds, rounds, rerecord)
        if fitted is None:
            raise InputError("expression", None, f"could not refit its constants without the {fold.held}")
        expression, overheads = fitted
        got = []
        for it in closed_loop_runs(same_model(fold.specs, expression, overheads), resolver, settings, tails):
            for shown in fold.report(it):
                shown.setdefault(f"held_out_{kind}", fold.held)
                shown["refit_expression"] = expression
                shown["refit_overheads"] = overheads
                got.append(shown)
        items.extend(got)
        per_group[fold.held] = summarise(got)
    return items, per_group


def _transfer(
    entry,
    experiments_dir: Path,
    mode: str,
    resolver,
    settings: ClosedLoopSettings,
    plot_dir=None,
    rounds=REFIT_ROUNDS,
) -> dict:
    scored = scored_experiments(experiments_dir)
    kind, folds = transfer_folds(mode, scored, resolver)
    _, terms, _ = split_terms(parse_infix(entry.expression))
    names = sorted({s.name for t in terms for s in t.free_symbols}) or ["batch_size"]
    # trajectories recorded with the entry itself; each fold's refit re-records its own (``refit_fold``),
    # with as many draws of the load as the held-out runs are compared on
    rows = record_rows(scored, resolver, entry, names, settings)
    by_name = {s.name: s for s in scored}

    def rerecord(expression: str, overheads: dict, training: list[str]):
        model = SimpleNamespace(expression=expression, overheads=overheads)
        return record_rows([by_name[n] for n in training], resolver, model, names, settings)

    bounds = run_efficiency_bounds(entry.run_config)
    try:
        items, per_group = transfer_items(terms, rows, folds, kind, resolver, settings, bounds, True, rounds, rerecord)
    except InputError as exc:
        raise InputError(entry.id, "expression", exc.expected) from None
    summary = summarise(items)
    if len(folds) > 1:
        summary[f"{kind}s"] = per_group
        means = [v["e2e_error_mean"] for v in per_group.values() if "e2e_error_mean" in v]
        summary[f"e2e_error_mean_over_{kind}s"] = float(np.mean(means)) if means else None
    result = {
        "id": entry.id,
        "expression": entry.expression,
        "mode": mode,
        "lomo": mode == "lomo",
        "load_seed": settings.seed,
        "load_draws": settings.load_draws,
        "step_scatter": settings.scatter.summary() if settings.scatter is not None else None,
        "experiments": items,
        "summary": summary,
    }
    if mode == "stage-transfer":
        splits = {s.name: stage_split(s) for s in scored}
        result["stage_split"] = {n: {"fit": lo, "validated": hi} for n, (lo, hi) in splits.items() if lo}
        result["skipped"] = sorted(n for n, (lo, _) in splits.items() if not lo)
    plot = plot_predicted_vs_observed(items, _plot_path(entry, f"-{mode}", plot_dir), f"{entry.id}: {MODES[mode][1]}")
    result["plot"] = str(plot) if plot else None
    return result


TRANSFER_MODES = ("lowo", "stage-transfer", "lomo")


def transfer_errors(
    expression: str,
    rows,
    scored,
    resolver,
    bounds,
    settings: ClosedLoopSettings = ONE_DRAW,
) -> dict[str, float]:
    """How the expression holds where its constants were not fitted: the three transfer checks,
    each fold refitted on ``rows``.

    ``rows`` are the search's replay rows (recorded by its best model) and each fold is
    refitted once; ``validate --lowo`` records with the entry and re-records each fold's
    training runs with its refit (``refit_fold``), so its figures differ. A check with
    fewer than two groups (one model, one workload, no multi-rate experiment) is left out.

    Returns the worst held-out error of each metric (``transfer_<metric>_error_max``) and
    ``transfer_error``, what model selection compares: the mean over held-out experiments
    (stages, for the stage check) of the worst of |E2E|, |ITL| and |TTFT| /
    1.5, each capped at 100% (``fitness.transfer.experiment_error``). The cap keeps one
    held-out experiment that the refit drives into overload (Llama-2-7B, the only TP1
    model with full multi-head attention, at 20 req/s) from hiding how the rest transfer.
    A fold that cannot be refitted scores the cap on every item. ``transfer_error_worst``
    is the largest of those capped errors: at the cap, some refit ran away, and model
    selection's transfer gate (``archive.select``) passes over the entry.
    """
    _, terms, _ = split_terms(parse_infix(expression))
    worst = dict.fromkeys(REPLAY_METRICS, 0.0)
    capped: list[float] = []
    for mode in TRANSFER_MODES:
        try:
            kind, folds = transfer_folds(mode, scored, resolver)
        except InputError:  # one model or workload only, or no experiment with stages at different rates
            continue
        try:
            items, _ = transfer_items(terms, rows, folds, kind, resolver, settings, bounds, tails=False)
        except InputError:
            worst = dict.fromkeys(REPLAY_METRICS, np.inf)
            capped += [TRANSFER_ERROR_CAP] * sum(len(f.specs) for f in folds)
            continue
        for i in items:
            err = {m: i[f"{m}_error"] for m in REPLAY_METRICS if i.get(f"{m}_error") is not None}
            if not err:
                continue
            for m, v in err.items():
                worst[m] = max(worst[m], abs(v))
            capped.append(experiment_error(err))
    out = {f"transfer_{m}_error_max": float(v) for m, v in worst.items()}
    if capped:
        out["transfer_error"] = float(np.mean(capped))
        out["transfer_error_worst"] = float(np.max(capped))  # at the cap: some refit ran away
    return out


def closed_loop_check(
    front: list,
    limit: int,
    experiments_dir: Path,
    resolver: DeploymentResolver,
    settings: ClosedLoopSettings,  # the run's: seed, draws of the load (compared by their mean), step scatter
    ui,
    rows=None,
    bounds=DEFAULT_EFFICIENCY_BOUNDS,  # or EfficiencyBounds, with the run's caps
) -> list:
    """Validate the most promising front entries in the closed loop; returns those checked.

    The search's replay errors are first-order estimates around recorded batches; near
    saturation (the 128-slot cap) the closed loop can still depart from them. The
    ``limit`` entries with the lowest estimated replay error (every replayed row, stages
    included: the stage rows say how latency grows with load) plus first-order transfer
    error (``transfer_error_linear``, ``fitness.transfer``) are re-scored on the
    closed-loop E2E/TTFT/ITL of every experiment with results (the estimates are kept as
    ``*_error_search_estimate``), and ``archive best`` prefers them.

    With the search's replay ``rows``, each is also refitted without each workload, model
    and high-rate stage and simulated on what was left out (``transfer_errors``): model
    selection then prefers constants that hold where they were not fitted.
    """
    specs = scored_experiments(experiments_dir)
    chosen = sorted(
        front,
        key=lambda e: (
            e.objectives.get("replay_error", np.inf) + e.objectives.get("transfer_error_linear", 0.0),
            e.complexity,
        ),
    )
    chosen = chosen[:limit]
    for e in chosen:
        ui.log(f"closed-loop check of {e.id} (complexity {e.complexity}) on {len(specs)} experiments")
        items = closed_loop_runs(same_model(specs, e.expression, e.overheads), resolver, settings, tails=False)
        stats = error_stats({m: [i[f"{m}_error"] for i in items] for m in REPLAY_METRICS})
        for m in REPLAY_METRICS:
            mean, worst, _ = stats[m]
            e.objectives[f"{m}_error_search_estimate"] = e.objectives.get(f"{m}_error")  # linearised replay
            e.objectives[f"{m}_error"] = mean
            e.objectives[f"{m}_error_max"] = worst
        # failures as a metric: the failed fraction's absolute miss (0 where no experiment fails)
        missed = [
            abs(i["failure_fraction_pred"] - i["failure_fraction_obs"])
            for i in items
            if i.get("failure_fraction_pred") is not None and i.get("failure_fraction_obs") is not None
        ]
        if missed:
            e.objectives["failure_error"] = float(np.mean(missed))
            e.objectives["failure_error_max"] = float(np.max(missed))
        e.objectives["closed_loop"] = 1.0
        if rows is not None:
            ui.log(f"transfer checks of {e.id} (each workload, model and fast stage held out)")
            transfer = transfer_errors(e.expression, rows, specs, resolver, bounds, settings)
            e.objectives.update(transfer)
        for i in items:
            e.per_experiment.setdefault(i["name"], {}).update(
                {f"{m}_error_closed_loop": i[f"{m}_error"] for m in REPLAY_METRICS}
            )
    return chosen
