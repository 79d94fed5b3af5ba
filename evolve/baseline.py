"""The BLIS blackbox baseline a validation is compared with.

BLIS's blackbox latency model prices a step as ``beta0 + beta1 * prefill_tokens + beta2 *
decode_tokens`` with three coefficients **per model** (and its queueing time per model too).
Here it is fitted on the same data the search fits on, the simplest honest way:

1. the replay rows of every experiment with results (mean E2E, TTFT and ITL of the whole
   run and of each load stage, as linear functions of the per-step times; teacher-forced
   and linearised around a closed loop anchored at the observed ITL), recorded once with
   the reference physics model (``evolve.calibration.refresh_replay_rows``, the search's own
   first recording), so the baseline does not depend on the model under test;
2. per model, the expression ``prefill_tokens + decode_tokens`` refitted on that model's
   rows only (``fitness.validate.refit``: intercept and coefficients >= 0, and BLIS's two
   queueing terms, a fixed part and one per prompt token);
3. every experiment simulated in the same closed loop as the model under test, with its
   model's fitted baseline (``fitness.validate.closed_loop_runs``).

A model whose every run with results failed every request has no latency to fit: it is
listed as ``unfitted`` and its runs are left out of the baseline (and of its ranking).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import sympy as sp

from evolve.calibration import refresh_replay_rows, scored_experiments
from fitness.validate import ONE_DRAW, ClosedLoopSettings, closed_loop_runs, refit
from primitives.deployment import DeploymentResolver
from primitives.errors import InputError

BLACKBOX_TERMS = ("prefill_tokens", "decode_tokens")
# BLIS's blackbox QueueingTime is alpha0 + alpha1 * input_len: no term for the load at arrival
BLACKBOX_QUEUEING = ("queueing_base_us", "queueing_per_input_token_us")
METHOD = (
    "BLIS blackbox, per model: beta0 + beta1*prefill_tokens + beta2*decode_tokens and the queueing terms "
    "alpha0 + alpha1*input_len, "
    "least squares on the replay rows (whole-run and per-stage mean E2E, TTFT, ITL) of that model's "
    "experiments, recorded with the reference physics model anchored at the observed ITL; then the closed loop"
)


def blackbox_baseline(
    experiments_dir,
    resolver: DeploymentResolver,
    settings: ClosedLoopSettings = ONE_DRAW,
) -> dict:
    """Fit the per-model blackbox on the experiments with results and validate it in the closed loop
    (with as many draws of the load, and the same step scatter, as the model it is compared with)."""
    specs = scored_experiments(Path(experiments_dir))
    rows = refresh_replay_rows(Path(experiments_dir), resolver, None, list(BLACKBOX_TERMS), settings)
    terms = [sp.Symbol(t) for t in BLACKBOX_TERMS]
    model_of = {s.name: resolver.resolve_experiment(s).model.name for s in specs}
    fitted: dict[str, dict] = {}
    unfitted = []  # models whose every run failed every request: no latency to fit, no baseline
    for model in sorted(set(rows.models)):
        mine = [e for e, m in enumerate(rows.models) if m == model]
        if not any(np.isfinite(rows.observed_us[e]).any() for e in mine):
            unfitted.append(model)
            continue
        got = refit(terms, rows, lambda e, _label, mine=mine: e in mine, fitted_non_step=BLACKBOX_QUEUEING)
        if got is None:
            raise InputError(experiments_dir, "results", f"could not fit the blackbox baseline of {model}")
        fitted[model] = {"expression": got[0], "overheads": got[1]}
    runs = [(s, fitted[m]["expression"], fitted[m]["overheads"]) for s in specs if (m := model_of[s.name]) in fitted]
    return {
        "method": METHOD,
        "models": fitted,
        "unfitted": unfitted,
        "experiments": closed_loop_runs(runs, resolver, settings),
    }
