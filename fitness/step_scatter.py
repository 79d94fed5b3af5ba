"""How much real steps scatter around the time their work predicts, measured in the traces.

Two real steps with the same batch (decode requests, prefill tokens, KV tokens) do not take
the same time: the traces show a body of a few percent and a tail of stalls (1% of steps
take 1.2x the time of their neighbours, the slowest over 2x). A simulator whose steps take
exactly the model's time has no such stalls, so its TTFT tail is too short and it queues
too little near saturation (waiting grows with the variance of the service time).

The measurement needs no step-time model: each trace step's cycle time over the median
cycle time of its ``NEIGHBOURS`` nearest steps of the same experiment in (decode requests,
prefill tokens, KV tokens), standardised. The pooled ratios are divided by their mean (the
model predicts the mean step; the scatter must not move it) and kept as ``QUANTILES``
quantiles. A simulated step's time is the model's times a draw from them, seeded.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from primitives import checks
from primitives.errors import InputError

if TYPE_CHECKING:
    from fitness.dataset import StepTable

NEIGHBOURS = 15  # steps compared with each step: enough for a stable median, few enough to stay local
QUANTILES = 256
MIN_STEPS = 4 * NEIGHBOURS  # per experiment; fewer cannot tell scatter from a changing batch
FEATURES = ("num_decode_reqs", "prefill_tokens", "kv_tokens")
SCALES_PER_RUN = 1 << 18  # step multipliers drawn per simulated run, reused cyclically beyond
SCATTER_STREAM = 0x5CA7  # the draws' own random stream, apart from the load's under the same seed
RUN_SCATTER = "run"  # where a scatter is asked for: the one the entry's run measured (``run_scatter``)


@dataclass(frozen=True)
class StepScatter:
    """Quantiles of (a step's time / its neighbours' median), mean 1, and where they came from."""

    quantiles: tuple[float, ...]
    steps: int  # trace steps measured
    source: str

    def summary(self) -> dict:
        """Where it came from and a few of its percentiles (``top``: the highest quantile kept, p99.8)."""
        q = np.asarray(self.quantiles)
        pick = {f"p{p:g}": float(np.quantile(q, p / 100)) for p in (1, 50, 90, 99)}
        return {"source": self.source, "steps": self.steps, **pick, "top": float(q.max())}

    def to_dict(self) -> dict:
        """As a run records it (``run.json``)."""
        return {"quantiles": list(self.quantiles), "steps": self.steps, "source": self.source}

    @classmethod
    def from_dict(cls, d, path: object = "run.json") -> "StepScatter":
        """A recorded scatter, every field checked."""
        if not isinstance(d, dict):
            raise InputError(path, "step_scatter", f"expected a mapping (quantiles, steps, source), got {d!r}")
        q = d.get("quantiles")
        if not isinstance(q, list) or not q:
            raise InputError(path, "step_scatter.quantiles", "expected a non-empty list of positive numbers")
        # quantiles of mean 1: none can exceed their count (measure_scatter can reach it), so more is damage
        bound = max(QUANTILES, len(q))
        values = [checks.number(v, path, f"step_scatter.quantiles[{i}]", upper=bound) for i, v in enumerate(q)]
        steps = checks.number(d.get("steps"), path, "step_scatter.steps", integer=True)
        source = checks.text(d.get("source"), path, "step_scatter.source", "the traces it was measured on")
        return cls(tuple(float(v) for v in values), int(steps), source)

    def scales(self, seed: int, n: int = SCALES_PER_RUN) -> np.ndarray:
        """N step-time multipliers for the simulated run of load seed SEED (reproducible)."""
        rng = np.random.default_rng([SCATTER_STREAM, int(seed)])
        return np.asarray(self.quantiles)[rng.integers(0, len(self.quantiles), n)]


def recorded_scatter(recorded: dict | None) -> StepScatter | None:
    """A run's ``step_scatter`` field (``StepScatter.to_dict``) as a scatter, or None where it has none."""
    return StepScatter.from_dict(recorded) if recorded is not None else None


def run_scatter(run_config: dict | None) -> StepScatter | None:
    """The scatter an archived run measured (its ``run.json`` mapping), or None (none, or a run from before)."""
    return recorded_scatter((run_config or {}).get("step_scatter"))


def describe_scatter(summary: dict) -> str:
    """One line on a scatter (``StepScatter.summary``)."""
    return (
        f"simulated steps scatter as the {summary['steps']} steps of {summary['source']} do around"
        f" their neighbours (p50 x{summary['p50']:.3f}, p99 x{summary['p99']:.2f}, p99.8 x{summary['top']:.2f})"
    )


def step_scales(scatter: StepScatter | None, seed: int) -> np.ndarray | None:
    """The step multipliers of the run with load seed SEED, or None without a scatter."""
    return scatter.scales(seed) if scatter is not None else None


def _standardised(features: np.ndarray, reference: np.ndarray | None = None) -> np.ndarray:
    """FEATURES centred and scaled by REFERENCE's columns (its own by default); a column that
    does not vary there is only centred."""
    ref = features if reference is None else reference
    spread = ref.std(axis=0)
    return (features - ref.mean(axis=0)) / np.where(spread > 0, spread, 1.0)


def neighbour_ratios(
    features: np.ndarray, cycle_time_us: np.ndarray, times_s: np.ndarray | None = None, apart_s: float = 0.0
) -> np.ndarray:
    """Each step's cycle time over the median of its NEIGHBOURS nearest steps' (itself excluded).

    With ``times_s``, a step's neighbours are only steps at least ``apart_s`` away from it in
    time (so that slowness that lasts does not hide in its own neighbours). The nearest
    ``NEIGHBOURS * 8`` in features are searched; where fewer than half of ``NEIGHBOURS``
    qualify, the ratio is NaN.
    """
    from scipy.spatial import cKDTree  # only where a scatter is measured

    x = _standardised(features)
    if times_s is None:
        _, idx = cKDTree(x).query(x, k=NEIGHBOURS + 1)
        # a step is its own nearest neighbour, except among identical batches, where it may come
        # later or not at all: put the farthest one in its place, then keep the NEIGHBOURS nearest
        idx = np.where(idx == np.arange(len(x))[:, None], idx[:, -1:], idx)[:, :NEIGHBOURS]
        return cycle_time_us / np.median(cycle_time_us[idx], axis=1)
    _, idx = cKDTree(x).query(x, k=min(NEIGHBOURS * 8, len(x)))
    idx = np.atleast_2d(idx)
    far = np.abs(times_s[idx] - times_s[:, None]) >= apart_s
    far &= idx != np.arange(len(x))[:, None]  # never itself, even at apart_s 0
    first = np.argsort(~far, axis=1, kind="stable")[:, :NEIGHBOURS]  # the nearest that qualify, in order
    chosen = np.take_along_axis(idx, first, axis=1)
    ok = np.take_along_axis(far, first, axis=1)
    with warnings.catch_warnings():  # a row without any: NaN (below)
        warnings.simplefilter("ignore", RuntimeWarning)
        reference = np.nanmedian(np.where(ok, cycle_time_us[chosen], np.nan), axis=1)
    reference[ok.sum(axis=1) < NEIGHBOURS // 2] = np.nan  # too few to price it
    return cycle_time_us / reference  # NaN where fewer than half the neighbours qualify


def holdout_reference(table: StepTable, neighbours: int = NEIGHBOURS) -> dict[str, tuple[int, float, float]]:
    """Experiment -> (holdout rows, a formula-free reference for its holdout step MAPE, and
    that figure's standard error, both in %).

    Each temporal-holdout row is priced at the median cycle time of its NEIGHBOURS nearest
    training rows of the same experiment in FEATURES (standardised on those rows): what a
    lookup of like steps from the same run gets, with no formula. It is a reference, not a
    bound: a formula can land below it (a median is not the best predictor of a percentage
    error, and a lookup cannot extrapolate), and it moves with NEIGHBOURS. The standard error
    (of the mean of the rows' errors) says how far a holdout MAPE moves with which steps of
    the held-out block it holds. Experiments without a holdout, or with fewer training rows
    than NEIGHBOURS, are left out.
    """
    from scipy.spatial import cKDTree  # only where a reference is measured

    if neighbours < 1:
        raise ValueError(f"neighbours: expected 1 or more, got {neighbours}")
    features = np.column_stack([table.columns[f] for f in FEATURES]).astype(np.float64)
    out: dict[str, tuple[int, float, float]] = {}
    for e in np.unique(table.experiment):
        rows = table.experiment == e
        train, held = rows & table.is_train, rows & ~table.is_train
        if not held.any() or train.sum() < neighbours:
            continue
        _, idx = cKDTree(_standardised(features[train])).query(
            _standardised(features[held], features[train]), k=neighbours
        )
        idx = np.asarray(idx).reshape(int(held.sum()), neighbours)  # k = 1 gives one index per row
        predicted = np.median(table.cycle_time_us[train][idx], axis=1)
        observed = table.cycle_time_us[held]
        errors = 100 * np.abs(predicted - observed) / observed
        se = float(errors.std(ddof=1) / np.sqrt(len(errors))) if len(errors) > 1 else float("nan")
        out[table.experiment_names[e]] = (len(errors), float(errors.mean()), se)
    return out


def measure_scatter(table: StepTable, source: str) -> StepScatter:
    """The scatter of TABLE's steps (every experiment with at least MIN_STEPS rows)."""
    ratios = []
    for e in np.unique(table.experiment):
        rows = table.experiment == e
        if rows.sum() < MIN_STEPS:
            continue
        features = np.column_stack([table.columns[f][rows] for f in FEATURES]).astype(np.float64)
        ratios.append(neighbour_ratios(features, table.cycle_time_us[rows].astype(np.float64)))
    if not ratios:
        raise InputError(source, None, f"no experiment with {MIN_STEPS} or more step rows to measure the scatter on")
    pooled = np.concatenate(ratios)
    q = np.quantile(pooled, (np.arange(QUANTILES) + 0.5) / QUANTILES)
    return StepScatter(tuple(_kept_digits(float(v)) for v in q / q.mean()), len(pooled), source)


def _kept_digits(value: float) -> float:
    """VALUE to 6 decimals, and to 6 significant digits below 0.1: a step far faster than its
    neighbours (a ratio under 5e-7) stays positive, as a recorded scatter must be."""
    return round(value, 6) if value >= 0.1 else float(f"{value:.6g}")
