"""score's per-step errors: the signed error by batch size, on hand-made and real runs."""

from __future__ import annotations

import json

import numpy as np
import pytest
from error_lines import call

from fitness.step_errors import error_by_quantile


def test_error_by_quantile_splits_steps_into_equal_bins_and_signs_the_error():
    batch = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], dtype=float)
    obs = np.full(10, 100.0)
    pred = np.where(batch <= 5, 95.0, 110.0)  # 5% fast at small batches, 10% slow at large ones
    bins = error_by_quantile(batch[::-1], pred[::-1], obs, k=2)  # the order of the steps does not matter
    assert [(b["from"], b["to"], b["n"]) for b in bins] == [(1.0, 5.0, 5), (6.0, 10.0, 5)]
    assert [b["bias"] for b in bins] == pytest.approx([-0.05, 0.10])
    assert [b["mape"] for b in bins] == pytest.approx([0.05, 0.10])
    # fewer steps than bins: one bin per step
    assert len(error_by_quantile(batch[:3], pred[:3], obs[:3], k=5)) == 3


def test_score_reports_the_error_by_batch_size_of_a_real_run(archive, tmp_path, capsys, monkeypatch):
    run_dir, entry_id, data = archive
    monkeypatch.chdir(tmp_path)
    rc, out, _ = call(["score", entry_id, "--data", data, "--run-dir", run_dir, "--json", "s.json"], capsys)
    assert rc == 0 and "Signed step error by batch size" in out
    for row in json.loads((tmp_path / "s.json").read_text())["experiments"]:
        bins = row["by_batch_size"]
        assert sum(b["n"] for b in bins) == row["n"]  # every step in one bin
        assert all(b["from"] <= b["to"] for b in bins) and all(abs(b["bias"]) <= b["mape"] + 1e-12 for b in bins)
        # the bins' MAPE, weighted by their steps, is the experiment's
        assert sum(b["mape"] * b["n"] for b in bins) / row["n"] == pytest.approx(row["mape"])
