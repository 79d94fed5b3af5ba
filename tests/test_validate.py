"""Closed-loop validation and leave-one-model-out on small hand-made experiments."""

import json

import pytest

from archive.entry import ArchiveEntry
from evolve.validation import validate_entry
from fitness.sim.engine import simulate
from fitness.sim.models import ExpressionLatencyModel
from fitness.validate import split_terms
from primitives.data.experiments import load_experiment
from primitives.deployment import default_resolver
from primitives.language import parse_infix

EXPR = "2000.0 + 1.1*weight_time_us + 1.3*kv_io_time_us + 30.0*allreduce_calls"
OVERHEADS = {"queueing_base_us": 8000.0}


def write_experiment(root, name, model, tp, rate=2.0, duration=10, output_len=40, max_num_seqs=128):
    d = root / name
    (d / "results").mkdir(parents=True)
    (d / "exp-config.yaml").write_text(
        f"model: {model}\ntensor_parallelism: {tp}\nmax_model_len: 4096\n"
        f"max_num_batched_tokens: 2048\nmax_num_seqs: {max_num_seqs}\n"
    )
    cfg = {
        "data": {
            "type": "shared_prefix",
            "shared_prefix": {
                "num_groups": 2,
                "num_prompts_per_group": 3,
                "system_prompt_len": 100,
                "question_len": 200,
                "output_len": output_len,
            },
        },
        "load": {"type": "constant", "stages": [{"rate": rate, "duration": duration}]},
    }
    (d / "profile.yaml").write_text(json.dumps(cfg))
    return d


def observe(d, expression=EXPR, overheads=OVERHEADS):
    """Write the lifecycle metrics that the closed loop itself predicts as 'observed'."""
    spec = load_experiment(d)
    dep = default_resolver().resolve(spec.model, spec.tp)
    m = simulate(spec, dep, ExpressionLatencyModel(expression, dep, overheads), seed=0, record=False).metrics.summary
    lat = {
        "request_latency": m.e2e_mean_s,
        "time_to_first_token": m.ttft_mean_s,
        "inter_token_latency": m.itl_mean_s,
        "time_per_output_token": m.tpot_mean_s,
    }
    summary = {
        "successes": {"count": m.successes, "latency": {k: {"mean": v} for k, v in lat.items()}},
        "failures": {"count": m.failures},
    }
    (d / "results" / "summary_lifecycle_metrics.json").write_text(json.dumps(summary))
    return m


def entry(expression=EXPR):
    return ArchiveEntry(
        id="abc123",
        expression=expression,
        simplified=expression,
        complexity=10,
        constants=[],
        objectives={},
        generation=0,
        primitives=[],
        overheads=dict(OVERHEADS),
    )


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
    for name, model, tp in [
        ("e1-llama-2-7b-tp1", "meta-llama/Llama-2-7b-hf", 1),
        ("e2-codellama-34b-tp2", "codellama/CodeLlama-34b-Instruct-hf", 2),
        ("e3-llama-2-70b-tp4", "meta-llama/Llama-2-70b-hf", 4),
        ("e4-mixtral-8x7b-tp2", "mistralai/Mixtral-8x7B-v0.1", 2),
    ]:
        for rate, workload in [(1.0, "codegen"), (4.0, "general")]:
            observe(write_experiment(tmp_path, f"{name}-{workload}", model, tp, rate=rate, duration=8, output_len=30))
    res = validate_entry(entry(), tmp_path, True, default_resolver(), jobs=1)
    assert res["lomo"] is True
    assert {i["held_out_model"] for i in res["experiments"]} == {
        "Llama-2-7b-hf",
        "CodeLlama-34b-Instruct-hf",
        "Llama-2-70b-hf",
        "Mixtral-8x7B-v0.1",
    }
    # the law that made the observations is in the expression's span, and three deployments
    # are left to pin its three per-deployment constants: the refits transfer
    assert res["summary"]["e2e_error_mean_over_models"] < 0.10
    for it in res["experiments"]:
        intercept, terms, coefs = split_terms(parse_infix(it["refit_expression"]))
        assert len(terms) <= 3 and all(c >= 0 for c in coefs)


def test_trajectories_are_recorded_at_the_observed_speed(tmp_path):
    """A 30% slow candidate is scaled back to the observed ITL before its batches are recorded."""
    from evolve.calibration import anchor
    from fitness.sim.models import AnchoredModel

    d = write_experiment(tmp_path, "exp-llama-2-7b-tp1-general", "meta-llama/Llama-2-7b-hf", 1, rate=4.0)
    observed = observe(d)
    spec = load_experiment(d)
    dep = default_resolver().resolve(spec.model, spec.tp)
    slow = ExpressionLatencyModel(f"1.3*({EXPR})", dep, OVERHEADS)
    model = AnchoredModel(slow, anchor(spec, dep, slow, seed=0).scale)
    assert model.scale == pytest.approx(1 / 1.3, rel=0.02)
    itl = simulate(spec, dep, model, seed=0, record=False).metrics.summary.itl_mean_s
    assert itl == pytest.approx(observed.itl_mean_s, rel=0.01)


def near_saturation(tmp_path):
    """A 7B run whose 16 slots are nearly always full: E2E moves ~2.4x, TTFT ~10x the step time."""
    d = write_experiment(
        tmp_path,
        "exp-llama-2-7b-tp1-general",
        "meta-llama/Llama-2-7b-hf",
        1,
        rate=19.0,
        duration=20,
        output_len=100,
        max_num_seqs=16,
    )
    observed = observe(d)
    spec = load_experiment(d)
    return spec, default_resolver().resolve(spec.model, spec.tp), observed


def test_anchor_solves_for_the_observed_itl_near_saturation(tmp_path):
    from evolve.calibration import ANCHOR_TOLERANCE, anchor
    from fitness.sim.models import AnchoredModel

    spec, dep, observed = near_saturation(tmp_path)
    slow = ExpressionLatencyModel(f"1.15*({EXPR})", dep, OVERHEADS)
    a = anchor(spec, dep, slow, seed=0)
    assert a.scale == pytest.approx(1 / 1.15, rel=0.02)
    itl = simulate(spec, dep, AnchoredModel(slow, a.scale), seed=0, record=False).metrics.summary.itl_mean_s
    assert abs(itl / observed.itl_mean_s - 1) < ANCHOR_TOLERANCE


def test_linearised_rows_follow_the_closed_loop_where_teacher_forcing_cannot(tmp_path):
    """Near saturation a 3% slower candidate moves E2E and TTFT far more than 3% in the
    closed loop; the gain-linearised rows predict that, plain teacher forcing does not."""
    import numpy as np

    from evolve.calibration import record_trajectory

    spec, dep, observed = near_saturation(tmp_path)
    truth = ExpressionLatencyModel(EXPR, dep, OVERHEADS)
    names = ["weight_time_us", "kv_io_time_us", "allreduce_calls"]
    t = record_trajectory(spec, dep, truth, names, seed=0)
    labels = dict(zip(t.labels, range(len(t.labels)), strict=True))
    assert t.gain[labels[("e2e", "all")]] > 1.5 and t.gain[labels[("ttft", "all")]] > 4
    assert (t.gain >= 0.5).all() and (t.gain <= 10).all()

    slower = ExpressionLatencyModel(f"1.03*({EXPR})", dep, OVERHEADS)
    closed = simulate(spec, dep, slower, seed=0, record=False).metrics.summary
    step_us = 1.03 * (
        2000.0
        + 1.1 * t.columns["weight_time_us"]
        + 1.3 * t.columns["kv_io_time_us"]
        + 30.0 * t.columns["allreduce_calls"]
    )
    queue = np.array([OVERHEADS["queueing_base_us"], 0.0])
    for m, field in [("e2e", "e2e_mean_s"), ("ttft", "ttft_mean_s")]:
        i = labels[(m, "all")]
        linearised = (t.weights[i] @ step_us + t.overhead[i] @ queue + t.fixed_us[i]) / 1e6
        forced = linearised - (t.gain[i] - 1) * (t.weights[i] / t.gain[i] @ (step_us / 1.03 * 0.03)) / 1e6
        truth_cl = getattr(closed, field)
        assert abs(linearised / truth_cl - 1) < 0.5 * abs(forced / truth_cl - 1)
        assert abs(linearised / truth_cl - 1) < 0.1  # first order: TTFT is convex in the step time


def test_linearise_keeps_the_recording_and_plain_teacher_forcing():
    import numpy as np

    from fitness.replay_rows import linearise

    rng = np.random.default_rng(0)
    w, fixed, rec = rng.random((3, 50)), rng.random(3), rng.random(50) * 1e4
    lw, lf = linearise(w, fixed, w @ rec, np.array([1.0, 2.5, 8.0]))
    assert np.allclose(lw @ rec + lf, w @ rec + fixed)  # unchanged at the recording
    assert np.allclose(lw[0], w[0]) and lf[0] == pytest.approx(fixed[0])  # gain 1 = teacher forcing
    other = rec * 1.02
    assert np.allclose((lw @ other + lf) - (w @ rec + fixed), np.array([1.0, 2.5, 8.0]) * (w @ (other - rec)))
