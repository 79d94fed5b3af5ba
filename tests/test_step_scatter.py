"""The measured step scatter (``fitness.step_scatter``) and simulated steps that carry it.

Real steps with the same batch do not take the same time (a body of a few percent, a tail
of stalls); the scatter is measured without a step-time model, against each step's
neighbours, and the simulator multiplies each step's model time by a seeded draw from it.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_sim_core import both, differences, expr_model
from test_sim_scheduler import DEP, spec_

from fitness.dataset import StepTable
from fitness.sim.engine import simulate
from fitness.step_scatter import (
    MIN_STEPS,
    QUANTILES,
    StepScatter,
    holdout_reference,
    measure_scatter,
    run_scatter,
    step_scales,
)
from primitives.errors import InputError


def _table(n_per_experiment: list[int], noise) -> StepTable:
    """Steps whose time is a smooth function of the batch times NOISE(rng, n)."""
    rng = np.random.default_rng(7)
    cols = {k: [] for k in ("num_decode_reqs", "prefill_tokens", "kv_tokens")}
    cycle, experiment = [], []
    for e, n in enumerate(n_per_experiment):
        decode = rng.integers(1, 128, n).astype(float)
        prefill = np.where(rng.random(n) < 0.3, rng.integers(1, 2048, n), 0).astype(float)
        kv = decode * rng.uniform(200, 900, n)
        cols["num_decode_reqs"].append(decode)
        cols["prefill_tokens"].append(prefill)
        cols["kv_tokens"].append(kv)
        cycle.append((10_000 + 40 * decode + 5 * prefill + 0.01 * kv) * noise(rng, n))
        experiment.append(np.full(n, e))
    return StepTable(
        columns={k: np.concatenate(v) for k, v in cols.items()},
        cycle_time_us=np.concatenate(cycle),
        experiment=np.concatenate(experiment),
        experiment_names=[f"e{i}" for i in range(len(n_per_experiment))],
        is_train=np.ones(sum(n_per_experiment), dtype=bool),
        primitive_names=[],
        deployments=[],
        experiment_deployment=[0] * len(n_per_experiment),
        fingerprint="test",
    )


def _stalls(rng, n):
    """2% body scatter, and 2% of the steps stalled to twice their time."""
    return rng.normal(1.0, 0.02, n) * np.where(rng.random(n) < 0.02, 2.0, 1.0)


def test_the_scatter_of_constructed_steps_is_recovered_without_a_model():
    scatter = measure_scatter(_table([3000, 2500], _stalls), "built")
    q = np.asarray(scatter.quantiles)
    assert len(q) == QUANTILES and np.all(np.diff(q) >= 0) and q.mean() == pytest.approx(1.0, abs=1e-6)
    # the body: half the steps within a few percent of the median; the stalls: the top 2% near 2x
    assert np.quantile(q, 0.75) / np.quantile(q, 0.25) == pytest.approx(1.027, abs=0.01)
    assert np.quantile(q, 0.99) / np.median(q) == pytest.approx(2.0, abs=0.12)
    assert np.quantile(q, 0.95) / np.median(q) < 1.1
    assert scatter.steps == 5500 and scatter.summary()["source"] == "built"


def test_steps_without_scatter_measure_none_and_too_few_steps_are_refused():
    # no noise: what remains is the measurement's own floor (neighbours are not identical
    # batches), a few percent, and no invented tail
    flat = np.asarray(measure_scatter(_table([2000], lambda rng, n: np.ones(n)), "flat").quantiles)
    assert 0.95 < np.quantile(flat, 0.01) and np.quantile(flat, 0.99) < 1.07 and flat.max() < 1.1
    some = measure_scatter(_table([500, MIN_STEPS - 1], _stalls), "some")
    assert some.steps == 500  # the small experiment is left out
    with pytest.raises(InputError, match="to measure the scatter"):
        measure_scatter(_table([MIN_STEPS - 1], _stalls), "tiny")


@pytest.mark.parametrize("stall", [1e5, 1e9])
def test_a_scatter_with_extreme_stalls_is_recorded_and_read_back(stall):
    # one step in 300 stalled to STALL times its neighbours': only the top quantile holds the stalls,
    # and normalised to mean 1 it nears QUANTILES (its bound) while the rest near 0 (at 1e9, 2.6e-7:
    # kept to 6 significant digits, not rounded to 0); what measure_scatter records reads back
    def wild(rng, n):
        return np.where(np.arange(n) % 300 == 7, stall, 1.0) * rng.normal(1.0, 0.001, n)

    scatter = measure_scatter(_table([3000], wild), "wild")
    assert max(scatter.quantiles) > 100 and min(scatter.quantiles) > 0
    assert StepScatter.from_dict(scatter.to_dict()) == scatter
    with pytest.raises(InputError, match=f"at most {QUANTILES}"):
        StepScatter.from_dict({**scatter.to_dict(), "quantiles": [1.0] * (QUANTILES - 1) + [QUANTILES + 1.0]})


def test_the_draws_are_seeded_and_come_from_the_quantiles():
    scatter = StepScatter((0.9, 1.0, 1.3), 3, "x")
    a, b = scatter.scales(4, 1000), scatter.scales(4, 1000)
    assert np.array_equal(a, b) and not np.array_equal(a, scatter.scales(5, 1000))
    assert set(np.unique(a)) == {0.9, 1.0, 1.3}
    assert step_scales(None, 4) is None


def test_a_scatter_of_ones_changes_nothing_and_both_engines_agree_with_one():
    spec = spec_(stages=((30.0, 6.0),), max_num_batched_tokens=200, max_num_seqs=6, output_len=30)
    model = expr_model("8000 + 10*prefill_tokens + 2*decode_tokens")
    kw = dict(seed=1, kv_capacity_blocks=10_000, distributions=True)
    plain = simulate(spec, DEP, model, **kw)
    ones = simulate(spec, DEP, model, step_scales=np.ones(7), **kw)
    assert differences(plain, ones) == [".trajectory.step_scale"]  # only the recording says so
    assert np.all(ones.trajectory.step_scale == 1.0)
    scales = StepScatter((0.8, 1.0, 1.0, 1.2, 3.0), 5, "x").scales(1, 97)  # cycled past its end
    py, compiled = both(spec, DEP, model, step_scales=scales, **kw)
    assert differences(py, compiled) == []
    assert differences(py, plain) != []
    steps = py.trajectory
    k = np.arange(len(steps.step_cycle_us))
    assert np.array_equal(steps.step_scale, scales[k % len(scales)])
    assert np.array_equal(steps.step_cycle_us, steps.step_time_us * steps.step_scale)
    for bad in (np.zeros(0), np.array([1.0, -1.0]), np.array([np.nan])):
        with pytest.raises(ValueError, match="step_scales"):
            simulate(spec, DEP, model, step_scales=bad, **kw)


def test_stalls_lengthen_the_ttft_tail_more_than_its_median():
    """A light load: with the stalls, the p99 TTFT grows while the median does not."""
    spec = spec_(stages=((20.0, 40.0),), max_num_seqs=16, output_len=20)
    model = expr_model("6000 + 10*prefill_tokens + 20*num_decode_reqs")
    stalls = StepScatter(tuple([0.98] * 97 + [1.6467] * 3), 100, "stalls")  # mean 1
    plain = simulate(spec, DEP, model, seed=0, distributions=True).metrics.summary
    scattered = simulate(spec, DEP, model, seed=0, distributions=True, step_scales=stalls.scales(0))
    got = scattered.metrics.summary
    p50, p99 = (got.distributions["ttft"][k] / plain.distributions["ttft"][k] for k in ("p50", "p99"))
    # most steps run 2% faster (the mean stays), the few stalled ones stretch the tail
    assert p99 > 1.1 and 0.95 < p50 < 1.0
    assert got.itl_mean_s == pytest.approx(plain.itl_mean_s, rel=0.03)


def test_a_run_measures_its_steps_scatter_and_records_it():
    from evolve.config import RunConfig
    from evolve.run import prepare_context
    from primitives.deployment import default_resolver

    config = RunConfig(generations=1, scatter_steps=True)  # run --step-scatter
    prepare_context(config, default_resolver())
    scatter = run_scatter(config.to_dict())
    assert scatter is not None and scatter.source == "the embedded default data" and scatter.steps > 1000
    assert StepScatter.from_dict(config.to_dict()["step_scatter"]) == scatter  # what run.json holds
    kept = RunConfig(
        generations=1, scatter_steps=True, step_scatter={"quantiles": [0.5, 1.5], "steps": 2, "source": "s"}
    )
    prepare_context(kept, default_resolver())  # a resumed run keeps the scatter it measured
    assert run_scatter(kept.to_dict()).quantiles == (0.5, 1.5)
    off = RunConfig(generations=1)  # the default: steps take the model's time
    prepare_context(off, default_resolver())
    assert off.step_scatter is None and run_scatter(off.to_dict()) is None


def test_a_run_from_before_the_scatter_resumes_without_it_and_a_bad_one_is_refused(tmp_path):
    import json

    from evolve.resume import _saved_config

    path = tmp_path / "run.json"
    base = {"generations": 5, "population": 10, "seed": 0}
    path.write_text(json.dumps(base))
    old = _saved_config(path)
    assert old.scatter_steps is False and old.step_scatter is None
    for bad, field in [
        ({"step_scatter": [1.0]}, "step_scatter"),
        ({"step_scatter": {"quantiles": [1.0, "x"], "steps": 2, "source": "s"}}, r"step_scatter.quantiles\[1\]"),
        ({"step_scatter": {"quantiles": [1.0], "steps": 1.5, "source": "s"}}, "step_scatter.steps"),
        ({"scatter_steps": "yes"}, "scatter_steps"),
    ]:
        path.write_text(json.dumps({**base, **bad}))
        with pytest.raises(InputError, match=field):
            _saved_config(path)


def test_validate_uses_the_scatter_the_entrys_run_measured(tmp_path, monkeypatch):
    from dataclasses import replace

    from test_validate import LLAMA_7B, entry, observe, write_experiment

    from evolve.validation import validate_entry
    from primitives.deployment import default_resolver

    monkeypatch.chdir(tmp_path)
    observe(write_experiment(tmp_path, "exp-a-llama-2-7b-tp1-general", *LLAMA_7B, stages=[(4.0, 6)]))
    recorded = StepScatter((0.5, 1.0, 1.5), 3, "the run's traces")
    with_scatter = replace(entry(), run_config={"step_scatter": recorded.to_dict()})
    res = validate_entry(with_scatter, tmp_path, None, default_resolver(), jobs=1)
    assert res["step_scatter"]["source"] == "the run's traces"
    off = validate_entry(with_scatter, tmp_path, None, default_resolver(), jobs=1, step_scatter=None)
    assert off["step_scatter"] is None
    assert off["experiments"][0]["itl_mean_pred_s"] != res["experiments"][0]["itl_mean_pred_s"]
    assert validate_entry(entry(), tmp_path, None, default_resolver(), jobs=1)["step_scatter"] is None


def test_a_scattered_recording_replays_to_its_own_closed_loop_and_its_linear_forms_agree():
    """The search and the transfer refits score candidates on recorded batches: with a scatter,
    the replay puts the recording's stalls on the same steps, for any step times."""
    from test_sim_replay import DEP as DEP_7B
    from test_sim_replay import MODEL, _spec

    from fitness.sim.replay import evaluate_weights, metric_weights, replay

    stalls = StepScatter(tuple([0.98] * 97 + [1.6467] * 3), 100, "stalls")
    for spec, blocks in ((_spec(), 5_000), (_spec(request_timeout_s=3.0), 60)):  # and preemptions, timeouts
        res = simulate(spec, DEP_7B, MODEL, seed=2, kv_capacity_blocks=blocks, step_scales=stalls.scales(2))
        tr = res.trajectory
        assert tr.step_scale is not None and set(np.unique(tr.step_scale)) == {0.98, 1.6467}
        rep = replay(tr, tr.step_time_us, MODEL).summary
        got = res.metrics.summary
        for k in ("e2e_mean_s", "ttft_mean_s", "itl_mean_s", "tpot_mean_s"):
            assert getattr(rep, k) == pytest.approx(getattr(got, k), rel=1e-9), k
        step = tr.step_time_us * np.random.default_rng(0).uniform(0.5, 1.5, size=tr.n_steps)
        forms, rep = metric_weights(tr), replay(tr, step, MODEL)
        val = evaluate_weights(forms, step, MODEL)
        assert val["ttft"] == pytest.approx(rep.summary.ttft_mean_s * 1e6, rel=1e-9)
        assert val["stage_1/e2e"] == pytest.approx(rep.stages[1].e2e_mean_s * 1e6, rel=1e-9)


def test_identical_batches_never_count_a_step_among_its_own_neighbours():
    from fitness.step_scatter import NEIGHBOURS, neighbour_ratios

    n = NEIGHBOURS + 1  # every other step is a neighbour
    cycle = np.array([1.0] * (n // 2) + [3.0] * (n - n // 2))
    ratios = neighbour_ratios(np.ones((n, 3)), cycle)
    # a 1 sees 7 ones and 8 threes (median 3); a 3 sees 8 ones and 7 threes (median 1)
    assert np.allclose(ratios, np.where(cycle == 1.0, 1 / 3, 3.0))


def test_the_transfer_checks_record_and_refit_with_the_scatter(tmp_path, monkeypatch):
    from test_validate import LLAMA_7B, entry, observe, write_experiment

    import evolve.validation as validation
    from primitives.deployment import default_resolver

    monkeypatch.chdir(tmp_path)
    for workload in ("general", "codegen"):
        observe(
            write_experiment(tmp_path, f"exp-{workload}-llama-2-7b-tp1-{workload}", *LLAMA_7B, rate=3.0, duration=6)
        )
    seen, real = [], validation.record_rows

    def spy(specs, resolver, model, names, settings):
        seen.append((settings.scatter, settings.load_draws))
        return real(specs, resolver, model, names, settings)

    monkeypatch.setattr(validation, "record_rows", spy)
    scatter = StepScatter((0.9, 1.0, 1.1), 3, "traces")
    res = validation.validate_entry(
        entry(), tmp_path, "lowo", default_resolver(), jobs=1, step_scatter=scatter, load_draws=2
    )
    # the entry's recording and each fold's, scattered, and fitted to the mean of the draws compared on
    assert len(seen) >= 3 and all(s is scatter and n == 2 for s, n in seen)
    assert res["step_scatter"]["source"] == "traces"


def _with_holdout(table: StepTable, fraction: float, experiments: set[int]) -> StepTable:
    """TABLE with the last FRACTION of each of EXPERIMENTS' rows held out (the rows are in time order)."""
    is_train = np.ones(table.n, dtype=bool)
    for e in experiments:
        idx = np.flatnonzero(table.experiment == e)
        is_train[idx[len(idx) - int(fraction * len(idx)) :]] = False
    table.is_train = is_train
    return table


def test_the_holdout_reference_is_the_steps_own_scatter():
    """Noise of known size: the reference reads it (a little above), not the smooth work-time curve beneath."""
    uniform = _with_holdout(_table([3000, 3000], lambda rng, n: rng.uniform(0.94, 1.06, n)), 0.2, {0, 1})
    references = holdout_reference(uniform)
    assert set(references) == {"e0", "e1"}
    for rows, reference, se in references.values():
        # |U(-6%, 6%)| has mean 3%; the neighbours' median adds a little of its own
        assert rows == 600 and 3.0 <= reference < 3.4 and 0.05 < se < 0.15
    smooth = holdout_reference(_with_holdout(_table([3000], lambda rng, n: np.ones(n)), 0.2, {0}))
    assert smooth["e0"][1] < 1.0  # no noise: only the neighbours' distance in work


def test_the_holdout_reference_leaves_out_experiments_without_a_holdout_or_enough_training_steps():
    table = _with_holdout(_table([400, 400, 12], lambda rng, n: np.ones(n)), 0.25, {0, 2})
    assert set(holdout_reference(table)) == {"e0"}  # e1 holds nothing out; e2 trains on 9 steps, under 15


def test_the_holdout_reference_with_one_neighbour_prices_each_row_by_its_own_nearest():
    # one neighbour: each held-out step's own nearest training step, not one value for all
    table = _with_holdout(_table([3000], lambda rng, n: np.ones(n)), 0.2, {0})
    one, many = holdout_reference(table, 1)["e0"][1], holdout_reference(table)["e0"][1]
    assert one < 2.0 and one < 3 * many
    with pytest.raises(ValueError):
        holdout_reference(table, 0)
