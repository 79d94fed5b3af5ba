"""``validate --load-draws N``: each experiment simulated with N draws of the load
(arrival times, prompt lengths), compared by their mean, with their range beside it
(where the server saturates, one draw can put a tail tens of percent away from another)."""

from pathlib import Path

import pytest
from matplotlib.container import ErrorbarContainer
from test_validate import LLAMA_7B, entry, observe, write_experiment

from evolve.validation import validate_entry
from evolve.validation_view import predicted_vs_observed_figure
from fitness.step_scatter import StepScatter
from fitness.validate import compare, summarise
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
    assert got["no_success_draws"] == 0
    assert got["e2e_mean_obs_in_range"] is True and got["e2e_p90_obs_in_range"] is True
    low = compare([_metrics(4, 0, 1.1, 2.2), _metrics(4, 0, 1.2, 2.4)], obs)  # both draws above it
    assert low["e2e_mean_obs_in_range"] is False and low["ttft_mean_obs_in_range"] is None
    assert summarise([got, low, {**low, "e2e_mean_obs_in_range": None}])["obs_in_range"]["e2e_mean"] == [1, 2]
    one = compare([_metrics(3, 1, 1.0, 2.0)], obs)  # one realisation: no range fields, figures as they were
    assert one["e2e_mean_pred_s"] == 1.0 and "e2e_mean_pred_min_s" not in one and "no_success_draws" not in one
    assert "e2e_mean_obs_in_range" not in one and "obs_in_range" not in summarise([one])
    assert one["failure_fraction_pred"] == 0.25


def test_a_draw_that_serves_nothing_scores_worst():
    """As with one draw: a model that serves nothing in any draw gets the worst score, not the
    mean of the draws that did serve."""
    obs = _metrics(4, 0, 1.0, 2.0)
    got = compare([_metrics(4, 0, 1.0, 2.0), LifecycleMetrics(0, 4)], obs)
    assert got["e2e_mean_pred_s"] == 1.0  # the serving draw's figure, for what it is worth
    assert got["e2e_mean_error"] == float("inf") and got["e2e_p90_error"] == float("inf")
    assert got["no_success_draws"] == 1 and got["failure_fraction_pred"] == 0.5
    assert (got["successes_pred"], got["failures_pred"]) == (2, 2) and isinstance(got["successes_pred"], int)


def test_validate_compares_the_mean_of_the_seeds_own_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stages = [(4.0, 6), (8.0, 6)]
    observe(write_experiment(tmp_path, "exp-a-llama-2-7b-tp1-general", *LLAMA_7B, stages=stages))
    resolver = default_resolver()
    single = [validate_entry(entry(), tmp_path, None, resolver, jobs=1, seed=s)["experiments"][0] for s in (0, 1, 2)]
    res = validate_entry(entry(), tmp_path, None, resolver, jobs=2, load_draws=3)
    (item,) = res["experiments"]
    assert res["load_draws"] == 3 and item["load_seeds"] == [0, 1, 2]
    for key in ("e2e_mean", "ttft_p90", "itl_p99"):
        runs = [s[f"{key}_pred_s"] for s in single]
        assert len(set(runs)) > 1  # the draws differ, so the check means something
        assert item[f"{key}_pred_s"] == pytest.approx(sum(runs) / 3)
        assert (item[f"{key}_pred_min_s"], item[f"{key}_pred_max_s"]) == (min(runs), max(runs))
        assert item[f"{key}_error"] == pytest.approx(item[f"{key}_pred_s"] / item[f"{key}_obs_s"] - 1)
    for i, stage in enumerate(item["stages"]):  # per stage too
        runs = [s["stages"][i]["e2e_mean_pred_s"] for s in single]
        assert stage["e2e_mean_pred_s"] == pytest.approx(sum(runs) / 3)
        assert stage["e2e_mean_pred_max_s"] == max(runs)
    # --seed S: the draws start at S (draws 1 and 2 here, the same runs as above)
    later = validate_entry(entry(), tmp_path, None, resolver, jobs=1, seed=1, load_draws=2)
    (shifted,) = later["experiments"]
    assert later["load_seed"] == 1 and shifted["load_seeds"] == [1, 2]
    pair = [s["e2e_mean_pred_s"] for s in single[1:]]
    assert shifted["e2e_mean_pred_s"] == pytest.approx(sum(pair) / 2)
    assert single[0]["e2e_error"] == pytest.approx(0.0, abs=1e-9)  # seed 0 made the 'observation'
    fig = predicted_vs_observed_figure(res["experiments"], "t")
    bars = [c for ax in fig.axes for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 3 and "mean of 3 draws of the load" in fig._suptitle.get_text()


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
    assert Path(slow["plot"]).name == "validate-abc123-x1.5.png" != Path(base["plot"]).name  # both kept
    with pytest.raises(InputError, match="only with the closed-loop validation"):
        validate_entry(entry(), tmp_path, "lowo", resolver, jobs=1, step_time_scale=1.5)


def test_transfer_checks_and_the_baseline_take_as_many_draws(tmp_path, monkeypatch):
    import evolve.baseline as baseline

    monkeypatch.chdir(tmp_path)
    for workload in ("general", "codegen"):
        observe(
            write_experiment(tmp_path, f"exp-{workload}-llama-2-7b-tp1-{workload}", *LLAMA_7B, rate=3.0, duration=6)
        )
    res = validate_entry(entry(), tmp_path, "lowo", default_resolver(), jobs=1, load_draws=2)
    assert res["load_draws"] == 2 and [i["load_seeds"] for i in res["experiments"]] == [[0, 1], [0, 1]]
    assert all("e2e_mean_pred_max_s" in i for i in res["experiments"])
    seen = []
    real = baseline.closed_loop_runs

    def spy(runs, resolver, settings, tails=True):
        seen.append((settings.load_draws, settings.scatter))
        return real(runs, resolver, settings, tails)

    monkeypatch.setattr(baseline, "closed_loop_runs", spy)
    scatter = StepScatter((0.9, 1.0, 1.1), 3, "traces")  # and the same step scatter
    res = validate_entry(
        entry(), tmp_path, None, default_resolver(), jobs=1, load_draws=2, baseline=True, step_scatter=scatter
    )
    assert seen == [(2, scatter)] and all(i["load_seeds"] == [0, 1] for i in res["baseline"]["experiments"])
    assert res["step_scatter"]["source"] == "traces"
