"""Per-step error of an archived expression on step traces (``python -m evolve score``).

Besides each experiment's MAPE, the signed error by batch size: the trace's steps split
into quantiles of the requests they carry, and in each the mean of predicted over
measured cycle time, minus one. A step-time model can match the mean and still get the
slope with batch size wrong (too cheap per request, too dear per step); that slope is
what decides a full batch of 128, where the visible runs rarely go.

``deployment_transfer`` (``score --lodo``): leave one deployment out. Per deployment, the
entry's terms refitted on the other deployments' steps (the search's bounded least squares
and the run's efficiency bounds), and its error on the left-out deployment's steps. Two
deployments that share a cost's value cannot tell that cost from a constant; a refit
without one of them shows whether the constants carry to the other (``docs/RESULTS.md``,
"The trace command's model does not transfer to other deployments").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import sympy as sp

from fitness.dataset import build_step_table
from fitness.efficiency import run_efficiency_bounds
from fitness.kv_sharing import trace_kv_sharing
from fitness.scoring import FitnessContext
from fitness.validate import refit_terms, split_terms
from primitives.data.traces import load_steps
from primitives.errors import InputError
from primitives.language import evaluate_expr, parse_infix, to_infix
from primitives.registry import supported_primitives

BATCH_QUANTILES = 5


def error_by_quantile(x: np.ndarray, pred: np.ndarray, obs: np.ndarray, k: int = BATCH_QUANTILES) -> list[dict]:
    """Rows of ``x``'s quantile bins: each bin's range of ``x``, its rows, the signed bias
    mean(pred / obs - 1) and the MAPE.

    The bins cut the rows sorted by ``x`` near every k-th share of them, but only where
    ``x`` changes: rows of equal ``x`` (a trace's many steps at the 128-request cap) share
    a bin, so a bin's range never overlaps the next, and there are fewer than ``k`` bins
    where ``x`` has few distinct values.
    """
    order = np.argsort(x, kind="stable")
    xs = x[order]
    changes = np.flatnonzero(xs[1:] != xs[:-1]) + 1  # positions where the sorted x steps up
    cuts: list[int] = []
    if len(changes):
        for i in range(1, k):
            target = i * len(xs) / k
            cut = int(changes[np.argmin(np.abs(changes - target))])
            if cut not in cuts:
                cuts.append(cut)
    out = []
    for part in np.split(order, sorted(cuts)):
        ratio = pred[part] / obs[part] - 1.0
        out.append(
            {
                "from": float(x[part].min()),
                "to": float(x[part].max()),
                "n": int(len(part)),
                "bias": float(ratio.mean()),
                "mape": float(np.abs(ratio).mean()),
            }
        )
    return out


def entry_step_table(entry, data_paths: list, resolver, experiments_dir=None, seed: int = 0):
    """(the entry's expression, the traces' step table with its primitives, the KV sharing
    factors applied or None, whether the traces count requests)."""
    data = load_steps([Path(p) for p in data_paths])
    expr = parse_infix(entry.expression)
    names = sorted(s.name for s in expr.free_symbols)
    missing = [n for n in names if n not in supported_primitives(data.available_features)]
    if missing:
        raise InputError(
            ", ".join(data.sources), missing[0], "the expression needs per-request detail this trace lacks"
        )
    by_batch = "batch_size" in supported_primitives(data.available_features)
    wanted = sorted({*names, "batch_size"} if by_batch else names) or None
    sharing = trace_kv_sharing(data, experiments_dir, resolver, seed) if experiments_dir else None
    table = build_step_table(data, resolver, wanted, validation_fraction=0.0, kv_sharing=sharing)
    return expr, table, sharing, by_batch


def score_entry(entry, data_paths: list, resolver, experiments_dir=None, seed: int = 0) -> list[dict]:
    """Per-experiment step error of an archived expression (its constants as stored).

    Returns dicts with experiment, n (cycle-time targets), mape and median_ape
    (fractions), over every target row of the given traces, and ``by_batch_size``
    (``error_by_quantile`` of the requests per step) where the traces count requests.
    With ``experiments_dir``, block-counted KV is scaled to the per-request sum as the
    search does (``fitness.kv_sharing``; the workload simulated with ``seed``); each row's
    ``kv_sharing`` is the factor applied, None where none was.
    """
    return score_table(*entry_step_table(entry, data_paths, resolver, experiments_dir, seed))


def score_table(expr: sp.Expr, table, sharing: dict | None, by_batch: bool) -> list[dict]:
    """``score_entry``'s rows from its step table (``entry_step_table``, built once where
    ``deployment_transfer`` reads it too)."""
    pred = np.maximum(evaluate_expr(expr, table.columns, table.n), 1.0)
    obs = table.cycle_time_us
    ape = np.abs(pred - obs) / obs
    out = []
    for e, name in enumerate(table.experiment_names):
        rows = table.experiment == e
        row = {
            "experiment": name,
            "n": int(rows.sum()),
            "mape": float(ape[rows].mean()),
            "median_ape": float(np.median(ape[rows])),
            "kv_sharing": (sharing or {}).get(name),  # the factor its block-counted KV was scaled by
        }
        if by_batch:
            row["by_batch_size"] = error_by_quantile(table.columns["batch_size"][rows], pred[rows], obs[rows])
        out.append(row)
    return out


def deployment_transfer(entry, expr: sp.Expr, table) -> list[dict]:
    """Leave one deployment out: per deployment of TABLE, its steps, the MAPE of the entry's
    constants as stored and refitted without the deployment's steps, the refit (infix; None,
    and no MAPE, where it fails) and whether the refit's constants are pinned. They are not
    where the intercept and the terms constant within each deployment (``tp``, ``n_layers``,
    ...) outnumber the deployments fitted on: the least squares then splits one constant
    among them by its small ridge, one split of many. Raises InputError with one deployment.

    The terms are the stored expression's, each µs primitive in one, as the search bounds
    them (``fitness.efficiency.term_intervals``).
    """
    row_deployment = np.asarray(table.experiment_deployment)[table.experiment]
    present = sorted(set(row_deployment.tolist()))
    if len(present) < 2:
        raise InputError("--lodo", None, "needs steps of two or more deployments (model, TP, GPU); these hold one")
    bounds = run_efficiency_bounds(entry.run_config)
    _, terms, _ = split_terms(expr)
    obs = table.cycle_time_us
    stored = np.maximum(evaluate_expr(expr, table.columns, table.n), 1.0)
    columns = [np.broadcast_to(evaluate_expr(t, table.columns, table.n), (table.n,)) for t in terms]
    out = []
    for d in present:
        held = row_deployment == d
        dep = table.deployments[d]
        fitted_on = [x for x in present if x != d]
        constant_terms = sum(_constant_within(c, row_deployment, fitted_on) for c in columns)
        row = {
            "deployment": f"{dep.model.name} tp{dep.tp} {dep.gpu.name}",
            "n": int(held.sum()),
            "mape_stored": float(np.mean(np.abs(stored[held] - obs[held]) / obs[held])),
            "mape_refit": None,
            "refit": None,
            "pinned": 1 + constant_terms <= len(fitted_on),  # the intercept and those terms
        }
        fitted = refit_terms(terms, FitnessContext(table.subset(~held), efficiency_bounds=bounds))
        if fitted is not None:
            cols = {k: v[held] for k, v in table.columns.items()}
            pred = np.maximum(evaluate_expr(fitted[0], cols, int(held.sum())), 1.0)
            row["mape_refit"] = float(np.mean(np.abs(pred - obs[held]) / obs[held]))
            row["refit"] = to_infix(fitted[0])
        out.append(row)
    return out


def _constant_within(column: np.ndarray, row_deployment: np.ndarray, deployments: list[int]) -> bool:
    """Whether COLUMN takes one value on all the rows of each of DEPLOYMENTS."""
    for d in deployments:
        values = column[row_deployment == d]
        if len(values) and np.ptp(values) > 1e-9 * max(float(np.abs(values).max()), 1.0):
            return False
    return True
