"""`python -m evolve validate`: closed-loop replay of experiments with an archived model.

Every experiment under the directory is simulated end to end (``fitness.sim.simulator``)
with the model's step time and overheads; experiments whose results are withheld are
simulated too, with their observed fields left null. ``--lomo`` refits the
expression's constants without one model's experiments and validates on that model,
for each model in turn: the expression's structure is kept, only its coefficients,
intercept and overheads are refitted (the same least squares as the search).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import sympy as sp
from joblib import Parallel, delayed

from primitives.language import evaluate_expr, parse_infix, to_infix
from primitives.deployment import DeploymentResolver
from primitives.errors import InputError

from primitives.data.experiments import ExperimentSpec, find_experiments
from fitness.sim.models import ExpressionLatencyModel
from .replay_context import refresh_replay_rows, scored_experiments
from .scoring import FitnessContext, fit_terms
from fitness.sim.simulator import simulate

METRICS = ("e2e", "ttft", "itl")
_OBS = {"e2e": "e2e_mean_s", "ttft": "ttft_mean_s", "itl": "itl_mean_s"}


def _jobs() -> int:
    return max(1, min(2, os.cpu_count() or 1))


def closed_loop_item(spec: ExperimentSpec, deployment, expression: str, overheads: dict, seed: int = 0) -> dict:
    """One experiment simulated with a model; predicted against observed (signed errors)."""
    model = ExpressionLatencyModel(expression, deployment, overheads)
    result = simulate(spec, deployment, model, seed=seed, record=False)
    pred = result.metrics.summary
    obs = spec.observed.summary if spec.observed is not None else None
    item: dict = {"name": spec.name, "model": deployment.model.name, "workload": spec.workload}
    for m in METRICS:
        p = getattr(pred, _OBS[m])
        o = getattr(obs, _OBS[m]) if obs is not None else None
        item[f"{m}_mean_pred_s"] = p
        item[f"{m}_mean_obs_s"] = o
        item[f"{m}_error"] = (p / o - 1.0) if (p is not None and o) else None
    item["successes_pred"] = int(pred.successes)
    item["failures_pred"] = int(pred.failures)
    item["failures_obs"] = int(obs.failures) if obs is not None else None
    item["preemptions_pred"] = int(result.total_preemptions)
    return item


def closed_loop_items(specs: list[ExperimentSpec], resolver: DeploymentResolver, expression: str,
                      overheads: dict, seed: int = 0, jobs: int | None = None) -> list[dict]:
    deps = [resolver.resolve(s.model, s.tp) for s in specs]
    jobs = jobs or _jobs()
    if jobs > 1 and len(specs) > 1:
        return Parallel(n_jobs=jobs, backend="loky")(
            delayed(closed_loop_item)(s, d, expression, overheads, seed) for s, d in zip(specs, deps)
        )
    return [closed_loop_item(s, d, expression, overheads, seed) for s, d in zip(specs, deps)]


def summarise(items: list[dict]) -> dict:
    out: dict = {"experiments": len(items), "with_results": 0}
    for m in METRICS:
        errs = [abs(i[f"{m}_error"]) for i in items if i.get(f"{m}_error") is not None]
        if errs:
            out["with_results"] = len(errs)
            out[f"{m}_error_mean"] = float(np.mean(errs))
            out[f"{m}_error_max"] = float(np.max(errs))
    return out


def plot_predicted_vs_observed(items: list[dict], path: Path, title: str) -> Path | None:
    """Three panels (E2E, TTFT, ITL): predicted against observed, with a ±10% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    rows = [i for i in items if i.get("e2e_mean_obs_s") is not None]
    if not rows:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    models = sorted({i["model"] for i in rows})
    colours = dict(zip(models, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for ax, m in zip(axes, METRICS):
        obs = np.array([i[f"{m}_mean_obs_s"] for i in rows])
        pred = np.array([i[f"{m}_mean_pred_s"] for i in rows])
        lo, hi = min(obs.min(), pred.min()) * 0.8, max(obs.max(), pred.max()) * 1.25
        xs = np.geomspace(lo, hi, 50)
        ax.fill_between(xs, xs * 0.9, xs * 1.1, color="0.9", label="±10%")
        ax.plot(xs, xs, color="0.5", lw=1)
        for model in models:
            sel = [k for k, i in enumerate(rows) if i["model"] == model]
            ax.scatter(obs[sel], pred[sel], s=28, color=colours[model], label=model)
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):  # minor labels collide on short log ranges
            axis.set_minor_formatter(NullFormatter())
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel(f"observed mean {m.upper()} (s)")
        ax.set_ylabel(f"predicted mean {m.upper()} (s)")
        ax.set_title(m.upper())
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def split_terms(expr: sp.Expr) -> tuple[float, list[sp.Expr], list[float]]:
    """intercept, terms and coefficients of ``intercept + sum(coef * term)``."""
    intercept = 0.0
    terms: list[sp.Expr] = []
    coefs: list[float] = []
    for arg in sp.Add.make_args(expr):
        c, t = arg.as_coeff_Mul()
        if t == 1:
            intercept += float(c)
        else:
            terms.append(t)
            coefs.append(float(c))
    return intercept, terms, coefs


class _SympyTerm:
    """A term of an archived expression as a picklable column function."""

    def __init__(self, expr: sp.Expr):
        self.text = to_infix(expr)

    def __call__(self, columns, n: int) -> np.ndarray:
        return evaluate_expr(parse_infix(self.text), columns)


def _plot_path(entry, suffix: str) -> Path:
    run_dir = (entry.run_config or {}).get("run_dir")
    base = Path(run_dir) / "plots" if run_dir and Path(run_dir).is_dir() else Path.cwd()
    return base / f"validate-{entry.id}{suffix}.png"


def validate_entry(entry, experiments_dir, lomo: bool, resolver: DeploymentResolver, jobs: int | None = None,
                   seed: int = 0) -> dict:
    experiments_dir = Path(experiments_dir)
    specs = find_experiments(experiments_dir)
    if not specs:
        raise InputError(experiments_dir, None, "no experiment directories (with exp-config.yaml) found here")
    if lomo:
        return _lomo(entry, experiments_dir, specs, resolver, jobs, seed)
    items = closed_loop_items(specs, resolver, entry.expression, entry.overheads, seed, jobs)
    plot = plot_predicted_vs_observed(items, _plot_path(entry, ""), f"{entry.id}: closed-loop validation")
    return {"id": entry.id, "expression": entry.expression, "experiments": items, "summary": summarise(items),
            "plot": str(plot) if plot else None}


def _lomo(entry, experiments_dir: Path, specs, resolver, jobs, seed) -> dict:
    scored = scored_experiments(experiments_dir)
    intercept, terms, _ = split_terms(parse_infix(entry.expression))
    names = sorted({s.name for t in terms for s in t.free_symbols})
    # trajectories recorded with the entry itself; refits reuse them (teacher forcing)
    rows = refresh_replay_rows(experiments_dir, resolver, entry, names or ["batch_size"], seed, jobs or _jobs())
    fns = [_SympyTerm(t) for t in terms]
    models = sorted(set(rows.models))
    items: list[dict] = []
    per_model: dict[str, dict] = {}
    for held in models:
        keep = [i for i, m in enumerate(rows.models) if m != held]
        score = fit_terms(fns, FitnessContext(None, rows.subset(keep)))
        if not score.ok:
            raise InputError(entry.id, "expression", f"could not refit without {held}")
        expr = sp.Float(score.intercept) + sum(
            (sp.Float(c) * t for c, t in zip(score.coefficients, terms)), sp.Integer(0)
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
    return {"id": entry.id, "expression": entry.expression, "lomo": True, "experiments": items,
            "summary": summary, "plot": str(plot) if plot else None}
