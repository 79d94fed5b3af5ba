"""First-order transfer during the search (fitness.transfer): refits without each workload and model."""

import numpy as np
import pytest

from fitness.transfer import (
    TRANSFER_ERROR_CAP,
    experiment_error,
    held_out_groups,
    linear_transfer_error,
)
from primitives.data.experiments import workload_of

NAMES = ["a-7b-general", "b-70b-general", "c-7b-codegen", "d-70b-codegen"]
MODELS = ["7b", "70b", "7b", "70b"]


def test_groups_hold_out_each_workload_then_each_model():
    assert workload_of("20260217-155451-llama-2-7b-tp1-codegen") == "codegen"
    assert held_out_groups(NAMES, MODELS) == [[2, 3], [0, 1], [1, 3], [0, 2]]
    assert held_out_groups(NAMES[:2], MODELS[:2]) == [[1], [0]]  # one workload: models only
    assert held_out_groups(["x-general"], ["7b"]) == []


def test_experiment_error_takes_the_worst_metric_ttft_at_its_looser_tolerance_and_caps():
    assert experiment_error({"e2e": 0.02, "itl": -0.03, "ttft": 0.06}) == pytest.approx(0.04)
    assert experiment_error({"e2e": 0.02, "itl": -0.05, "ttft": 0.06}) == pytest.approx(0.05)
    assert experiment_error({"e2e": 40.0}) == TRANSFER_ERROR_CAP
    assert experiment_error({"e2e": float("inf")}) == TRANSFER_ERROR_CAP


def rows(columns_per_experiment, theta):
    """One whole-run E2E row per experiment (a @ theta = b exactly) and one stage row."""
    a = np.array([c for c in columns_per_experiment for _ in range(2)], dtype=float)
    b = a @ np.asarray(theta, dtype=float)
    experiment = np.repeat(np.arange(len(columns_per_experiment)), 2)
    whole_run = np.tile([True, False], len(columns_per_experiment))
    return a, b, experiment, ["e2e"] * len(a), whole_run


def test_a_law_every_fold_can_pin_transfers_exactly():
    a, b, e, m, whole = rows([[0.5, 0.5], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]], [1.0, 1.0])
    lo, hi = np.zeros(2), np.full(2, np.inf)
    got = linear_transfer_error(a, b, e, m, whole, lo, hi, held_out_groups(NAMES, MODELS))
    assert got == pytest.approx(0.0, abs=1e-9)


def test_a_cost_only_one_workload_shows_is_missed_where_that_workload_is_held_out():
    # the second term is non-zero in the codegen runs only: without them the refit cannot see it
    a, b, e, m, whole = rows([[1.0, 0.0], [0.9, 0.0], [0.8, 0.2], [0.6, 0.4]], [1.0, 1.0])
    lo, hi = np.zeros(2), np.full(2, np.inf)
    got = linear_transfer_error(a, b, e, m, whole, lo, hi, held_out_groups(NAMES, MODELS))
    # held out, the codegen runs miss 0.2 and 0.4; every other fold sees both terms (8 held-out runs)
    assert got == pytest.approx((0.2 + 0.4) / 8)
    assert linear_transfer_error(a, b, e, m, whole, lo, hi, []) is None
