"""An experiment whose simulation serves no request successfully is a finding, not a crash
(issue 14, item 2): ``run`` refuses it naming the limit, ``validate`` reports it with every
request failed, and the closed-loop score of such a candidate is the worst one."""

import json
import warnings

import pytest
from test_bad_input import EXP_CONFIG, _experiment, _metrics, assert_one_line_error, call, run_args

from evolve.validation_view import plot_predicted_vs_observed
from fitness.sim.engine import simulate
from fitness.sim.loadgen import no_success_reason
from fitness.sim.models import reference_model
from fitness.validate import ClosedLoopSettings, closed_loop_runs, summarise
from primitives.data.experiments import load_experiment
from primitives.deployment import DeploymentResolver

SEVENTY_B_TP1 = EXP_CONFIG.replace("Llama-2-7b", "Llama-2-70b")


@pytest.mark.parametrize(
    "case,exp_config,field,needle",
    [
        ("tiny_max_model_len", EXP_CONFIG.replace("4096", "64"), "max_model_len", "below the shortest request"),
        ("70b_at_tp1", SEVENTY_B_TP1, "gpu_memory_utilization", "weights"),
        ("tiny_memory_share", EXP_CONFIG + "gpu_memory_utilization: 0.1\n", "gpu_memory_utilization", "KV cache"),
    ],
)
def test_run_refuses_an_experiment_no_request_can_survive(case, exp_config, field, needle, work, capsys):
    _experiment(work / "exps", exp_config=exp_config)
    rc, _, err = call(run_args("good.csv", "--experiments", "exps"), capsys)
    assert_one_line_error(rc, err, "exp-config.yaml", field, "no request can succeed", needle)
    assert not (work / "runs").exists()


def test_a_100k_token_prompt_is_blamed_on_max_model_len(tmp_path):
    d = _experiment(tmp_path)
    cfg = d / "results" / "config.yaml"
    cfg.write_text(cfg.read_text().replace("system_prompt_len: 100", "system_prompt_len: 100000"))
    spec = load_experiment(d)
    dep = DeploymentResolver().resolve_experiment(spec)
    field, why = no_success_reason(spec, dep)
    assert field == "max_model_len" and "4096" in why


def test_validate_reports_all_failed_and_scores_worst(tmp_path):
    spec = load_experiment(_experiment(tmp_path, exp_config=SEVENTY_B_TP1))
    one_job = ClosedLoopSettings(jobs=1)
    (item,) = closed_loop_runs([(spec, "weight_time_us", {})], DeploymentResolver(), one_job, tails=False)
    assert item["successes_pred"] == 0 and item["failure_fraction_pred"] == 1.0
    assert "weights" in item["no_success"]
    assert item["e2e_error"] == float("inf")  # the worst a candidate can score
    assert summarise([item])["e2e_error_mean"] == float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its plot has no point to draw: no legend warning on stderr either
        plot_predicted_vs_observed([item], tmp_path / "plot.png", "no success")


def test_a_model_that_times_everything_out_is_named_not_a_key_error(work, capsys):
    d = _experiment(work / "exps")
    cfg = d / "results" / "config.yaml"
    cfg.write_text(cfg.read_text().replace("load:\n", "load:\n  request_timeout: 0.001\n"))
    rc, _, err = call(run_args("good.csv", "--experiments", "exps"), capsys)
    assert_one_line_error(rc, err, "config.yaml", "load.request_timeout", "serves none of")


def test_a_zero_mean_latency_in_the_results_is_refused(work, capsys):
    zero = _metrics(e2e=0.0)
    _experiment(work / "exps", summary=json.dumps(zero))
    rc, _, err = call(run_args("good.csv", "--experiments", "exps"), capsys)
    assert_one_line_error(rc, err, "summary_lifecycle_metrics.json", "request_latency.mean", "positive")


def test_a_servable_experiment_has_no_reason(tmp_path):
    spec = load_experiment(_experiment(tmp_path))
    dep = DeploymentResolver().resolve_experiment(spec)
    assert no_success_reason(spec, dep) is None
    assert simulate(spec, dep, reference_model(dep), record=False).metrics.summary.successes > 0


def test_a_held_out_group_whose_runs_all_failed_is_explained_under_its_row():
    from rich.console import Console

    from evolve.validation_view import held_out_table

    failed = {"name": "x", "failures_obs": 500, "failure_fraction_obs": 1.0, "failure_fraction_pred": 0.97}
    served = {"name": "y", "failures_obs": 0, "failure_fraction_obs": 0.0, "failure_fraction_pred": 0.0}
    served |= {f"{m}_error": 0.05 for m in ("e2e", "ttft", "itl")}
    groups = {"Llama-2-7b-hf": summarise([failed]), "Mixtral-8x7B-v0.1": summarise([served])}
    console = Console(width=80, record=True)
    console.print(held_out_table(groups, "model"))
    lines = console.export_text().splitlines()
    (dashes,) = [line for line in lines if line.startswith(" Llama-2-7b-hf")]  # the table kept one line a group
    assert set(dashes.split()[1:]) == {"—"}
    text = " ".join(" ".join(lines).split())
    assert "Llama-2-7b-hf: every request of its real runs failed, no latency to compare" in text
    assert "its failed share predicted within 3.0 pp" in text
    assert not any(line.startswith("Mixtral-8x7B-v0.1:") for line in lines)  # a served group needs no note
    console = Console(width=80, record=True)
    console.print(held_out_table({"general": summarise([failed, served])}, "workload"))
    text = " ".join(console.export_text().split())
    assert "general 5.0% 5.0%" in text
    assert "general: 1 of its 2 real runs failed every request, not in its errors" in text
