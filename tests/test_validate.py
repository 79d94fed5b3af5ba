"""Closed-loop validation and leave-one-model-out on small hand-made experiments."""
import json

import pytest

from archive.entry import ArchiveEntry
from fitness.experiments import load_experiment
from fitness.latency import ExpressionLatencyModel
from fitness.simulator import simulate
from fitness.validate import split_terms, validate_entry
from evolve.expression import parse_infix
from primitives.deployment import default_resolver

EXPR = "2000.0 + 1.1*weight_time_us + 1.3*kv_io_time_us + 30.0*allreduce_calls"
OVERHEADS = {"queueing_base_us": 8000.0}


def write_experiment(root, name, model, tp, rate=2.0, duration=10, output_len=40):
    d = root / name
    (d / "results").mkdir(parents=True)
    (d / "exp-config.yaml").write_text(
        f"model: {model}\ntensor_parallelism: {tp}\nmax_model_len: 4096\n"
        "max_num_batched_tokens: 2048\nmax_num_seqs: 128\n"
    )
    cfg = {"data": {"type": "shared_prefix", "shared_prefix": {"num_groups": 2, "num_prompts_per_group": 3,
           "system_prompt_len": 100, "question_len": 200, "output_len": output_len}},
           "load": {"type": "constant", "stages": [{"rate": rate, "duration": duration}]}}
    (d / "profile.yaml").write_text(json.dumps(cfg))
    return d


def observe(d, expression=EXPR, overheads=OVERHEADS):
    """Write the lifecycle metrics that the closed loop itself predicts as 'observed'."""
    spec = load_experiment(d)
    dep = default_resolver().resolve(spec.model, spec.tp)
    m = simulate(spec, dep, ExpressionLatencyModel(expression, dep, overheads), seed=0, record=False).metrics.summary
    lat = {"request_latency": m.e2e_mean_s, "time_to_first_token": m.ttft_mean_s,
           "inter_token_latency": m.itl_mean_s, "time_per_output_token": m.tpot_mean_s}
    summary = {"successes": {"count": m.successes, "latency": {k: {"mean": v} for k, v in lat.items()}},
               "failures": {"count": m.failures}}
    (d / "results" / "summary_lifecycle_metrics.json").write_text(json.dumps(summary))
    return m


def entry(expression=EXPR):
    return ArchiveEntry(id="abc123", expression=expression, simplified=expression, complexity=10, constants=[],
                        objectives={}, generation=0, primitives=[], overheads=dict(OVERHEADS))


def test_validate_reproduces_its_own_observations_and_keeps_withheld_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the plot of an entry without a run directory goes to the cwd
    a = write_experiment(tmp_path, "exp-a-llama-2-7b-tp1-general", "meta-llama/Llama-2-7b-hf", 1)
    write_experiment(tmp_path, "exp-b-llama-2-7b-tp1-reasoning", "meta-llama/Llama-2-7b-hf", 1, output_len=60)
    observed = observe(a)
    res = validate_entry(entry(), tmp_path, False, default_resolver(), jobs=1)
    items = {i["name"]: i for i in res["experiments"]}
    got = items["exp-a-llama-2-7b-tp1-general"]
    assert got["e2e_mean_obs_s"] == pytest.approx(observed.e2e_mean_s)
    for m in ("e2e", "ttft", "itl"):
        assert got[f"{m}_error"] == pytest.approx(0.0, abs=1e-9)
    withheld = items["exp-b-llama-2-7b-tp1-reasoning"]
    assert withheld["e2e_mean_pred_s"] > 0 and withheld["failures_pred"] == 0
    assert withheld["e2e_mean_obs_s"] is None and withheld["e2e_error"] is None and withheld["failures_obs"] is None
    assert res["summary"]["e2e_error_max"] == pytest.approx(0.0, abs=1e-9)
    assert res["plot"] and (tmp_path / "validate-abc123.png").is_file()


def test_lomo_refits_without_the_held_out_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, model, tp in [("e1-llama-2-7b-tp1", "meta-llama/Llama-2-7b-hf", 1),
                            ("e2-codellama-34b-tp2", "codellama/CodeLlama-34b-Instruct-hf", 2),
                            ("e3-llama-2-70b-tp4", "meta-llama/Llama-2-70b-hf", 4),
                            ("e4-mixtral-8x7b-tp2", "mistralai/Mixtral-8x7B-v0.1", 2)]:
        for rate, workload in [(1.0, "codegen"), (4.0, "general")]:
            observe(write_experiment(tmp_path, f"{name}-{workload}", model, tp, rate=rate, duration=8, output_len=30))
    res = validate_entry(entry(), tmp_path, True, default_resolver(), jobs=1)
    assert res["lomo"] is True
    assert {i["held_out_model"] for i in res["experiments"]} == {"Llama-2-7b-hf", "CodeLlama-34b-Instruct-hf",
                                                                 "Llama-2-70b-hf", "Mixtral-8x7B-v0.1"}
    # the law that made the observations is in the expression's span, and three deployments
    # are left to pin its three per-deployment constants: the refits transfer
    assert res["summary"]["e2e_error_mean_over_models"] < 0.10
    for it in res["experiments"]:
        intercept, terms, coefs = split_terms(parse_infix(it["refit_expression"]))
        assert len(terms) <= 3 and all(c >= 0 for c in coefs)


def test_trajectories_are_recorded_at_the_observed_speed(tmp_path):
    """A 30% slow candidate is scaled back to the observed ITL before its batches are recorded."""
    from fitness.replay_context import anchored

    d = write_experiment(tmp_path, "exp-llama-2-7b-tp1-general", "meta-llama/Llama-2-7b-hf", 1, rate=4.0)
    observed = observe(d)
    spec = load_experiment(d)
    dep = default_resolver().resolve(spec.model, spec.tp)
    slow = ExpressionLatencyModel(f"1.3*({EXPR})", dep, OVERHEADS)
    model = anchored(spec, dep, slow, seed=0)
    assert model.scale == pytest.approx(1 / 1.3, rel=0.02)
    itl = simulate(spec, dep, model, seed=0, record=False).metrics.summary.itl_mean_s
    assert itl == pytest.approx(observed.itl_mean_s, rel=0.01)
