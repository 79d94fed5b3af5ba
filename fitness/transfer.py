"""Transfer during the search: do a candidate's constants hold where they were not fitted?

The search fits one set of constants on every replayed experiment. A structure whose
constants are pinned only by the data of one workload or one model (its terms collinear
everywhere else) fits as well as a physical one, and fails on the next workload or model.
``linear_transfer_error`` measures that at the cost of a few small solves: for each
workload, then each model, it refits the constants on the other experiments' replay rows
(the same bounded least squares on their normal equations) and predicts the held-out
experiments' whole-run means with them, to first order (the rows are linear forms of the
step times around recorded batches; see ``fitness.replay_rows``). The step-trace rows stay
out of these refits: they come from experiments of one workload and weigh little beside
the replay rows.

The closed loop can amplify an error near saturation far beyond this first-order estimate
(``evolve.validation.transfer_errors`` measures that for the few models the run checks at
its end); what this estimate does see is constants that drift when the data that pinned
them is left out.
"""

from __future__ import annotations

import numpy as np

from fitness.bounded_lsq import bounded_gram
from fitness.replay_rows import bound_load_term
from primitives.data.experiments import workload_of

# Every acceptance goal of the transfer checks allows TTFT 1.5x the error of E2E and ITL.
TTFT_TOLERANCE_RATIO = 1.5
TRANSFER_ERROR_CAP = 1.0  # a held-out experiment's error counts at most 100%


def held_out_groups(names: list[str], models: list[str]) -> list[list[int]]:
    """Experiment indices held out together: each workload, then each model (where there are two or more)."""
    groups: list[list[int]] = []
    for key in (lambda e: workload_of(names[e]), lambda e: models[e]):
        by: dict[str, list[int]] = {}
        for e in range(len(names)):
            by.setdefault(key(e), []).append(e)
        if len(by) > 1:
            groups.extend(by[k] for k in sorted(by))
    return groups


def experiment_error(errors: dict[str, float]) -> float:
    """One held-out experiment's error: the worst of |E2E|, |ITL| and |TTFT| / 1.5, capped."""
    worst = max(
        abs(errors.get("e2e", 0.0)), abs(errors.get("itl", 0.0)), abs(errors.get("ttft", 0.0)) / TTFT_TOLERANCE_RATIO
    )
    return min(worst, TRANSFER_ERROR_CAP) if np.isfinite(worst) else TRANSFER_ERROR_CAP


def linear_transfer_error(
    a: np.ndarray,
    b: np.ndarray,
    row_experiment: np.ndarray,
    row_metric: list[str],
    row_whole_run: np.ndarray,
    lower: np.ndarray,
    upper: np.ndarray,
    groups: list[list[int]],
    load: tuple[np.ndarray, int] | None = None,
) -> float | None:
    """Mean ``experiment_error`` of every held-out experiment, each group refitted without it.

    ``a``, ``b``: the replay rows of the least squares (``a @ theta ~ b``, relative to the
    observed value, so the signed relative error of row i is ``a[i] @ theta - b[i]``);
    ``row_experiment``: each row's experiment index; ``row_metric`` its metric;
    ``row_whole_run``: whether it is a whole-run mean (the ones compared). A group whose
    refit fails counts at the cap. ``load``: each row's running count at sending and the
    load term's column; a refit whose rows cannot pin that term
    (``fitness.replay_rows.bound_load_term``) leaves it at 0, by the same rule as the full fit.
    None without any group.
    """
    if not groups:
        return None
    errors: list[float] = []
    for held in groups:
        out = np.isin(row_experiment, held)
        train = ~out
        top = upper if load is None else bound_load_term(upper, row_experiment[train], load[0][train], load[1])
        theta = bounded_gram(a[train].T @ a[train], a[train].T @ b[train], lower, top) if train.any() else None
        for e in held:
            rows = np.flatnonzero((row_experiment == e) & row_whole_run)
            if len(rows) == 0:
                continue
            if theta is None:
                errors.append(TRANSFER_ERROR_CAP)
                continue
            signed = a[rows] @ theta - b[rows]
            errors.append(experiment_error({row_metric[i]: float(v) for i, v in zip(rows, signed, strict=True)}))
    return float(np.mean(errors)) if errors else None


__all__ = [
    "TRANSFER_ERROR_CAP",
    "TTFT_TOLERANCE_RATIO",
    "experiment_error",
    "held_out_groups",
    "linear_transfer_error",
]
