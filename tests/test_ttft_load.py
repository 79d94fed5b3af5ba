"""benchmarks/ttft_load.py: the median TTFT's gap per load stage, against the running requests."""

import json

import pytest
from conftest import load_benchmark


@pytest.fixture(scope="module")
def ttft_load():
    return load_benchmark("ttft_load")


def _validation(path, gaps_ms: dict[tuple[float, float], float]) -> None:
    """A validate JSON whose stages (rate, mean E2E) have the given median TTFT gaps, and a withheld run."""
    stages = [
        {
            "rate_per_s": rate,
            "e2e_mean_obs_s": e2e,
            "ttft_p50_obs_s": 0.050,
            "ttft_p50_pred_s": 0.050 - gap / 1e3,
            "ttft_mean_obs_s": 0.060,
            "ttft_mean_pred_s": 0.058,
        }
        for (rate, e2e), gap in gaps_ms.items()
    ]
    withheld = {"name": "20260217-170634-llama-2-7b-tp1-reasoning", "stages": [{"ttft_p50_obs_s": None}]}
    exp = {"name": "20260217-202857-llama-2-70b-tp4-general", "stages": stages}
    path.write_text(json.dumps({"id": "abc", "experiments": [exp, withheld]}))


def test_the_gap_line_is_found(ttft_load, tmp_path, capsys):
    # gap = -2 ms + 50 us per running request, running = rate * mean E2E
    loads = [(5.0, 2.0), (8.0, 4.0), (20.0, 5.0), (10.0, 9.0)]
    path = tmp_path / "v.json"
    _validation(path, {(r, e): -2.0 + 0.050 * r * e for r, e in loads})
    entry, rows = ttft_load.stage_rows(path)
    assert entry == "abc" and len(rows) == 4 and rows[0]["name"] == "llama-2-70b tp4 general"
    a, b, r = ttft_load.gap_line(rows)
    assert a == pytest.approx(-2.0) and b == pytest.approx(50.0) and r == pytest.approx(1.0)
    assert ttft_load.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "-2.00 ms +50.0 us x running requests (r = +1.00, 4 stages)" in out
    assert max(len(line) for line in out.splitlines()) <= 80


@pytest.mark.parametrize(
    "text, expected",
    [
        ("{", "not JSON"),
        ('{"experiments": 3}', "experiments: expected the list"),
        ('{"experiments": [{"stages": [{"ttft_p50_obs_s": 0.05, "rate_per_s": "x"}]}]}', "stages[0].rate_per_s"),
        ('{"experiments": []}', "no load stage with observed results"),
    ],
)
def test_bad_input_is_one_line(ttft_load, tmp_path, capsys, text, expected):
    path = tmp_path / "v.json"
    path.write_text(text)
    assert ttft_load.main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {path}") and expected in err
