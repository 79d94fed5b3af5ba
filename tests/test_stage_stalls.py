"""benchmarks/stage_stalls.py: the longest pause each client saw, per load stage."""

import json
from pathlib import Path

import pytest
from conftest import load_benchmark, shared_data_dir
from test_sim_experiments import _make, _summary


@pytest.fixture(scope="module")
def stalls():
    return load_benchmark("stage_stalls")


def _with_percentiles(gap_s: float, e2e_median_s: float = 2.0) -> dict:
    summary = _summary()
    lat = summary["successes"]["latency"]
    lat["request_latency"].update({"median": e2e_median_s, "p99": e2e_median_s + 0.5, "p99.9": e2e_median_s + 1.5})
    lat["time_to_first_token"].update({"p99": 0.08, "max": 0.9})
    lat["inter_token_latency"].update({"max": gap_s})
    return summary


def _experiment(tmp_path: Path, stages: list[dict | None]) -> Path:
    d = _make(tmp_path)
    for k, stage in enumerate(stages):
        body = stage if stage is not None else {"successes": {"count": 0, "latency": None}, "failures": {"count": 9}}
        (d / "results" / f"stage_{k}_lifecycle_metrics.json").write_text(json.dumps(body))
    return d


def test_a_stage_row_reads_the_longest_gap_and_the_tails(stalls, tmp_path):
    d = _experiment(tmp_path, [_with_percentiles(0.75)])
    row = stalls.stage_row(d / "results" / "stage_0_lifecycle_metrics.json")
    assert row == pytest.approx(
        {"gap_s": 0.75, "e2e_p99_over_s": 0.5, "e2e_p999_over_s": 1.5, "ttft_p99_s": 0.08, "ttft_max_s": 0.9}
    )


def test_the_table_puts_a_first_stage_under_first_stages(stalls, tmp_path):
    _experiment(tmp_path, [_with_percentiles(0.75)])  # the fixture's experiment: one load stage
    lines = stalls.table(tmp_path)
    assert all(len(line) <= 80 for line in lines)
    rows = [line for line in lines if line.startswith("llama-2-7b")]
    assert len(rows) == 1 and " 0.750 " in rows[0] and "+0.50" in rows[0] and "900ms" in rows[0]
    assert lines[-1].split()[-2:] == ["0.750-0.750", "—"]


def test_a_stage_without_successes_is_left_out(stalls, tmp_path):
    d = _experiment(tmp_path, [None])
    assert stalls.stage_row(d / "results" / "stage_0_lifecycle_metrics.json") is None
    assert not [line for line in stalls.table(tmp_path) if line.startswith("llama-2-7b")]


def test_a_missing_statistic_is_one_line_naming_file_and_field(stalls, tmp_path, capsys):
    stage = _with_percentiles(0.75)
    del stage["successes"]["latency"]["inter_token_latency"]["max"]
    _experiment(tmp_path, [stage])
    assert stalls.main(["--experiments", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stage_0_lifecycle_metrics.json" in err
    assert "successes.latency.inter_token_latency.max" in err


def test_a_run_without_stage_files_gives_no_row(stalls, tmp_path):
    d = _experiment(tmp_path, [_with_percentiles(0.75)])
    (d / "results" / "stage_0_lifecycle_metrics.json").unlink()  # the summary alone
    assert not [line for line in stalls.table(tmp_path) if line.startswith("llama-2-7b")]


def test_no_experiment_with_results_is_refused(stalls, tmp_path, capsys):
    _make(tmp_path, metrics=False)  # a blind run: inputs only
    assert stalls.main(["--experiments", str(tmp_path)]) == 2
    assert "experiments with results" in capsys.readouterr().err


def test_the_real_runs(stalls):
    experiments = shared_data_dir() / "experiments"
    if not experiments.is_dir():
        pytest.skip(f"no shared experiments at {experiments} (set STEPSYNTH_SHARED)")
    lines = stalls.table(experiments)
    assert all(len(line) <= 80 for line in lines)
    assert len([line for line in lines if " tp" in line[:30]]) == 20  # 12 runs: 8 with two stages
    # the per-deployment summary: name, TP, then the first and the later stages' gap spans
    deployments = [line.split() for line in lines[-4:]]
    assert sorted(d[1] for d in deployments) == ["TP1", "TP2", "TP2", "TP4"]
    span = {d[0]: [tuple(map(float, s.split("-"))) for s in d[2:]] for d in deployments}
    later_longest = max(later[1] for _, later in span.values())
    # what RESULTS says: each multi-GPU deployment paused in its first stages for longer than any
    # later stage's longest gap; the one-GPU deployment did not
    assert all(span[d[0]][0][0] > later_longest for d in deployments if d[1] != "TP1")
    assert all(span[d[0]][0][1] <= later_longest for d in deployments if d[1] == "TP1")
