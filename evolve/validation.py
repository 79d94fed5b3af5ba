"""Closed-loop validation of archived models: ``python -m evolve validate``, and the run's final check.

Every experiment under the directory is simulated end to end (``fitness.validate``)
with the model's step time and overheads; experiments whose results are withheld are
simulated too, with their observed fields left null. ``--lomo`` refits the
expression's constants without one model's experiments and validates on that model,
for each model in turn: the expression's structure is kept, only its coefficients,
intercept and overheads are refitted (the same least squares as the search), on
trajectories recorded with the entry itself (teacher forcing).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import sympy as sp

from archive.rundir import RunDir
from evolve.calibration import refresh_replay_rows, scored_experiments
from evolve.report import plot_predicted_vs_observed
from fitness.replay_rows import REPLAY_METRICS
from fitness.scoring import FitnessContext, error_stats, fit_terms
from fitness.validate import SympyTerm, closed_loop_items, default_jobs, split_terms, summarise
from primitives.data.experiments import find_experiments
from primitives.deployment import DeploymentResolver
from primitives.errors import InputError
from primitives.language import parse_infix, to_infix


def _plot_path(entry, suffix: str) -> Path:
    """The run's plots folder when the entry's run directory is here, else the current directory."""
    run_dir = (entry.run_config or {}).get("run_dir")
    base = RunDir(Path(run_dir)).plots if run_dir and Path(run_dir).is_dir() else Path.cwd()
    return base / f"validate-{entry.id}{suffix}.png"


def validate_entry(
    entry, experiments_dir, lomo: bool, resolver: DeploymentResolver, jobs: int | None = None, seed: int = 0
) -> dict:
    experiments_dir = Path(experiments_dir)
    specs = find_experiments(experiments_dir)
    if not specs:
        raise InputError(experiments_dir, None, "no experiment directories (with exp-config.yaml) found here")
    if lomo:
        return _lomo(entry, experiments_dir, resolver, jobs, seed)
    items = closed_loop_items(specs, resolver, entry.expression, entry.overheads, seed, jobs)
    plot = plot_predicted_vs_observed(items, _plot_path(entry, ""), f"{entry.id}: closed-loop validation")
    return {
        "id": entry.id,
        "expression": entry.expression,
        "experiments": items,
        "summary": summarise(items),
        "plot": str(plot) if plot else None,
    }


def _lomo(entry, experiments_dir: Path, resolver, jobs, seed) -> dict:
    scored = scored_experiments(experiments_dir)
    intercept, terms, _ = split_terms(parse_infix(entry.expression))
    names = sorted({s.name for t in terms for s in t.free_symbols})
    # trajectories recorded with the entry itself; refits reuse them (teacher forcing)
    rows = refresh_replay_rows(experiments_dir, resolver, entry, names or ["batch_size"], seed, jobs or default_jobs())
    fns = [SympyTerm(t) for t in terms]
    models = sorted(set(rows.models))
    items: list[dict] = []
    per_model: dict[str, dict] = {}
    for held in models:
        keep = [i for i, m in enumerate(rows.models) if m != held]
        score = fit_terms(fns, FitnessContext(None, rows.subset(keep)))
        if not score.ok:
            raise InputError(entry.id, "expression", f"could not refit without {held}")
        expr = sp.Float(score.intercept) + sum(
            (sp.Float(c) * t for c, t in zip(score.coefficients, terms, strict=True)), sp.Integer(0)
        )
        held_specs = [s for s in scored if resolver.resolve(s.model, s.tp).model.name == held]
        got = closed_loop_items(held_specs, resolver, to_infix(expr), score.overheads, seed, jobs)
        for it in got:
            it["held_out_model"] = held
            it["refit_expression"] = to_infix(expr)
        items.extend(got)
        per_model[held] = summarise(got)
    summary = summarise(items)
    summary["models"] = per_model
    summary["e2e_error_mean_over_models"] = float(np.mean([v["e2e_error_mean"] for v in per_model.values()]))
    plot = plot_predicted_vs_observed(items, _plot_path(entry, "-lomo"), f"{entry.id}: leave one model out")
    return {
        "id": entry.id,
        "expression": entry.expression,
        "lomo": True,
        "experiments": items,
        "summary": summary,
        "plot": str(plot) if plot else None,
    }


def closed_loop_check(
    front: list, limit: int, experiments_dir: Path, resolver: DeploymentResolver, seed: int, jobs: int, ui
) -> list:
    """Validate the most promising front entries in the closed loop; returns those checked.

    The search's replay errors are first-order estimates around recorded batches; near
    saturation (the 128-slot cap) the closed loop can still depart from them. The
    ``limit`` entries with the lowest estimated replay error (every replayed row, stages
    included: the stage rows say how latency grows with load) are re-scored on the
    closed-loop E2E/TTFT/ITL of every experiment with results (the estimates are kept as
    ``*_error_search_estimate``), and ``archive best`` prefers them.
    """
    specs = scored_experiments(experiments_dir)
    chosen = sorted(front, key=lambda e: (e.objectives.get("replay_error", np.inf), e.complexity))
    chosen = chosen[:limit]
    for e in chosen:
        ui.log(f"closed-loop check of {e.id} (complexity {e.complexity}) on {len(specs)} experiments")
        items = closed_loop_items(specs, resolver, e.expression, e.overheads, seed, jobs)
        stats = error_stats({m: [i[f"{m}_error"] for i in items] for m in REPLAY_METRICS})
        for m in REPLAY_METRICS:
            mean, worst, _ = stats[m]
            e.objectives[f"{m}_error_search_estimate"] = e.objectives.get(f"{m}_error")  # linearised replay
            e.objectives[f"{m}_error"] = mean
            e.objectives[f"{m}_error_max"] = worst
        e.objectives["closed_loop"] = 1.0
        for i in items:
            e.per_experiment.setdefault(i["name"], {}).update(
                {f"{m}_error_closed_loop": i[f"{m}_error"] for m in REPLAY_METRICS}
            )
    return chosen
