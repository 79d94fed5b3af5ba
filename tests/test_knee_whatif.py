"""benchmarks/knee_whatif.py: its disturbances keep the mean step time, and the trace side finds a stall."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import load_benchmark


def _whatif():
    return load_benchmark("knee_whatif")


def test_stalls_take_their_share_of_the_time_and_keep_the_mean():
    kw = _whatif()
    stalls = kw.Stalls(multiple=20.0, share=0.02)
    # the chance per step that makes stalls of 20 steps' time take 2% of it: p*m / (1 + p*m)
    assert stalls.chance * 20.0 / (1 + stalls.chance * 20.0) == pytest.approx(0.02, rel=1e-12)
    scales = stalls.scales(seed=3)
    assert scales.mean() == pytest.approx(1.0, rel=0.01)
    stalled = scales > scales.min()
    assert np.unique(scales).size == 2  # a step either stalls or not
    share = (scales[stalled] - scales.min()).sum() / scales.sum()  # time beyond the plain steps
    assert share == pytest.approx(0.02, rel=0.1)
    assert np.array_equal(stalls.scales(seed=3), scales) and not np.array_equal(stalls.scales(seed=4), scales)


def test_drift_has_its_spread_and_lasts_its_correlation_time():
    kw = _whatif()
    scales = kw.Drift(sd=0.02, tau_steps=100.0).scales(seed=0)
    assert scales.mean() == pytest.approx(1.0, abs=0.002) and scales.std() == pytest.approx(0.02, rel=0.1)
    x = scales - scales.mean()
    lagged = np.corrcoef(x[:-100], x[100:])[0, 1]
    assert lagged == pytest.approx(np.exp(-1.0), abs=0.05)  # e^-1 one correlation time later


def test_the_trace_side_finds_a_stall_between_sampled_steps():
    kw = _whatif()
    rng = np.random.default_rng(0)
    step_id = np.cumsum(rng.integers(5, 15, size=3000)).astype(float)  # a sample of ~1 step in 10
    priced = np.full(len(step_id), 0.02)  # every step priced at 20 ms
    start = step_id * 0.02
    start[1500:] += 0.3  # one 0.3 s stall between samples 1499 and 1500
    largest, spread = kw.interval_excess(start, step_id, priced, 0.0, start[-1] + 1)
    assert largest == pytest.approx(0.3)
    assert set(spread) == set(kw.WINDOWS_S) and all(v < 0.05 for v in spread.values())
    # steps 2% slower in every other 10-s window: that spread over 10-s windows
    drifted = [0.0]
    for steps in np.diff(step_id):
        drifted.append(drifted[-1] + steps * 0.02 * (1.02 if (drifted[-1] // 10) % 2 else 1.0))
    _, spread = kw.interval_excess(np.array(drifted), step_id, priced, 0.0, drifted[-1])
    assert spread[10.0] == pytest.approx(0.01, rel=0.15)  # half the windows 1.02, half 1.00: sd 0.01
    # outside the window, the stall is not counted
    assert kw.interval_excess(start, step_id, priced, 0.0, start[1400])[0] == pytest.approx(0.0, abs=1e-9)


def test_the_knee_is_the_stage_that_fills_its_slots():
    kw = _whatif()
    tq = load_benchmark("trace_queue")
    t = np.arange(0.0, 200.0, 0.02)
    running = np.where(t < 100, 40.0, np.where(np.arange(len(t)) % 5 == 0, 128.0, 110.0))
    real = tq.StepSeries(t, np.arange(len(t), dtype=float), running, np.zeros(len(t)))
    spec = type("Spec", (), {"stages": ((8.0, 100.0), (20.0, 100.0)), "max_num_seqs": 128})()
    assert kw.knee_stage(real, [0.0, 100.0], spec) == 1
    quiet = tq.StepSeries(t, np.arange(len(t), dtype=float), np.full(len(t), 40.0), np.zeros(len(t)))
    assert kw.knee_stage(quiet, [0.0, 100.0], spec) is None


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    kw = _whatif()
    assert kw.main(["--run-dir", str(tmp_path), "--id", "abc", "--shared", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no archive there" in err
