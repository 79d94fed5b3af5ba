"""Does a model put experiments in the right order? Pairwise inversions and Kendall's tau.

A capacity planner compares configurations: of two experiments, which has the worse
tail. For a statistic (``e2e_p99``: the ``<stat>_obs_s`` and ``<stat>_pred_s`` fields of
the validation items), every pair of experiments whose observed values differ by more
than ``threshold`` (the larger over the smaller, minus one) counts; the model orders a
pair wrongly when its predictions do not differ in the same direction (a tie is wrong
too). Kendall's tau (``scipy.stats.kendalltau``, tau-b) over every experiment with both
values says the same over all pairs, close ones included.
"""

from __future__ import annotations

from itertools import combinations

import numpy as np
from scipy.stats import kendalltau

RANKED_STATS = ("e2e_p99", "ttft_p99")
RANK_THRESHOLD = 0.10


def ranking(items: list[dict], stat: str, threshold: float = RANK_THRESHOLD) -> dict:
    """The ranking check of one statistic over ITEMS (validation items with ``<stat>_obs_s``/``_pred_s``)."""
    rows = [
        (i["name"], float(i[f"{stat}_obs_s"]), float(i[f"{stat}_pred_s"]))
        for i in items
        if i.get(f"{stat}_obs_s") is not None and i.get(f"{stat}_pred_s") is not None
    ]
    pairs, inverted = 0, []
    for (na, oa, pa), (nb, ob, pb) in combinations(rows, 2):
        lo, hi = sorted((oa, ob))
        if not hi > lo * (1.0 + threshold):
            continue
        pairs += 1
        if (pa - pb) * (oa - ob) <= 0:
            inverted.append([na, nb])
    tau = None
    if len(rows) >= 2:
        t = kendalltau([r[1] for r in rows], [r[2] for r in rows]).statistic
        tau = float(t) if np.isfinite(t) else None
    return {
        "stat": stat,
        "threshold": threshold,
        "experiments": len(rows),
        "pairs": pairs,
        "inversions": len(inverted),
        "inverted_pairs": inverted,
        "kendall_tau": tau,
    }


def ranking_check(items: list[dict], baseline_items: list[dict] | None = None) -> list[dict]:
    """``ranking`` of each of ``RANKED_STATS``, with the baseline's inversions and tau beside when given."""
    out = []
    for stat in RANKED_STATS:
        row = ranking(items, stat)
        if baseline_items is not None:
            base = ranking(baseline_items, stat)
            row.update(
                baseline_experiments=base["experiments"],
                baseline_pairs=base["pairs"],
                baseline_inversions=base["inversions"],
                baseline_inverted_pairs=base["inverted_pairs"],
                baseline_kendall_tau=base["kendall_tau"],
            )
        out.append(row)
    return out
