"""score's per-step errors: the signed error by batch size, on hand-made and real runs."""

from __future__ import annotations

import itertools
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
    assert [b["n"] for b in error_by_quantile(np.ones(4), np.full(4, 2.0), np.ones(4))] == [4]


def test_steps_of_equal_batch_size_share_a_bin():
    # a saturated trace: 17 of 20 steps at the 128-request cap, in time order the model
    # is first fast then slow there; splitting the ties would draw a slope that is not there
    batch = np.array([1.0, 2.0, 3.0] + [128.0] * 17)
    obs = np.full(20, 100.0)
    pred = np.concatenate([[100.0] * 3, np.linspace(90.0, 120.0, 17)])
    bins = error_by_quantile(batch, pred, obs)
    assert [(b["from"], b["to"], b["n"]) for b in bins] == [(1.0, 3.0, 3), (128.0, 128.0, 17)]
    assert bins[1]["bias"] == pytest.approx(np.mean(pred[3:] / 100.0 - 1.0))
    # with many ties everywhere, bins never overlap and cover every step once
    rng = np.random.default_rng(0)
    x = rng.integers(1, 12, size=500).astype(float)
    got = error_by_quantile(x, np.full(500, 1.0), np.full(500, 1.0))
    assert sum(b["n"] for b in got) == 500 and len(got) == 5
    assert all(a["to"] < b["from"] for a, b in itertools.pairwise(got))


def test_score_reports_the_error_by_batch_size_of_a_real_run(archive, tmp_path, capsys, monkeypatch):
    run_dir, entry_id, data = archive
    monkeypatch.chdir(tmp_path)
    rc, out, _ = call(["score", entry_id, "--data", data, "--run-dir", run_dir, "--json", "s.json"], capsys)
    assert rc == 0 and "Signed step error by batch size" in out
    for row in json.loads((tmp_path / "s.json").read_text())["experiments"]:
        bins = row["by_batch_size"]
        assert sum(b["n"] for b in bins) == row["n"]  # every step in one bin
        assert all(a["to"] < b["from"] for a, b in itertools.pairwise(bins))  # ties never split
        # the bins' MAPE, weighted by their steps, is the experiment's
        assert sum(b["mape"] * b["n"] for b in bins) / row["n"] == pytest.approx(row["mape"])


def test_score_tables_name_an_experiment_shortly_unless_two_would_share_the_name():
    from rich.console import Console

    from evolve.report import batch_bias_table, short_keys

    ids = ["20260217-170634-llama-2-7b-tp1-reasoning", "20260218-135247-mixtral-8x7b-v0-1-tp2-reasoning"]
    assert short_keys(ids) == dict(zip(ids, ["llama-2-7b tp1 reasoning", "mixtral-8x7b tp2 reasoning"], strict=True))
    twins = ["20260101-000000-llama-2-7b-tp1-general", "20260102-000000-llama-2-7b-tp1-general", "tp"]
    assert short_keys(twins) == {k: k for k in twins}  # two runs of one deployment: whole names
    bins = [{"from": 1.0, "to": 33.0, "n": 116, "bias": -0.476, "mape": 0.4764}]
    console = Console(width=80, record=True, force_terminal=False)
    console.print(batch_bias_table([{"experiment": i, "by_batch_size": bins} for i in ids]))
    lines = console.export_text().splitlines()
    assert any("│ mixtral-8x7b tp2 reasoning │" in line for line in lines)  # one line, not folded
    assert max(map(len, lines)) <= 80
