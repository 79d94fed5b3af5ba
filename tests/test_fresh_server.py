"""benchmarks/fresh_server.py: a fresh server's measured start, put on simulated steps."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import load_benchmark


def test_each_step_takes_its_windows_ratio_and_the_first_the_stall():
    fs = load_benchmark("fresh_server")
    start_s = np.array([0.0, 1.9, 2.0, 5.0, 15.9, 16.0, 300.0])
    windows = [0.5, 1.5, None, 1.2, 1.0, 1.0, 1.0, 1.1]  # 2-s windows from 0 s; None: not priced
    scales = fs.start_scales(start_s, first_step_us=20_000.0, window_ratios=windows, stall_s=1.0)
    # the first step: its window's 0.5 and a 1 s stall on its 20 ms (50 times its time)
    assert scales[0] == pytest.approx(0.5 + 50.0)
    assert scales[1:7].tolist() == [0.5, 1.5, 1.0, 1.1, 1.0, 1.0]  # window 2 unknown: 1; past 16 s: 1
    # steps beyond those given run as modelled: the simulator reuses multipliers cyclically, so
    # the stall must not come round again
    assert len(scales) == 2 * len(start_s) and scales[7:].tolist() == [1.0] * 7
    assert fs.start_scales(start_s, 20_000.0, windows, 0.0)[0] == 0.5


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    fs = load_benchmark("fresh_server")
    assert fs.main(["--run-dir", str(tmp_path), "--id", "abc", "--shared", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no archive there" in err


def test_the_traces_measure_a_slow_start(shared_data):
    from types import SimpleNamespace

    from primitives.data.experiments import find_experiments
    from primitives.data.traces import load_steps
    from primitives.deployment import default_resolver

    fs = load_benchmark("fresh_server")
    entry = SimpleNamespace(expression="1.1*gemm_time_us + 1.1*kv_io_time_us + 1500*tp", overheads={}, run_config={})
    data = load_steps([shared_data / "steps"])
    experiments = shared_data / "experiments"
    specs = {s.name: s for s in find_experiments(experiments)}
    starts = fs.measured_starts(data, default_resolver(), entry, experiments, specs, 1)
    assert {tp for _, tp in starts} == {2, 4}  # the two traced deployments
    windows, stall_s = starts[next(k for k in starts if k[1] == 4)]
    # Llama-2-70B: 11 requests present at its first sampled step, where a simulation holds a few
    assert len(windows) == 8 and 0.5 < stall_s < 2.0 and max(w for w in windows if w is not None) > 1.3
