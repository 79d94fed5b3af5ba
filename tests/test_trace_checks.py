"""benchmarks/trace_checks.py: which step's prefill a trace's cycle time carries, a fresh
server's first seconds, and how stalls scale."""

import importlib.util

import numpy as np
import pandas as pd
import pytest
from conftest import ROOT

from primitives.deployment import default_resolver


def _trace_checks():
    spec = importlib.util.spec_from_file_location("trace_checks", ROOT / "benchmarks" / "trace_checks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _steps(prefill_cost_of_previous_us: float, n: int = 6000) -> pd.DataFrame:
    """Every step sampled; step i's cycle carries step i-1's prefill (as under async scheduling)."""
    rng = np.random.default_rng(3)
    decode = rng.integers(10, 60, n).astype(float)
    prefill = np.where(rng.random(n) < 0.2, rng.integers(16, 600, n), 0).astype(float)
    cycle = 8000 + 40 * decode + prefill_cost_of_previous_us * np.concatenate([[0.0], prefill[:-1]])
    cycle = cycle + rng.normal(0, 200, n)
    return pd.DataFrame(
        {
            "experiment": "20260101-000000-synthetic-tp1-general",
            "model": "meta-llama/Llama-2-7b-hf",
            "tp": 1,
            "gpu": None,
            "step_id": np.arange(n),
            "ts_start_us": np.concatenate([[0.0], np.cumsum(cycle)[:-1]]),
            "prefill_tokens": prefill,
            "decode_tokens": decode,
        }
    )


def _coefficients(line: str) -> list[float]:
    """The ``value±se`` cells of a check-1 row, values only."""
    return [float(cell.split("±")[0]) for cell in line.split() if "±" in cell]


def test_prefill_alignment_finds_the_step_whose_prefill_the_cycle_carries():
    tc = _trace_checks()
    lines = tc.prefill_alignment(_steps(50.0), default_resolver())
    assert lines[1].split()[0] == "experiment"
    row = lines[2]
    assert row.startswith("synthetic-tp1-general")  # the date and time stamp dropped
    step_i, step_next, step_prev = _coefficients(row)
    assert abs(step_prev - 50.0) < 3.0
    assert abs(step_i) < 3.0 and abs(step_next) < 3.0
    assert max(len(line) for line in lines) <= 80


def test_window_cycle_counts_unsampled_steps_and_refuses_idle_gaps():
    tc = _trace_checks()
    ts_s = np.array([0.0, 0.1, 0.3, 0.5])
    ids = np.array([0, 5, 15, 25])  # 20 ms per step, most of them unsampled
    pred = np.array([10_000.0, 20_000.0, 30_000.0, 99.0])
    busy = np.array([True, True, True, True])
    cycle_us, model_us = tc.window_cycle(ts_s, ids, busy, pred, 0.0, 1.0)
    assert cycle_us == pytest.approx(20_000.0)
    assert model_us == pytest.approx(20_000.0)  # the last sample's own step lies outside the span
    busy[1] = False  # an empty engine between two samples idles: no cycle to measure
    assert tc.window_cycle(ts_s, ids, busy, pred, 0.0, 1.0) is None
    assert tc.window_cycle(ts_s, ids, np.ones(4, bool), pred, 0.0, 0.2) is None  # under 3 samples


def test_on_the_real_traces_a_cycle_does_not_carry_its_own_steps_prefill(shared_data, capsys):
    tc = _trace_checks()
    assert tc.main(["--shared", str(shared_data.parent)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("llama-2-70b", "codellama-34b"))]
    assert len(rows) == 4  # checks 1 and 3 (check 2 needs an archived model)
    for row in rows[:2]:
        step_i, _, step_prev = _coefficients(row)
        flop_us = float(row.split()[-1])
        assert step_i < 0.5 * flop_us < step_prev  # its own prefill is missing, the previous step's is there
    assert max(len(line) for line in out.splitlines()) <= 80


def test_first_seconds_finds_a_warm_up_against_the_model(tmp_path):
    from types import SimpleNamespace

    from conftest import small_trace

    from primitives.data.traces import load_steps

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
    lines = tc.first_seconds(data, default_resolver(), entry, None)
    cells = [float(c) for c in lines[2].split()[1:]]
    by_window = dict(zip(tc.WINDOWS_S, cells[:-1], strict=True))
    assert all(abs(by_window[w] - 1.5) < 0.06 for w in (0, 2))
    assert all(abs(by_window[w] - 1.0) < 0.06 for w in (8, 10, 12, 14))
    # 0-12 s: 6 s hold 4 model-seconds of steps, the next 6 s hold 6: 12 s for 10, 1.2x
    assert cells[-1] == pytest.approx(1.2, abs=0.04)
