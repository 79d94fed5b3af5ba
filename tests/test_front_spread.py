"""benchmarks/front_spread.py: the blind predictions of the front's plausible models, and their range."""

from types import SimpleNamespace

import pytest
from conftest import load_benchmark

NAME = "20260218-135247-mixtral-8x7b-v0-1-tp2-reasoning"


@pytest.fixture(scope="module")
def spread():
    return load_benchmark("front_spread")


def _entry(id_: str, complexity: int, e2e_max: float | None, closed_loop: bool = True):
    objectives = {} if e2e_max is None else {"e2e_error_max": e2e_max}
    if closed_loop:
        objectives["closed_loop"] = 1.0
    return SimpleNamespace(id=id_, complexity=complexity, objectives=objectives)


def _item(e2e: float, failed: float, fit: float = 0.036) -> dict:
    return {
        "name": NAME,
        "e2e_mean_pred_s": e2e,
        "ttft_mean_pred_s": e2e / 2,
        "itl_mean_pred_s": 0.0121,
        "failure_fraction_pred": failed,
        "fit_e2e_error_max": fit,
    }


def test_only_models_checked_end_to_end_within_the_bar_are_kept_simplest_first(spread):
    front = [
        _entry("worse", 11, 0.093),
        _entry("best", 17, 0.036),
        _entry("too_far", 7, 0.31),
        _entry("estimate", 9, 0.02, closed_loop=False),  # the search's estimate, not a simulation
        _entry("unchecked", 13, None),
    ]
    assert [e.id for e in spread.plausible(front, 0.10)] == ["worse", "best"]
    assert [e.id for e in spread.plausible(front, 0.05)] == ["best"]


def test_a_model_with_another_form_of_the_same_arithmetic_is_not_counted_twice(spread):
    predictions = {
        "fe955dd8f116": [_item(93.8, 0.0)],
        "14250391820b": [_item(93.8 * (1 + 1e-9), 0.0)],  # same arithmetic, last bits apart
        "c4f54511aad9": [_item(82.3, 0.0, fit=0.093)],
    }
    kept, repeats = spread.distinct(predictions)
    assert list(kept) == ["fe955dd8f116", "c4f54511aad9"] and repeats == {"14250391820b": "fe955dd8f116"}
    assert not spread.same_predictions([_item(93.8, 0.0)], [_item(93.8, 0.01)])  # failures differ
    kept, repeats = spread.distinct(predictions, prefer="14250391820b")  # the recommended one of twins stays
    assert list(kept) == ["14250391820b", "c4f54511aad9"] and repeats == {"fe955dd8f116": "14250391820b"}


def test_the_table_gives_each_model_and_the_range_within_80_columns(spread):
    kept = {"fe955dd8f116": [_item(93.8, 0.064)], "c4f54511aad9": [_item(82.3, 0.0, fit=0.093)]}
    lines = spread.spread_lines(kept, recommended="fe955dd8f116")
    assert lines[0] == "mixtral-8x7b tp2 reasoning" and max(len(line) for line in lines) <= 80
    (best,) = [line for line in lines if "fe955dd8f116" in line]
    assert best.startswith("* ") and best.split()[2:] == ["93.8", "46.9", "12.1", "6.4%", "3.6%"]
    (span,) = [line for line in lines if line.strip().startswith("range")]
    assert span.split()[1:] == ["82.3–93.8", "41.1–46.9", "12.1", "0.0–6.4%"]  # ends as the rows write them


def test_bad_input_is_one_line_and_status_2(spread, tmp_path, capsys):
    rc = spread.main(["--run-dir", str(tmp_path / "nowhere"), "--experiments", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1
