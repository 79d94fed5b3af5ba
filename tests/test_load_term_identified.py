"""The load term of the queueing time is fitted only where one experiment is seen at two loads.

Across experiments the running count moves with the model and the prompt lengths, which
the fixed and per-token queueing terms carry too; a fit on one load per experiment (the
stage-transfer check's low-rate stages) could trade the slope against them, and the slope
is what extrapolates to higher loads (``fitness.replay_rows.load_slope_identified``).
"""

import math

import numpy as np
import pytest

from fitness.replay_rows import LOAD_SPREAD_MIN, ReplayRows, load_slope_identified
from fitness.scoring import FitnessContext, fit_terms
from fitness.sim.latency_model import FITTED_NON_STEP_NAMES
from fitness.transfer import linear_transfer_error

BASE_US, PER_TOKEN_US, PER_RUNNING_US, STEP_PRICE = 5000.0, 2.0, 80.0, 3.0


def test_identified_only_by_one_experiment_at_two_loads():
    e = np.array([0, 0, 0, 1, 1, 1])
    # one experiment, its running count 10 and 25 in two of its rows (ITL rows hold 0)
    assert load_slope_identified(e, np.array([10.0, 25.0, 0.0, 40.0, 40.0, 0.0]))
    # two experiments at one load each: the counts differ only across experiments
    assert not load_slope_identified(e, np.array([10.0, 10.0, 0.0, 40.0, 40.0, 0.0]))
    # within one experiment, but closer than the spread it takes
    assert not load_slope_identified(e, np.array([10.0, 10.0 * LOAD_SPREAD_MIN * 0.99, 0.0, 40.0, 40.0, 0.0]))
    assert load_slope_identified(e, np.array([10.0, 10.0 * LOAD_SPREAD_MIN, 0.0, 40.0, 40.0, 0.0]))
    assert not load_slope_identified(e, np.zeros(6))


def experiment_rows(loads: list[tuple[float, float, float]]) -> tuple:
    """One experiment's TTFT rows, one per (running count at sending, mean prompt tokens,
    step part of the row in units of the step column): weights, overheads, observed."""
    n_rows = len(loads)
    weights = np.zeros((n_rows, n_rows))
    overhead = np.zeros((n_rows, len(FITTED_NON_STEP_NAMES)))
    observed = np.zeros(n_rows)
    for i, (running, tokens, steps) in enumerate(loads):
        weights[i, i] = 1.0
        queue = {
            "queueing_base_us": 1.0,
            "queueing_per_input_token_us": tokens,
            "queueing_per_running_request_us": running,
        }
        overhead[i] = [queue[n] for n in FITTED_NON_STEP_NAMES]
        observed[i] = STEP_PRICE * steps + BASE_US + PER_TOKEN_US * tokens + PER_RUNNING_US * running
    return {"x": np.array([s for _, _, s in loads])}, weights, overhead, observed


def replay_rows(experiments: list[list[tuple[float, float, float]]]) -> ReplayRows:
    built = [experiment_rows(loads) for loads in experiments]
    return ReplayRows(
        names=[f"e{i}-general" for i in range(len(built))],
        models=[f"m{i}" for i in range(len(built))],
        columns=[b[0] for b in built],
        weights=[b[1] for b in built],
        overhead=[b[2] for b in built],
        fixed_us=[np.zeros(len(b[3])) for b in built],
        observed_us=[b[3] for b in built],
        labels=[[("ttft", "all" if i == 0 else f"stage_{i - 1}") for i in range(len(b[3]))] for b in built],
    )


def fitted_queueing(experiments) -> dict[str, float]:
    """The fitted queueing terms; the fixed part with the step's intercept (each row here
    holds one step, so the two are one constant)."""
    score = fit_terms([lambda cols, n: cols["x"]], FitnessContext(None, replay_rows(experiments)))
    assert score.ok
    return {**score.overheads, "queueing_base_us": score.overheads["queueing_base_us"] + score.intercept}


# (running count at sending, mean prompt tokens, step time in units of the column)
ONE_LOAD_EACH = [[(10.0, 600.0, 9000.0)], [(30.0, 300.0, 16000.0)], [(20.0, 900.0, 12000.0)], [(45.0, 450.0, 25000.0)]]


def test_a_fit_on_one_load_per_experiment_leaves_the_load_term_at_zero():
    got = fitted_queueing(ONE_LOAD_EACH)
    assert got["queueing_per_running_request_us"] == 0.0
    assert got["queueing_base_us"] > 0  # the other queueing terms take what they can


def test_the_same_experiments_seen_at_two_loads_recover_the_load_term():
    two_loads = [
        loads + [(running * 3, tokens, steps * 1.5) for running, tokens, steps in loads] for loads in ONE_LOAD_EACH
    ]
    got = fitted_queueing(two_loads)
    assert got["queueing_per_running_request_us"] == pytest.approx(PER_RUNNING_US, rel=1e-6)
    assert got["queueing_base_us"] == pytest.approx(BASE_US, rel=1e-6)
    assert got["queueing_per_input_token_us"] == pytest.approx(PER_TOKEN_US, rel=1e-6)


def test_the_search_transfer_refits_follow_the_same_rule():
    """A held-out group whose remaining rows hold one load per experiment refits without the load term."""
    # raw columns [fixed, running count]; experiment 0 at two loads, experiment 1 at one
    raw = np.array([[1.0, 10.0], [1.0, 30.0], [1.0, 20.0]])
    observed = raw @ np.array([5.0, 0.5])  # 10, 20, 15
    a, b = raw / observed[:, None], np.ones(3)  # relative rows: a @ theta - b is the signed error
    experiment = np.array([0, 0, 1])
    whole_run = np.array([True, False, True])
    lower, upper = np.zeros(2), np.full(2, np.inf)
    args = (a, b, experiment, ["e2e"] * 3, whole_run, lower, upper)
    load = (raw[:, 1], 1)
    assert linear_transfer_error(*args, [[1]], load) == pytest.approx(0.0, abs=1e-9)  # experiment 0 pins both
    # without experiment 0, one load is left: the fixed part alone, 15 against experiment 0's 10
    assert linear_transfer_error(*args, [[0]], load) == pytest.approx(0.5)
    assert linear_transfer_error(*args, [[0]]) != pytest.approx(0.5)  # free, the slope takes a share


def test_the_search_passes_each_row_s_running_count_to_its_transfer_refits(monkeypatch):
    """fit_terms hands the rows' running counts and the load term's column to the
    first-order transfer refits: held out general, the roleplay runs left see one load
    each, and that refit leaves the load term at 0."""
    import fitness.scoring as scoring
    from fitness.transfer import linear_transfer_error as real

    seen = []

    def spy(*args):
        seen.append(args)
        return real(*args)

    monkeypatch.setattr(scoring, "linear_transfer_error", spy)
    two_loads = [
        loads + [(running * 3, tokens, steps * 1.5) for running, tokens, steps in loads] for loads in ONE_LOAD_EACH[:2]
    ]
    rows = replay_rows(two_loads + ONE_LOAD_EACH[2:])
    rows.names = ["a-general", "b-general", "c-roleplay", "d-roleplay"]
    rows.models = ["m0", "m1", "m0", "m1"]
    score = fit_terms([lambda cols, n: cols["x"]], FitnessContext(None, rows))
    (args,) = seen
    running, column = args[-1]
    assert column == 1 + 1 + FITTED_NON_STEP_NAMES.index("queueing_per_running_request_us")  # x, intercept, then
    assert sorted(set(running)) == [10.0, 20.0, 30.0, 45.0, 90.0]
    assert score.transfer_error == pytest.approx(real(*args))
    assert real(*args[:-1]) != pytest.approx(score.transfer_error)  # a free load term refits otherwise


def test_step_rows_and_replayed_rows_with_transfer_groups_fit_together():
    """A fit on real step rows and replayed rows at once, with workloads and models to hold
    out: the replay rows' experiments and the step rows' are different arrays."""
    from test_search import planted_table

    two_loads = [
        loads + [(running * 3, tokens, steps * 1.5) for running, tokens, steps in loads] for loads in ONE_LOAD_EACH[:2]
    ]
    rows = replay_rows(two_loads + ONE_LOAD_EACH[2:])
    rows.names = ["a-general", "b-general", "c-roleplay", "d-roleplay"]
    rows.models = ["m0", "m1", "m0", "m1"]
    rows.columns = [{"weight_time_us": c["x"]} for c in rows.columns]
    table = planted_table(noise=0.0)
    assert table.n != sum(len(o) for o in rows.observed_us)
    term = [lambda cols, n: cols["weight_time_us"]]
    score = fit_terms(term, FitnessContext(table, rows))
    assert score.ok
    assert {"step_mape", "replay_error", "transfer_error_linear"} <= set(score.objectives)
    assert all(math.isfinite(v) for v in score.objectives.values()), score.objectives
    assert score.transfer_error == score.objectives["transfer_error_linear"] > 0
    steps_only = fit_terms(term, FitnessContext(table))
    assert "replay_error" not in steps_only.objectives
    assert score.coefficients[0] != pytest.approx(steps_only.coefficients[0], rel=1e-3)  # the replayed rows weigh in
