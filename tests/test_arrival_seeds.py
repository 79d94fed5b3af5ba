"""``validate --arrival-seeds N``: each experiment simulated with N sequences of arrivals,
compared by their mean, with their range beside it (where the server saturates, one
sequence can put a tail tens of percent away from another)."""

import pytest
from matplotlib.container import ErrorbarContainer
from test_validate import LLAMA_7B, entry, observe, write_experiment

from evolve.validation import validate_entry
from evolve.validation_view import predicted_vs_observed_figure
from fitness.validate import compare
from primitives.data.experiments import LifecycleMetrics
from primitives.deployment import default_resolver


def _metrics(successes, failures, e2e_mean_s, e2e_p90_s):
    return LifecycleMetrics(successes, failures, e2e_mean_s, distributions={"e2e": {"p90": e2e_p90_s, "p99": 9.0}})


def test_compare_takes_the_mean_of_the_realisations_and_their_range():
    obs = _metrics(4, 0, 1.0, 2.0)
    got = compare([_metrics(3, 1, 1.0, 2.0), _metrics(4, 0, 1.2, 2.6)], obs)
    assert got["e2e_mean_pred_s"] == pytest.approx(1.1) and got["e2e_mean_error"] == pytest.approx(0.1)
    assert (got["e2e_mean_pred_min_s"], got["e2e_mean_pred_max_s"]) == (1.0, 1.2)
    assert got["e2e_p90_pred_s"] == pytest.approx(2.3) and got["e2e_p90_error"] == pytest.approx(0.15)
    assert got["failure_fraction_pred"] == pytest.approx(0.125)  # 1/4 and 0/4
    assert got["percentiles_s"]["e2e"]["pred"] == {"p90": pytest.approx(2.3), "p99": 9.0}
    assert got["ttft_mean_pred_s"] is None and got["ttft_mean_pred_min_s"] is None  # nothing to average
    one = compare([_metrics(3, 1, 1.0, 2.0)], obs)  # one realisation: no range fields, figures as they were
    assert one["e2e_mean_pred_s"] == 1.0 and "e2e_mean_pred_min_s" not in one
    assert one["failure_fraction_pred"] == 0.25


def test_validate_compares_the_mean_of_the_seeds_own_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stages = [(4.0, 6), (8.0, 6)]
    observe(write_experiment(tmp_path, "exp-a-llama-2-7b-tp1-general", *LLAMA_7B, stages=stages))
    resolver = default_resolver()
    single = [validate_entry(entry(), tmp_path, None, resolver, jobs=1, seed=s)["experiments"][0] for s in (0, 1, 2)]
    res = validate_entry(entry(), tmp_path, None, resolver, jobs=2, arrival_seeds=3)
    (item,) = res["experiments"]
    assert res["arrival_seeds"] == 3 and item["arrival_seeds"] == [0, 1, 2]
    for key in ("e2e_mean", "ttft_p90", "itl_p99"):
        runs = [s[f"{key}_pred_s"] for s in single]
        assert len(set(runs)) > 1  # the sequences of arrivals differ, so the check means something
        assert item[f"{key}_pred_s"] == pytest.approx(sum(runs) / 3)
        assert (item[f"{key}_pred_min_s"], item[f"{key}_pred_max_s"]) == (min(runs), max(runs))
        assert item[f"{key}_error"] == pytest.approx(item[f"{key}_pred_s"] / item[f"{key}_obs_s"] - 1)
    for i, stage in enumerate(item["stages"]):  # per stage too
        runs = [s["stages"][i]["e2e_mean_pred_s"] for s in single]
        assert stage["e2e_mean_pred_s"] == pytest.approx(sum(runs) / 3)
        assert stage["e2e_mean_pred_max_s"] == max(runs)
    assert single[0]["e2e_error"] == pytest.approx(0.0, abs=1e-9)  # seed 0 made the 'observation'
    fig = predicted_vs_observed_figure(res["experiments"], "t")
    bars = [c for ax in fig.axes for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 3 and "mean of 3 arrival sequences" in fig._suptitle.get_text()


def test_a_slower_step_what_if(tmp_path, monkeypatch):
    """``validate --step-time-scale F``: the closed loop with every step F times the model's."""
    from primitives.errors import InputError

    monkeypatch.chdir(tmp_path)
    observe(write_experiment(tmp_path, "exp-a-llama-2-7b-tp1-general", *LLAMA_7B, rate=4.0, duration=8))
    resolver = default_resolver()
    base = validate_entry(entry(), tmp_path, None, resolver, jobs=1)
    slow = validate_entry(entry(), tmp_path, None, resolver, jobs=1, step_time_scale=1.5)
    assert slow["step_time_scale"] == 1.5 and slow["expression"] == f"1.5*({entry().expression})"
    (a,), (b,) = base["experiments"], slow["experiments"]
    assert b["itl_mean_pred_s"] == pytest.approx(1.5 * a["itl_mean_pred_s"], rel=0.05)  # ITL is the step time
    assert b["e2e_mean_pred_s"] > a["e2e_mean_pred_s"] and b["ttft_mean_pred_s"] > a["ttft_mean_pred_s"]
    with pytest.raises(InputError, match="closed-loop validation only"):
        validate_entry(entry(), tmp_path, "lowo", resolver, jobs=1, step_time_scale=1.5)
