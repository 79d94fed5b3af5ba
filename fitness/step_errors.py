"""Per-step error of an archived expression on step traces (``python -m evolve score``).

Besides each experiment's MAPE, the signed error by batch size: the trace's steps split
into quantiles of the requests they carry, and in each the mean of predicted over
measured cycle time, minus one. A step-time model can match the mean and still get the
slope with batch size wrong (too cheap per request, too dear per step); that slope is
what decides a full batch of 128, where the visible runs rarely go.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fitness.dataset import build_step_table
from fitness.kv_sharing import trace_kv_sharing
from primitives.data.traces import load_steps
from primitives.errors import InputError
from primitives.language import evaluate_expr, parse_infix
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


def score_entry(entry, data_paths: list, resolver, experiments_dir=None, seed: int = 0) -> list[dict]:
    """Per-experiment step error of an archived expression (its constants as stored).

    Returns dicts with experiment, n (cycle-time targets), mape and median_ape
    (fractions), over every target row of the given traces, and ``by_batch_size``
    (``error_by_quantile`` of the requests per step) where the traces count requests.
    With ``experiments_dir``, block-counted KV is scaled to the per-request sum as the
    search does (``fitness.kv_sharing``; the workload simulated with ``seed``); each row's
    ``kv_sharing`` is the factor applied, None where none was.
    """
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
