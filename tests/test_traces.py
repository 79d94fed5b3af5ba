"""The step-trace loader: real shared traces and malformed input."""

import numpy as np
import pandas as pd
import pytest

from fitness.dataset import build_step_table
from primitives.data.traces import load_trace
from primitives.deployment import default_resolver
from primitives.errors import InputError
from primitives.registry import AGGREGATE_FEATURES


def test_real_traces_give_the_documented_cycle_time_pairs(shared_data):
    data = load_trace(shared_data / "steps")
    pairs = data.steps.groupby("experiment")["cycle_time_us"].count()
    means = data.steps.groupby("experiment")["cycle_time_us"].mean()
    assert pairs["20260217-202857-llama-2-70b-tp4-general"] == 593
    assert pairs["20260218-150304-codellama-34b-tp2-general"] == 716
    assert means["20260217-202857-llama-2-70b-tp4-general"] == pytest.approx(20059.5, rel=1e-4)
    assert means["20260218-150304-codellama-34b-tp2-general"] == pytest.approx(15740.9, rel=1e-4)
    # real traces carry aggregates only
    assert data.available_features == AGGREGATE_FEATURES
    row = data.steps.iloc[0]
    assert row["kv_tokens"] == (31356 - 31030) * 16


def test_step_table_split_is_temporal_per_experiment(shared_data):
    table = build_step_table(load_trace(shared_data / "steps"), default_resolver())
    assert "attention_work" not in table.primitive_names
    for e in range(len(table.experiment_names)):
        rows = table.experiment == e
        assert abs((~table.is_train[rows]).mean() - 0.2) < 0.01
    with pytest.raises(InputError, match="per-request detail"):
        build_step_table(load_trace(shared_data / "steps"), default_resolver(), ["attention_work"])


def _flat(n=6, **over):
    df = pd.DataFrame(
        {
            "experiment_id": ["e"] * n,
            "model": ["llama-2-7b"] * n,
            "tp": [1] * n,
            "step.id": np.arange(n),
            "step.ts_start_ns": np.arange(n) * 8_000_000,
            "step.duration_us": [300] * n,
            "batch.prefill_tokens": [10] * n,
            "batch.decode_tokens": [20] * n,
            "batch.num_prefill_reqs": [1] * n,
            "batch.num_decode_reqs": [20] * n,
            "kv.blocks_total_gpu": [1000] * n,
            "kv.blocks_free_gpu": [900] * n,
        }
    )
    for k, v in over.items():
        df[k] = v
    return df


def test_csv_traces_load_like_parquet(tmp_path):
    df = _flat()
    df.to_csv(tmp_path / "t.csv", index=False)
    df.to_parquet(tmp_path / "t.parquet")
    a, b = load_trace(tmp_path / "t.csv"), load_trace(tmp_path / "t.parquet")
    assert np.allclose(a.steps["cycle_time_us"].dropna(), 8000.0)
    pd.testing.assert_frame_equal(a.steps, b.steps)


def test_step_table_of_every_sampled_step(tmp_path):
    _flat(6, **{"step.id": [0, 1, 2, 5, 6, 9], "batch.decode_tokens": [20, 21, 22, 23, 24, 25]}).to_csv(
        tmp_path / "t.csv", index=False
    )
    data = load_trace(tmp_path / "t.csv")
    targets = build_step_table(data, default_resolver(), ["decode_tokens"], 0.0)
    every = build_step_table(data, default_resolver(), ["decode_tokens"], 0.0, every_step=True)
    assert list(targets.columns["decode_tokens"]) == [20, 21, 23]  # steps whose next step was sampled
    assert list(every.columns["decode_tokens"]) == [20, 21, 22, 23, 24, 25]  # the data's order
    assert np.isnan(every.cycle_time_us[[2, 4, 5]]).all() and np.isfinite(every.cycle_time_us[[0, 1, 3]]).all()


def test_a_parquet_column_of_booleans_is_no_tp(tmp_path):
    """Parquet keeps true/false as booleans, which pandas would take for 1 and 0."""
    from error_lines import good_trace

    good_trace().assign(tp=True).to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(InputError, match="tp: a column of true/false values"):
        load_trace(tmp_path / "bad.parquet")


def test_a_folder_of_one_table_under_another_name_is_that_table(tmp_path):
    from archive.rundir import _trace_deployments

    (tmp_path / "one").mkdir()
    _flat().to_parquet(tmp_path / "one" / "held_out_steps.parquet")
    (tmp_path / "one" / "._held_out_steps.parquet").write_bytes(b"")  # a copier's shadow file is no table
    (tmp_path / "one" / "step_requests.csv").write_text("not the detail of that table")  # by a standard name only
    by_folder, by_file = load_trace(tmp_path / "one"), load_trace(tmp_path / "one" / "held_out_steps.parquet")
    pd.testing.assert_frame_equal(by_folder.steps, by_file.steps)
    assert by_folder.requests is None and by_file.requests is None
    # the run's record of its deployments (export, the coverage note) finds the same table
    assert [d.experiment for d in _trace_deployments(tmp_path / "one")] == sorted(by_folder.experiments)
    (tmp_path / "two").mkdir()
    _flat().to_parquet(tmp_path / "two" / "a.parquet")
    _flat().to_csv(tmp_path / "two" / "b.csv", index=False)
    with pytest.raises(InputError, match=r"or one table; found 2 tables \(a.parquet, b.csv\): name the file"):
        load_trace(tmp_path / "two")
