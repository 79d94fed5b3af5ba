"""Closed-loop validation and leave-one-model-out on small hand-made experiments."""

import json

import numpy as np
import pytest

from archive.entry import ArchiveEntry
from evolve.config import REFIT_ROUNDS
from evolve.validation import validate_entry
from fitness.sim.engine import simulate
from fitness.sim.latency_model import FITTED_NON_STEP_NAMES
from fitness.sim.models import ExpressionLatencyModel
from fitness.validate import ClosedLoopSettings, split_terms
from primitives.data.experiments import LATENCY_FILE_KEYS, load_experiment
from primitives.deployment import default_resolver
from primitives.language import parse_infix

EXPR = "2000.0 + 1.1*weight_time_us + 1.3*kv_io_time_us + 30.0*allreduce_calls"
ONE_JOB = ClosedLoopSettings(jobs=1)  # the closed loop in this process
OVERHEADS = {"queueing_base_us": 8000.0}


def write_experiment(
    root, name, model, tp, rate=2.0, duration=10, output_len=40, max_num_seqs=128, stages=None, timeout=None
):
    """An experiment folder; ``stages`` [(rate, duration), ...] overrides the single stage."""
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
        "load": {
            "type": "constant",
            "stages": [{"rate": r, "duration": t} for r, t in (stages or [(rate, duration)])],
        },
    }
    if timeout is not None:
        cfg["load"]["request_timeout"] = timeout
    (d / "profile.yaml").write_text(json.dumps(cfg))
    return d


def _metrics_json(m) -> dict:
    """Lifecycle metrics as the load generator writes them: mean and percentiles (``median`` for p50)."""
    lat = {
        src: {"mean": getattr(m, f"{metric}_mean_s")}
        | {("median" if k == "p50" else k): v for k, v in m.distributions.get(metric, {}).items()}
        for metric, src in LATENCY_FILE_KEYS.items()
    }
    return {"successes": {"count": m.successes, "latency": lat}, "failures": {"count": m.failures}}


def observe(d, expression=EXPR, overheads=OVERHEADS):
    """Write the lifecycle metrics (summary and stages) that the closed loop itself predicts as 'observed'."""
    spec = load_experiment(d)
    dep = default_resolver().resolve(spec.model, spec.tp)
    model = ExpressionLatencyModel(expression, dep, overheads)
    metrics = simulate(spec, dep, model, seed=0, record=False, distributions=True).metrics
    (d / "results" / "summary_lifecycle_metrics.json").write_text(json.dumps(_metrics_json(metrics.summary)))
    if len(spec.stages) > 1:
        for i, st in enumerate(metrics.stages):
            (d / "results" / f"stage_{i}_lifecycle_metrics.json").write_text(json.dumps(_metrics_json(st)))
    return metrics.summary


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
    res = validate_entry(entry(), tmp_path, None, default_resolver(), jobs=1)
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
    res = validate_entry(entry(), tmp_path, "lomo", default_resolver(), jobs=1)
    assert res["lomo"] is True and res["mode"] == "lomo"
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
    queue = np.array([OVERHEADS.get(n, 0.0) for n in FITTED_NON_STEP_NAMES])
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


# --- failures as a metric, leave one workload out, stage transfer ----------------------
LLAMA_7B, LLAMA_70B = ("meta-llama/Llama-2-7b-hf", 1), ("meta-llama/Llama-2-70b-hf", 4)


def test_validate_reports_failure_fractions(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = write_experiment(tmp_path, "exp-a-llama-2-7b-tp1-general", *LLAMA_7B, rate=3.0, duration=8)
    m = observe(a)
    summary = json.loads((a / "results" / "summary_lifecycle_metrics.json").read_text())
    summary["failures"]["count"] = m.successes // 3  # the server lost a quarter of the requests
    (a / "results" / "summary_lifecycle_metrics.json").write_text(json.dumps(summary))
    # a 10 ms client timeout: no request can finish, in the simulator as in the 'observation'
    observe(write_experiment(tmp_path, "exp-b-llama-2-7b-tp1-codegen", *LLAMA_7B, rate=3.0, duration=8, timeout=0.01))
    write_experiment(tmp_path, "exp-c-llama-2-7b-tp1-reasoning", *LLAMA_7B, rate=3.0, duration=8)
    res = validate_entry(entry(), tmp_path, None, default_resolver(), jobs=1)
    items = {i["name"].split("-")[1]: i for i in res["experiments"]}
    assert items["a"]["failure_fraction_pred"] == 0.0
    assert items["a"]["failure_fraction_obs"] == pytest.approx((m.successes // 3) / (m.successes + m.successes // 3))
    assert items["b"]["failure_fraction_pred"] == 1.0 and items["b"]["failure_fraction_obs"] == 1.0
    assert items["c"]["failure_fraction_pred"] == 0.0 and items["c"]["failure_fraction_obs"] is None
    assert [st["stage"] for st in items["a"]["stages"]] == [0]
    assert items["a"]["stages"][0]["failure_fraction_pred"] == 0.0
    diff_a = 100 * items["a"]["failure_fraction_obs"]
    assert res["summary"]["failure_fraction_diff_pp_max"] == pytest.approx(diff_a)
    assert res["summary"]["failure_fraction_diff_pp_mean"] == pytest.approx(diff_a / 2)


def spy_on_refits(monkeypatch) -> list[dict[str, set]]:
    """Per refit: experiment -> the (metric, scope) rows that entered the least squares."""
    import fitness.validate as fv

    calls: list[dict[str, set]] = []
    real = fv.fit_terms

    def fit_terms(terms, ctx, *args, **kwargs):
        rp = ctx.replay
        calls.append(
            {
                name: {lab for lab, o in zip(labels, obs, strict=True) if np.isfinite(o)}
                for name, labels, obs in zip(rp.names, rp.labels, rp.observed_us, strict=True)
            }
        )
        return real(terms, ctx, *args, **kwargs)

    monkeypatch.setattr(fv, "fit_terms", fit_terms)
    return calls


def test_lowo_holds_out_each_workload_exactly_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for (model, tp), short in [(LLAMA_7B, "llama-2-7b-tp1"), (LLAMA_70B, "llama-2-70b-tp4")]:
        for rate, workload in [(1.0, "codegen"), (2.0, "roleplay"), (4.0, "general")]:
            observe(
                write_experiment(tmp_path, f"e-{short}-{workload}", model, tp, rate=rate, duration=8, output_len=30)
            )
        write_experiment(tmp_path, f"e-{short}-reasoning", model, tp, rate=1.0, duration=4)  # withheld results
    calls = spy_on_refits(monkeypatch)
    res = validate_entry(entry(), tmp_path, "lowo", default_resolver(), jobs=1)
    assert res["mode"] == "lowo" and res["lomo"] is False
    held = [i["held_out_workload"] for i in res["experiments"]]
    assert sorted(held) == ["codegen"] * 2 + ["general"] * 2 + ["roleplay"] * 2  # once each, on its own runs
    assert all(i["workload"] == i["held_out_workload"] for i in res["experiments"])
    assert set(res["summary"]["workloads"]) == {"codegen", "general", "roleplay"}
    assert res["summary"]["e2e_error_mean_over_workloads"] >= 0
    # three folds, each refitted on every experiment with results but the held-out workload's:
    # once on the entry's recording, then once on each re-recording of its training runs
    per_fold = 1 + REFIT_ROUNDS
    assert len(calls) == 3 * per_fold
    for i, workload in enumerate(["codegen", "general", "roleplay"]):
        for fitted in calls[i * per_fold : (i + 1) * per_fold]:
            assert {n.rsplit("-", 1)[-1] for n in fitted} == {"codegen", "general", "roleplay"} - {workload}
            assert len(fitted) == 4  # two models each: every row of them (single-stage runs: the whole-run rows)
            assert all(labels == {(m, "all") for m in ("e2e", "ttft", "itl")} for labels in fitted.values())
    assert "failure_fraction_pred" in res["experiments"][0] and "failure_fraction_diff_pp_max" in res["summary"]


def test_stage_split():
    from evolve.validation import stage_split

    def spec(*rates):
        return type("Spec", (), {"stages": tuple((r, 60.0) for r in rates)})()

    assert stage_split(spec(5.0, 10.0)) == ([0], [1])
    assert stage_split(spec(10.0, 5.0)) == ([1], [0])
    assert stage_split(spec(2.0, 8.0, 8.0, 4.0)) == ([0, 3], [1, 2])
    assert stage_split(spec(6.0)) == ([], []) and stage_split(spec(4.0, 4.0)) == ([], [])


def test_stage_transfer_fits_on_low_rate_stages_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for (model, tp), short in [(LLAMA_7B, "llama-2-7b-tp1"), (LLAMA_70B, "llama-2-70b-tp4")]:
        for workload, stages in [("codegen", [(1.0, 6), (3.0, 6)]), ("general", [(2.0, 6), (5.0, 6)])]:
            observe(write_experiment(tmp_path, f"e-{short}-{workload}", model, tp, output_len=30, stages=stages))
        observe(write_experiment(tmp_path, f"e-{short}-roleplay", model, tp, rate=2.0, duration=6, output_len=30))
    calls = spy_on_refits(monkeypatch)
    res = validate_entry(entry(), tmp_path, "stage-transfer", default_resolver(), jobs=1)
    assert len(calls) == 1 + REFIT_ROUNDS  # the entry's recording, then each re-recording
    for fitted in calls:
        assert len(fitted) == 4 and not any(n.endswith("roleplay") for n in fitted)  # single-rate runs: no split
        for labels in fitted.values():
            assert labels == {(m, "stage_0") for m in ("e2e", "ttft", "itl")}  # no whole-run rows, no high stage
    assert sorted(res["skipped"]) == ["e-llama-2-70b-tp4-roleplay", "e-llama-2-7b-tp1-roleplay"]
    assert all(v == {"fit": [0], "validated": [1]} for v in res["stage_split"].values())
    # reported: each split experiment's high-rate stage, against its stage_1 file
    assert len(res["experiments"]) == 4
    for it in res["experiments"]:
        assert it["stage"] == it["held_out_stage"] == 1 and it["rate_per_s"] in (3.0, 5.0)
        assert it["e2e_mean_obs_s"] is not None and it["failure_fraction_obs"] == 0.0
        assert abs(it["e2e_error"]) < 0.10  # the law that made the observations is in the expression's span
    assert res["summary"]["experiments"] == 4 and res["summary"]["failure_fraction_diff_pp_max"] == 0.0


# --- transfer checks inside the search's model selection ------------------------------
def test_transfer_errors_refit_every_check_and_cap_runaways(tmp_path, monkeypatch):
    import evolve.validation as ev
    from evolve.calibration import refresh_replay_rows, scored_experiments

    monkeypatch.chdir(tmp_path)
    for (model, tp), short in [(LLAMA_7B, "llama-2-7b-tp1"), (LLAMA_70B, "llama-2-70b-tp4")]:
        for workload, stages in [("codegen", [(1.0, 6), (3.0, 6)]), ("general", [(2.0, 6), (5.0, 6)])]:
            observe(write_experiment(tmp_path, f"e-{short}-{workload}", model, tp, output_len=30, stages=stages))
    resolver = default_resolver()
    names = ["weight_time_us", "kv_io_time_us", "allreduce_calls"]
    rows = refresh_replay_rows(tmp_path, resolver, entry(), names, ClosedLoopSettings(jobs=1))
    scored = scored_experiments(tmp_path)
    calls = spy_on_refits(monkeypatch)
    got = ev.transfer_errors(EXPR, rows, scored, resolver, (1.0, 4.0), ONE_JOB)
    assert len(calls) == 2 + 1 + 2  # two workloads, the high-rate stages, two models
    assert set(got) == {
        "transfer_e2e_error_max",
        "transfer_ttft_error_max",
        "transfer_itl_error_max",
        "transfer_error",
        "transfer_error_worst",
    }
    assert 0 < got["transfer_error"] <= got["transfer_error_worst"] < ev.TRANSFER_ERROR_CAP
    # the law that made the observations is in the expression's span: refits without a workload
    # or a stage transfer (without a model, one deployment is left to pin three constants)
    monkeypatch.setattr(ev, "TRANSFER_MODES", ("lowo", "stage-transfer"))
    kept = ev.transfer_errors(EXPR, rows, scored, resolver, (1.0, 4.0), ONE_JOB)
    assert kept["transfer_e2e_error_max"] < 0.10 and kept["transfer_error"] < 0.10

    # a refit that drives its held-out runs into overload counts at the cap in the mean, not more
    monkeypatch.setattr(ev, "closed_loop_runs", _with_errors(ev.closed_loop_runs, 50.0, 900.0, 2.0))
    bad = ev.transfer_errors(EXPR, rows, scored, resolver, (1.0, 4.0), ONE_JOB)
    assert bad["transfer_e2e_error_max"] == 50.0 and bad["transfer_ttft_error_max"] == 900.0
    assert bad["transfer_error"] == bad["transfer_error_worst"] == ev.TRANSFER_ERROR_CAP


def _with_errors(closed_loop_runs, e2e: float, ttft: float, itl: float):
    """``closed_loop_runs`` whose items and stages all report these signed errors."""

    def items(*args, **kwargs):
        got = closed_loop_runs(*args, **kwargs)
        for it in got:
            for part in [it, *it["stages"]]:
                part.update(e2e_error=e2e, ttft_error=ttft, itl_error=itl)
        return got

    return items


def test_ttft_counts_at_its_looser_tolerance_in_the_transfer_error(tmp_path, monkeypatch):
    import evolve.validation as ev
    from evolve.calibration import refresh_replay_rows, scored_experiments

    monkeypatch.chdir(tmp_path)
    for (model, tp), short in [(LLAMA_7B, "llama-2-7b-tp1"), (LLAMA_70B, "llama-2-70b-tp4")]:
        for rate, workload in [(1.0, "codegen"), (3.0, "general")]:
            observe(write_experiment(tmp_path, f"e-{short}-{workload}", model, tp, rate=rate, duration=6))
    resolver = default_resolver()
    names = ["weight_time_us", "kv_io_time_us", "allreduce_calls"]
    rows = refresh_replay_rows(tmp_path, resolver, entry(), names, ONE_JOB)
    monkeypatch.setattr(ev, "closed_loop_runs", _with_errors(ev.closed_loop_runs, 0.02, -0.30, 0.01))
    got = ev.transfer_errors(EXPR, rows, scored_experiments(tmp_path), resolver, (1.0, 4.0), ONE_JOB)
    assert got["transfer_error"] == got["transfer_error_worst"] == pytest.approx(0.30 / 1.5)
    assert got["transfer_ttft_error_max"] == pytest.approx(0.30)


def test_refit_fold_refits_on_its_own_rerecordings_and_keeps_the_last_good_one(monkeypatch):
    from types import SimpleNamespace

    import evolve.validation as ev
    from fitness.sim.loadgen import NoSuccessfulRequest

    def rows_of(names):
        return SimpleNamespace(names=list(names), labels=[[("e2e", "all")]] * len(names))

    fold = ev.Fold("general", lambda name, label: not name.endswith("general"), [])
    fits = iter([("m1", {}), ("m2", {}), ("m3", {})])
    seen = []
    monkeypatch.setattr(ev, "refit", lambda terms, rows, keep, bounds: (seen.append(rows.names), next(fits))[1])
    recorded = []

    def rerecord(expression, overheads, training):
        recorded.append((expression, training))
        return rows_of(training)

    rows = rows_of(["a-codegen", "b-general", "c-roleplay"])
    assert ev.refit_fold(fold, [], rows, (1.0, 4.0), 2, rerecord) == ("m3", {})
    # each refit model re-records the fold's training runs only, and the next refit is on those
    assert recorded == [("m1", ["a-codegen", "c-roleplay"]), ("m2", ["a-codegen", "c-roleplay"])]
    assert seen == [["a-codegen", "b-general", "c-roleplay"], ["a-codegen", "c-roleplay"], ["a-codegen", "c-roleplay"]]

    # a refit model that serves none of a training run's requests: the previous refit stands
    def overloaded(expression, overheads, training):
        raise NoSuccessfulRequest("a-codegen", None, "every request timed out")

    fits = iter([("m1", {}), ("never", {})])
    assert ev.refit_fold(fold, [], rows, (1.0, 4.0), 2, overloaded) == ("m1", {})
    assert ev.refit_fold(fold, [], rows, (1.0, 4.0), 0, rerecord) == ("never", {})  # no rounds: one refit
