"""benchmarks/trace_checks.py: prefill in the traces against each step's least time, and a
fresh server's first seconds against an archived model."""

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from conftest import load_benchmark, small_trace

from primitives.data.traces import load_steps
from primitives.deployment import default_resolver


def _trace_checks():
    return load_benchmark("trace_checks")


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


def test_ratio_cells_fit_their_width():
    tc = _trace_checks()
    assert [tc.ratio_cell(v, 4, 2) for v in (1.234, None, 12.5)] == ["1.23", "   -", ">9.9"]
    assert tc.ratio_cell(10.0, 5, 3) == ">9.99"
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
    lines = tc.first_seconds(data, default_resolver(), entry, None)
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


@pytest.mark.parametrize(
    "args, message",
    [
        (["--id", "x"], "--run-dir and --id"),
        (["--run-dir", "{tmp}", "--id", "x"], "no archive there"),
        (["--data", "{tmp}/none.parquet"], "no such file"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    tc = _trace_checks()
    assert tc.main([a.format(tmp=tmp_path) for a in args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err and len(captured.err.strip().splitlines()) == 1


def test_on_the_real_traces(shared_data, capsys):
    tc = _trace_checks()
    assert tc.main(["--shared", str(shared_data.parent)]) == 0
    out = capsys.readouterr().out
    rows = {line[:26].strip(): line[26:].split() for line in out.splitlines() if line.startswith(("llama", "code"))}
    assert set(rows) == {"llama-2-70b tp4 general", "codellama-34b tp2 general"}
    assert all(int(r[1]) < 0.01 * int(r[0]) for r in rows.values())  # under 1% of the steps prefill 100+ tokens
    assert max(len(line) for line in out.splitlines()) <= 80
