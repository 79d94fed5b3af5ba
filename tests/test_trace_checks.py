"""benchmarks/trace_checks.py: prefill in the traces against each step's least time, and a
fresh server's first seconds against an archived model."""

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from conftest import load_benchmark, small_trace
from scipy.signal import lfilter

from primitives.data.traces import load_steps
from primitives.deployment import default_resolver


def _trace_checks():
    return load_benchmark("trace_checks")


def _trace_queue():
    return load_benchmark("trace_queue")


def test_prefill_in_traces_counts_large_prefills_and_marks_cycles_below_the_floor():
    tc = _trace_checks()
    resolver = default_resolver()
    dep = resolver.resolve("meta-llama/Llama-2-70b-hf", 4)
    floor_us = float(tc.step_floor_us(dep, np.array([1013.0]))[0])
    weights_us = dep.weight_bytes_per_gpu / dep.gpu.hbm_bytes_per_s * 1e6
    assert floor_us > weights_us  # 1,013 tokens of a 70B model are compute bound
    assert float(tc.step_floor_us(dep, np.array([20.0]))[0]) == pytest.approx(weights_us)  # 20 are not
    steps = pd.DataFrame(
        {
            "experiment": "20260101-000000-llama-2-70b-tp4-general",
            "model": "meta-llama/Llama-2-70b-hf",
            "tp": 4,
            "gpu": None,
            "prefill_tokens": [0.0, 1000.0, 1000.0, 1000.0, 99.0],
            "decode_tokens": [40.0, 13.0, 13.0, 13.0, 40.0],
            "cycle_time_us": [19e3, 0.9 * floor_us, 1.1 * floor_us, np.nan, 19e3],
        }
    )
    lines = tc.prefill_in_traces(steps, resolver)
    assert lines[2].split() == ["llama-2-70b", "tp4", "general", "5", "3", "2"]  # steps, large, timed
    assert lines[3].split()[0] == "1000" and lines[3].endswith("below")
    assert not lines[4].endswith("below")
    assert len(lines) == 5 and max(len(line) for line in lines) <= 80


def test_cells_fit_their_width():
    tc = _trace_checks()
    tq = _trace_queue()
    assert [tq.cell(v, 4, ".2f") for v in (1.234, None, 12.5, float("nan"))] == ["1.23", "   -", ">9.9", "   -"]
    assert tq.cell(10.0, 5, ".3f") == ">9.99"
    assert tq.cell(123.4, 4, ".1f") == ">9.9"
    assert tq.cell(12345.0, 4, ".0f") == ">999"
    assert tq.cell(56.8, 7, ".1f") == "   56.8"
    assert tc.window_ratio(np.array([0.0, 0.1, 0.2]), np.array([0, 5, 10]), np.ones(3, bool), np.zeros(3), 0, 1) is None


def test_window_cycle_counts_unsampled_steps_and_refuses_idle_gaps():
    tc = _trace_checks()
    start_s = np.array([0.0, 0.1, 0.3, 0.5])
    step_id = np.array([0, 5, 15, 25])  # 20 ms per step, most of them unsampled
    model_us = np.array([10_000.0, 20_000.0, 30_000.0, 99.0])
    busy = np.ones(4, dtype=bool)
    cycle_us, mean_model_us = tc.window_cycle(start_s, step_id, busy, model_us, 0.0, 1.0)
    assert cycle_us == pytest.approx(20_000.0)
    assert mean_model_us == pytest.approx(20_000.0)  # the last sample's own step lies outside the span
    assert tc.window_cycle(start_s, step_id, busy, model_us, 0.0, 0.2) is None  # under 3 samples
    busy[1] = False  # an empty engine between two samples idles: no cycle to measure
    assert tc.window_cycle(start_s, step_id, busy, model_us, 0.0, 1.0) is None


def test_first_seconds_finds_a_warm_up_against_the_model(tmp_path):
    tc = _trace_checks()
    trace = small_trace(12_000, experiment="20260101-000000-tiny-tp1-general")
    decode = np.random.default_rng(2).integers(40, 60, len(trace))  # steadier batches than small_trace's
    trace["batch.decode_tokens"] = trace["batch.num_decode_reqs"] = decode
    model_us = 8000 + 60 * decode
    start_us, t = np.zeros(len(trace)), 0.0
    for k, m in enumerate(model_us):  # the steps that start in the first 6 s run 1.5x slower
        start_us[k] = t
        t += 1.5 * m if t < 6e6 else m
    trace["step.ts_start_ns"] = start_us * 1000
    sampled = np.random.default_rng(0).random(len(trace)) < 0.1  # a 10% sample, as the real traces
    trace[sampled].to_csv(tmp_path / "t.csv", index=False)
    data = load_steps([tmp_path / "t.csv"])
    entry = SimpleNamespace(id="model", expression="8000 + 60*decode_tokens")
    lines = tc.first_seconds(
        data, entry, load_benchmark("trace_model").trace_prices_us(data, default_resolver(), entry, None)
    )
    assert lines[2].startswith("tiny tp1 general")
    cells = [float(c) for c in lines[2].split()[3:]]
    by_window = dict(zip(tc.WINDOW_STARTS_S, cells[:-2], strict=True))
    assert all(abs(by_window[w] - 1.5) < 0.06 for w in (0, 2))
    assert all(abs(by_window[w] - 1.0) < 0.06 for w in (8, 10, 12, 14))
    # 0-12 s: 6 s hold 4 model-seconds of steps, the next 6 s hold 6: 12 s for 10, 1.2x;
    # 2-12 s: 4 s hold 2.67, then 6: 10 s for 8.67, 1.154x
    assert cells[-2] == pytest.approx(1.2, abs=0.04)
    assert cells[-1] == pytest.approx(10 / (4 / 1.5 + 6), abs=0.04)
    assert max(len(line) for line in lines) <= 80


def _sampled_run(log_scale, seed=0):
    """A 20 ms-step run whose step k takes exp(LOG_SCALE[k]) times that, sampled at 10%:
    check 4's inputs (start s, ids, busy, work) of the sampled steps, all of like work."""
    start_s = np.concatenate([[0.0], np.cumsum(0.02 * np.exp(log_scale))[:-1]])
    k = np.flatnonzero(np.random.default_rng(seed).random(len(log_scale)) < 0.1)
    work = np.column_stack([np.full(len(k), 50.0), np.zeros(len(k)), np.full(len(k), 30_000.0)])
    return start_s[k], k, np.ones(len(k), dtype=bool), work


def _ar1(n, sd, steps, rng):
    """A stationary AR(1) series of sd SD whose correlation falls by 1/e every STEPS steps."""
    a = np.exp(-1 / steps)
    return lfilter([sd * np.sqrt(1 - a * a)], [1, -a], rng.normal(size=n))


def test_persistence_tells_independent_steps_from_slow_stretches():
    tc = _trace_checks()
    n = 200_000  # 4,000 s of steps
    rng = np.random.default_rng(1)
    steady = tc.persistence(*tc.pair_residuals(*_sampled_run(rng.normal(0, 0.05, n))))
    assert steady["sd1"] == pytest.approx(0.05, rel=0.1)
    assert all(abs(steady["ratio"][k] - 1) < 0.2 for k in tc.PERSIST_STEPS)  # independent steps
    assert all(abs(steady["corr"][lag]) < 0.08 for lag in tc.PERSIST_LAGS_S)
    # the same scatter plus a slow stretch: a 2%, 2-second AR(1) component (100 steps)
    persisting = tc.persistence(*tc.pair_residuals(*_sampled_run(rng.normal(0, 0.05, n) + _ar1(n, 0.02, 100, rng))))
    assert persisting["ratio"][13] > 1.35  # 13 steps together vary far more than independent ones would
    corr = [persisting["corr"][lag] for lag in tc.PERSIST_LAGS_S]
    assert corr[0] > 0.25 and corr[0] > corr[1] > corr[2] > 0  # fading over the stretch's 2 s
    # jitter in the start stamps alone: a late stamp makes one cycle long and the next short
    start_s, ids, busy, work = _sampled_run(np.zeros(n))
    jitter = rng.normal(0, 0.002, len(start_s))  # seconds, each stamp
    jittered = tc.persistence(*tc.pair_residuals(start_s + jitter, ids, busy, work))
    assert all(jittered["ratio"][k] < 0.8 for k in tc.PERSIST_STEPS)


def test_persistence_compares_pairs_of_like_work_and_ignores_a_few_stalls():
    tc = _trace_checks()
    n = 200_000
    rng = np.random.default_rng(2)
    busy_batch = (np.arange(n) // 5_000) % 2 == 1  # 100-s stretches of a batch that steps 1.5x slower
    log_scale = np.where(busy_batch, np.log(1.5), 0.0) + rng.normal(0, 0.03, n)
    stalls = rng.choice(n, 40, replace=False)
    log_scale[stalls] += np.log(3.0)  # a few stalls: the robust spread does not move
    start_s, ids, busy, work = _sampled_run(log_scale)
    work[:, 0] = np.where(busy_batch[ids], 120.0, 50.0)
    p = tc.persistence(*tc.pair_residuals(start_s, ids, busy, work))
    assert p["sd1"] == pytest.approx(0.03, rel=0.15)  # the slower batches are priced by their like
    assert all(abs(p["ratio"][k] - 1) < 0.25 for k in tc.PERSIST_STEPS)
    assert all(abs(p["corr"][lag]) < 0.15 for lag in tc.PERSIST_LAGS_S)  # pairs across a switch of batch: a little


def test_persistence_leaves_out_the_first_seconds_an_idle_engine_and_short_traces():
    tc = _trace_checks()
    n = 100
    ids = 50 * np.arange(n)  # a sample every 50 steps of 20 ms: 1 s apart
    start_s = 0.02 * ids
    start_s[:3] = [10.0, 11.0, 12.0]  # the first seconds (before 30 s): left out, whatever they hold
    start_s[60:] += 5.0  # between samples 59 and 60 the engine idled 5 s
    busy = np.ones(n, dtype=bool)
    busy[80] = False  # an empty batch at either end of a pair: no cycle
    work = np.tile([50.0, 0.0, 30_000.0], (n, 1))
    apart, starts, residual = tc.pair_residuals(start_s, ids, busy, work)
    expected = [i for i in range(n - 1) if start_s[i] >= 30.0 and i not in (59, 79, 80)]
    assert list(starts) == pytest.approx(start_s[expected])
    assert list(apart) == [50] * len(expected) and residual == pytest.approx(np.zeros(len(expected)), abs=1e-9)
    assert tc.persistence(apart, starts, residual) is None  # no pair one step apart: no figure
    from fitness.step_scatter import NEIGHBOURS

    def pairs_kept(n_pairs):  # samples 10 s apart, after 30 s: every other pair qualifies
        sparse_ids = 500 * np.arange(n_pairs + 1) + 2_000
        ones = np.ones(n_pairs + 1, dtype=bool)
        return len(tc.pair_residuals(0.02 * sparse_ids, sparse_ids, ones, work[: n_pairs + 1])[0])

    assert pairs_kept(NEIGHBOURS + 1) == NEIGHBOURS + 1
    assert pairs_kept(NEIGHBOURS) == 0  # too few pairs to price one by its like


def test_persistence_prices_a_pair_by_like_work_far_away_in_time():
    # the batch grows all run long, so the pairs of like work are the pairs near in time:
    # without the time exclusion, a slow stretch would be its own reference and vanish
    tc = _trace_checks()
    n = 200_000
    rng = np.random.default_rng(4)
    log_scale = rng.normal(0, 0.05, n) + _ar1(n, 0.02, 100, rng)
    start_s, ids, busy, work = _sampled_run(log_scale)
    work[:, 2] = 30_000.0 + 10.0 * ids  # KV tokens grow with time
    p = tc.persistence(*tc.pair_residuals(start_s, ids, busy, work))
    assert p["ratio"][13] > 1.35 and p["corr"][0.2] > 0.25


@pytest.mark.parametrize(
    "args, message",
    [
        (["--id", "x"], "--run-dir and --id"),
        (["--run-dir", "{tmp}", "--id", "x"], "no archive there"),
        (["--data", "{tmp}/none.parquet"], "no such file"),
        (["--draws", "3"], "options of check 3"),
        (["--dr", "3"], "options of check 3"),  # argparse takes a prefix
        (["--draws", "0"], "--draws"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    tc = _trace_checks()
    try:
        rc = tc.main([a.format(tmp=tmp_path) for a in args])
    except SystemExit as exit_:  # the option parser's errors leave this way, as from the command line
        rc = exit_.code
    assert rc == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err and len(captured.err.strip().splitlines()) == 1


def test_on_the_real_traces(shared_data, capsys):
    tc = _trace_checks()
    assert tc.main(["--shared", str(shared_data.parent)]) == 0
    out = capsys.readouterr().out
    first = out.split("\n\n")[0]  # check 1's table (check 4's follows)
    rows = {line[:26].strip(): line[26:].split() for line in first.splitlines() if line.startswith(("llama", "code"))}
    assert set(rows) == {"llama-2-70b tp4 general", "codellama-34b tp2 general"}
    assert all(int(r[1]) < 0.01 * int(r[0]) for r in rows.values())  # under 1% of the steps prefill 100+ tokens
    slow = out.split("\n\n")[1]  # check 4's table: no model needed
    bodies = {
        line[:26].strip(): float(line[26:].split()[0])
        for line in slow.splitlines()
        if line.startswith(("llama", "code"))
    }
    assert set(bodies) == set(rows) and all(0.005 < sd1 < 0.05 for sd1 in bodies.values())
    references = out.split("\n\n")[2]  # check 5's table: no model needed
    held = {
        line[:26].strip(): line[26:].split() for line in references.splitlines() if line.startswith(("llama", "code"))
    }
    assert set(held) == set(rows)
    for n, reference, wider, se in held.values():  # a fifth of each trace's timed steps; a few percent
        assert 100 < int(n) < 200 and 1 < float(reference) < 8 and 1 < float(wider) < 8 and 0 < float(se) < 1
    assert max(len(line) for line in out.splitlines()) <= 80


def test_stage_stats_over_a_window():
    tq = _trace_queue()
    steps = tq.StepSeries(
        start_s=np.array([0.0, 1.0, 2.0, 3.0, 4.0, 5.0]),
        step_id=np.array([0.0, 10.0, 30.0, 40.0, 90.0, 100.0]),
        running=np.array([1.0, 10.0, 128.0, np.nan, 128.0, 50.0]),
        waiting=np.array([0.0, 0.0, 3.0, 0.0, 1.0, 0.0]),
    )
    got = tq.stage_stats(steps, 1.0, 5.0, 128)  # samples 1-4: 3 s over 80 steps
    assert got["cycle_ms"] == pytest.approx(3000 / 80)
    assert got["running"] == pytest.approx(266 / 3) and got["sd"] == pytest.approx(np.std([10, 128, 128]))
    assert got["full"] == pytest.approx(2 / 3)  # the unknown depth is left out
    assert got["waiting"] == pytest.approx(0.5)
    assert got["queued"] == pytest.approx(2.0)  # 3 and 1 wait on the two steps (of 1-4) where some do
    assert np.isnan(got["dispersion"])  # no prefill counts in this series
    # a draw with nobody waiting has no queue depth: the mean is over the draws that do
    assert tq.mean_stats([{"queued": 2.0}, {"queued": np.nan}, None])["queued"] == 2.0
    assert np.isnan(tq.mean_stats([{"queued": np.nan}])["queued"])
    assert tq.stage_stats(steps, 4.0, 9.0, 128) is None  # under 3 samples
    no_queue = tq.StepSeries(steps.start_s, steps.step_id, None, None)
    line = tq.queue_row("  2  20 req/s", "real", tq.stage_stats(no_queue, 0.0, 9.0, 128), 57.0)
    assert line.split() == ["2", "20", "req/s", "real", "50.00", "-", "-", "-%", "-%", "57.0"]
    assert tq.queue_row("", "model", None, 1.0).split() == ["model", "no", "steps", "in", "this", "window"]
    assert max(len(line), len(tq.queue_row("x" * 20, "x1.000", got, 1e4, "10/10"))) <= 80


def test_how_long_the_requests_present_stay_alike():
    tq = _trace_queue()
    t = np.arange(0.0, 2000.0, 0.05)
    wave = np.sin(2 * np.pi * t / 16.0)  # 16 s period: opposite 8 s later, the same 16 s later
    assert tq.lagged_correlation(t, wave, 8.0) == pytest.approx(-1.0, abs=1e-3)
    assert tq.lagged_correlation(t, wave, 16.0) == pytest.approx(1.0, abs=1e-3)
    # a 10% sample of the steps pairs at the same lag, not at the first step past the tolerance
    rng = np.random.default_rng(0)
    kept = np.sort(rng.choice(len(t), len(t) // 10, replace=False))
    assert tq.lagged_correlation(t[kept], wave[kept], 8.0) == pytest.approx(-1.0, abs=0.01)
    # the nearest step to 8 s later, not the first inside the tolerance (6.8 s: a 7.65 s lag's -0.93)
    assert tq.lagged_correlation(t, np.sin(2 * np.pi * t / 9.0), 8.0) == pytest.approx(
        np.cos(2 * np.pi * 8 / 9), abs=0.01
    )
    assert abs(tq.lagged_correlation(t, rng.normal(size=len(t)), 8.0)) < 0.03  # no memory
    assert np.isnan(tq.lagged_correlation(t[:50], wave[:50], 8.0))  # 2.5 s: no pair 8 s apart
    assert np.isnan(tq.lagged_correlation(t, np.ones(len(t)), 8.0))  # no spread
    steps = tq.StepSeries(t, np.arange(len(t), dtype=float), 100.0 + 10 * wave, np.where(wave > 0.9, 5.0, 0.0))
    got = tq.stage_stats(steps, 0.0, 2000.0, 128)
    assert got["present_p99"] == pytest.approx(115.0, abs=0.01) and got["memory"] < -0.9  # waiting counts too
    draws = [tq.SimulatedStage({"memory": m}, 1.0, (0.0, 1.0)) for m in (0.1, 0.2, np.nan)] + [
        tq.SimulatedStage(None, 1.0, (0.0, 1.0))
    ]
    assert tq.below(draws, {"memory": 0.15}, "memory") == "1/2"  # a draw without the figure is left out
    assert tq.below(draws, None, "memory") == ""


def test_dispersion_of_the_prefills_on_the_steps_with_nobody_waiting():
    tq = _trace_queue()
    rng = np.random.default_rng(0)
    poisson = rng.poisson(0.8, 40_000).astype(float)
    assert tq.dispersion(poisson, None) == pytest.approx(1.0, abs=0.03)
    # a step with requests waiting admits by free slots, not by arrivals: left out
    waiting = np.zeros(len(poisson))
    waiting[::2] = 3
    burst = poisson.copy()
    burst[::2] = 50.0
    assert tq.dispersion(burst, waiting) == pytest.approx(tq.dispersion(poisson[1::2], None))
    clumped = np.repeat(rng.poisson(0.4, 20_000) * 2.0, 2)  # arrivals in pairs: twice the variance
    assert tq.dispersion(clumped, None) == pytest.approx(2.0, abs=0.1)
    assert np.isnan(tq.dispersion(np.array([1.0, 2.0]), None))  # under 3 steps
    assert np.isnan(tq.dispersion(np.zeros(10), None))  # no prefill
    assert tq.dispersion(np.array([1.0, np.nan, 1.0, 1.0]), None) == 0.0  # unknown counts left out


def test_the_tracer_counts_a_new_request_in_its_step_and_the_next():
    tq = _trace_queue()
    got = tq.tracer_prefills(np.array([2, 2, 4, -1, 5]), 6)  # -1: never admitted; 5: the last step
    assert got.tolist() == [0.0, 0.0, 2.0, 2.0, 1.0, 2.0]


def test_the_loader_keeps_the_queue_depths_where_a_trace_has_them(tmp_path):
    trace = small_trace(30)
    trace.to_csv(tmp_path / "a.csv", index=False)
    assert {"running_depth", "waiting_depth", "num_finished"}.isdisjoint(load_steps([tmp_path / "a.csv"]).steps)
    trace["queue.waiting_depth"] = np.arange(30)[::-1]
    trace["queue.running_depth"] = trace["batch.num_decode_reqs"]
    trace["batch.num_finished"] = 1
    trace.loc[3, "queue.waiting_depth"] = -1  # informative only: a bad value is unknown, not an error
    trace.to_csv(tmp_path / "b.csv", index=False)
    steps = load_steps([tmp_path / "b.csv"]).steps
    expected = np.arange(30.0)[::-1]
    expected[3] = np.nan
    assert np.array_equal(steps["waiting_depth"].to_numpy(), expected, equal_nan=True)  # in step order
    assert steps["running_depth"].tolist() == trace["batch.num_decode_reqs"].tolist()
    assert (steps["num_finished"] == 1).all()


def test_slot_release_counts_the_pairs_whose_held_slots_finish_next():
    tq = _trace_queue()
    g = pd.DataFrame(
        {
            "step_id": [1, 2, 3, 5, 6, 7],  # pairs: (1, 2), (2, 3), (5, 6), (6, 7)
            "running_depth": [10, 12, 12, 12, 12, 12],
            "num_prefill_reqs": [1, 0, 1, 0, 0, 0],
            "num_decode_reqs": [9, 10, 11, 10, 12, 12],  # held: 0, 2, 0, 2, 0, 0
            "num_finished": [0, 0, 2, 0, 1, 0],  # (2, 3) and (1, 2) match; (5, 6) does not
        }
    )
    assert tq.slot_release(g) == (3, 4, 2)  # (1, 2) and (6, 7): none held, none finished
    assert tq.slot_release(g.drop(columns="num_finished")) is None


def test_first_step_present_sets_the_first_sampled_step_against_the_draws():
    tq = _trace_queue()
    g = pd.DataFrame({"step_id": [7, 5, 9], "running_depth": [4, 10, 12], "waiting_depth": [0, 1, 0]})
    runs = [tq.SimulatedRun([], np.array([0, 1, 1, 2, 2, 3, 3.0])), tq.SimulatedRun([], np.arange(10.0))]
    assert tq.first_step_present(g, runs) == "  requests present at step 5, the first sampled: 11; simulated 3-5"
    assert tq.first_step_present(g.drop(columns="waiting_depth"), runs) is None
    assert tq.first_step_present(g, [tq.SimulatedRun([], np.zeros(3))]) is None  # no draw ran that long


def test_a_trace_s_stages_start_after_its_idle_gaps():
    tq = _trace_queue()
    # one step in ten sampled; 20 ms steps for 600 s, the engine idles 1.5 s, then 60 ms
    # steps: a stretch of slower steps is no idle time. A 0.8 s stall at 300 s comes before
    # the first stage has run its 600 s, so it is no stage boundary either.
    cycle_s = np.r_[np.full(30_000, 0.02), np.full(10_000, 0.06)]
    start_s = np.r_[0.0, np.cumsum(cycle_s)[:-1]]
    start_s[15_000:] += 0.8
    start_s[30_000:] += 1.5
    steps = tq.StepSeries(start_s[::10], np.arange(0, 40_000, 10, dtype=float), None, None)
    assert tq.trace_stage_starts_s(steps, [600.0, 600.0]) == pytest.approx([0.0, 602.3])
    assert tq.trace_stage_starts_s(steps, [600.0]) == [0.0]
    assert tq.trace_stage_starts_s(steps, [600.0, 600.0, 600.0]) is None  # no third stage in it
    stalls_only = tq.StepSeries(np.arange(0, 800.0, 0.2), np.arange(0, 40_000.0, 10), None, None)
    assert tq.trace_stage_starts_s(stalls_only, [600.0, 600.0]) is None


def test_queue_by_stage_skips_traces_without_an_experiment_folder():
    tq = _trace_queue()
    data = SimpleNamespace(steps=pd.DataFrame({"experiment": ["20260101-000000-tiny-tp1-general"]}))
    entry = SimpleNamespace(id="model", expression="1000", overheads={}, run_config={})
    lines = tq.queue_by_stage(data, {}, default_resolver(), entry, 1, None)
    assert lines[-1].startswith("tiny tp1 general") and lines[-1].endswith("skipped")


def test_queue_by_stage_on_a_real_trace(shared_data):
    """The real row is the trace's own figures; the model's are one simulation of each
    stage; the scaled row puts the simulated cycle time on the trace's. The model is 10%
    cheap on purpose, so that the scaling has work to do."""
    from primitives.data.experiments import find_experiments

    tq = _trace_queue()
    name = "20260218-150304-codellama-34b-tp2-general"
    raw = pd.read_parquet(shared_data / "steps" / "step_traces.parquet")
    raw = raw[raw["experiment_id"] == name].sort_values("step.id")
    data = load_steps([shared_data / "steps"])
    data.steps = data.steps.loc[data.steps["experiment"] == name]
    spec = next(s for s in find_experiments(shared_data / "experiments") if s.name == name)
    entry = SimpleNamespace(
        id="model", expression="1.1*gemm_time_us + 1.1*kv_io_time_us + 1500*tp", overheads={}, run_config={}
    )
    lines = tq.queue_by_stage(data, {name: spec}, default_resolver(), entry, 1, None)
    assert lines[4] == "codellama-34b tp2 general" and max(len(line) for line in lines) <= 80
    # every finished request's slot is held for the next step, as the simulator holds it
    held = raw["queue.running_depth"] - raw["batch.num_prefill_reqs"] - raw["batch.num_decode_reqs"]
    pairs = np.flatnonzero(np.diff(raw["step.id"].to_numpy()) == 1)
    held, finished = held.to_numpy()[pairs], raw["batch.num_finished"].to_numpy()[pairs + 1]
    matched, tested = (held == finished).sum(), ((held > 0) | (finished > 0)).sum()
    assert lines[5].endswith(f": {matched} of {len(pairs)} pairs ({tested} not both 0)")
    assert matched == len(pairs) > 500 and tested > 100
    first = raw.iloc[0]
    assert lines[6].startswith(f"  requests present at step {first['step.id']}, the first sampled: ")
    assert lines[6].split(": ")[1].startswith(f"{first['queue.running_depth'] + first['queue.waiting_depth']};")
    real, model, scaled = (line[21:].split() for line in lines[10:13])  # the second stage
    assert lines[10].startswith("  2  20 req/s") and (real[0], model[0]) == ("real", "model")
    # the real row against the trace itself, from the first draw's window of the stage
    dep = default_resolver().resolve_experiment(spec)
    (stage,) = tq.simulate_stages(spec, dep, entry.expression, {}, 0, None).stages[1:]
    t_s = (raw["step.ts_start_ns"] - raw["step.ts_start_ns"].min()).to_numpy() / 1e9
    w = raw[(t_s >= stage.window_s[0]) & (t_s < stage.window_s[1])]
    span_ms = (w["step.ts_start_ns"].iloc[-1] - w["step.ts_start_ns"].iloc[0]) / 1e6
    assert float(real[1]) == pytest.approx(span_ms / (w["step.id"].iloc[-1] - w["step.id"].iloc[0]), abs=0.006)
    assert float(real[2]) == pytest.approx(w["queue.running_depth"].mean(), abs=0.06)
    assert real[6] == f"{spec.observed.stages[1].ttft_mean_s * 1e3:.1f}"
    # the model's row is its simulation's second stage, not the first
    assert float(model[1]) == pytest.approx(stage.stats["cycle_ms"], abs=0.006)
    assert float(model[6]) == pytest.approx(stage.ttft_ms, abs=0.06) and model[5] != "-%"
    assert float(model[1]) < 0.95 * float(real[1])  # the model is cheap ...
    assert scaled[0].startswith("x") and float(scaled[0][1:]) > 1.05  # ... so it is scaled up
    assert float(scaled[1]) == pytest.approx(float(real[1]), rel=tq.SCALE_MATCH)
    # the arrivals table: the trace's prefills per step on the stage's steps with nobody waiting
    bursts = lines[lines.index("") + 1 :]
    assert bursts[4] == "codellama-34b tp2 general" and bursts[6].startswith("  2  20 req/s")
    real_d, model_d, real_q, model_q = bursts[6][21:].split()
    real_d, model_d = float(real_d), float(model_d)
    starts = tq.trace_stage_starts_s(tq.trace_series(data.steps), [d for _, d in spec.stages])
    w = raw[(t_s >= starts[1] + tq.QUEUE_SKIP_S) & (t_s < starts[1] + spec.stages[1][1])]
    free = w.loc[w["queue.waiting_depth"] == 0, "batch.num_prefill_reqs"].to_numpy(dtype=float)
    assert real_d == pytest.approx(free.var() / free.mean(), abs=6e-4)
    # the model's: its simulation's admissions, each counted in its step and the next
    from fitness.sim.engine import simulate
    from fitness.sim.models import ExpressionLatencyModel

    sim = simulate(spec, dep, ExpressionLatencyModel(entry.expression, dep, {}), seed=0, record=True)
    traj = sim.trajectory
    counts = np.zeros(traj.n_steps + 1)
    for k in traj.admit_step[traj.admit_step >= 0]:
        counts[k] += 1
        counts[k + 1] += 1
    start_s = (traj.step_start_us - traj.step_start_us[0]) / 1e6
    in_window = (start_s >= stage.window_s[0]) & (start_s < stage.window_s[1])
    free = counts[: traj.n_steps][in_window & (traj.waiting_depth(sim.requests.status, spec.request_timeout_s) == 0)]
    assert model_d == pytest.approx(free.var() / free.mean(), abs=6e-4)
    assert 0.9 < model_d < 1.1  # the simulated arrivals are Poisson
    queued = w.loc[w["queue.waiting_depth"] > 0, "queue.waiting_depth"]
    assert real_q == (f"{queued.mean():.2f}" if len(queued) else "-")
    assert model_q == tq.cell(stage.stats["queued"], 7, ".2f").strip()
