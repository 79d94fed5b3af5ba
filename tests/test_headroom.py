"""``validate --headroom``: the factors on step time and on load at which more than 1% of an
experiment's requests time out, found by bisection and checked against plain validations."""

import json

import pytest
from rich.console import Console
from test_validate import LLAMA_7B, OVERHEADS, entry, write_experiment

from evolve.cli import main
from evolve.html_report import write_report
from evolve.validation import validate_entry
from evolve.validation_view import print_validation
from fitness.headroom import FACTOR_RANGE, FAILED_THRESHOLD, ROUNDS, factor_text, headroom, scaled_run
from fitness.sim.engine import simulate
from fitness.sim.models import ExpressionLatencyModel
from fitness.validate import ClosedLoopSettings
from primitives.data.experiments import find_experiments, load_experiment
from primitives.deployment import default_resolver

EXPR = "2000.0 + 1.1*weight_time_us + 1.3*kv_io_time_us"
# (timeout s, max_num_seqs). A 40-token request at about 6.5 ms a step takes about 0.27 s:
# these timeouts put the step time's crossing above 1 (the margin left), below 1 (failing
# already), and off the range; with two slots ('queue') more load builds a queue that tips it
EXPERIMENTS = {"margin": (0.35, 128), "failing": (0.22, 128), "never": (1000.0, 128), "always": (0.005, 128)}
EXPERIMENTS["queue"] = (1.5, 2)


@pytest.fixture(scope="module")
def experiments(tmp_path_factory):
    root = tmp_path_factory.mktemp("exps")
    for name, (timeout, slots) in EXPERIMENTS.items():
        name = f"x-{name}-llama-2-7b-tp1-general"
        write_experiment(root, name, *LLAMA_7B, rate=3.0, duration=6, timeout=timeout, max_num_seqs=slots)
    return root


@pytest.fixture(scope="module")
def found(experiments):
    specs = find_experiments(experiments)
    res = headroom(specs, default_resolver(), EXPR, OVERHEADS, ClosedLoopSettings(jobs=2))
    return {item["name"].split("-")[1]: item for item in res["experiments"]}, res


def _failed(experiments, name: str, step_time_scale: float) -> float:
    """The failed fraction of one experiment, from a plain closed-loop validation."""
    one = experiments.parent / f"one-{name}-{step_time_scale}"
    if not one.exists():
        one.mkdir()
        (one / "e").symlink_to(next(experiments.glob(f"x-{name}-*")))
    res = validate_entry(
        entry(EXPR), one, None, default_resolver(), jobs=1, step_time_scale=step_time_scale, plot_dir=one
    )
    return res["experiments"][0]["failure_fraction_pred"]


@pytest.mark.parametrize("name", ["margin", "failing"])
def test_the_bracket_holds_the_crossing_as_validate_sees_it(experiments, found, name):
    items, res = found
    step = items[name]["step_time"]
    below, above = step["bracket"]
    # the end on the far side of 1: where the margin ends, or where a failing run would stop
    assert step["factor"] == (above if name == "margin" else below) and step["beyond"] is None
    assert above / below <= (FACTOR_RANGE[1] / FACTOR_RANGE[0]) ** (0.5 / 2**ROUNDS) * 1.0001
    assert (above > 1) == (name == "margin")  # a margin above 1; below 1 for the one failing already
    assert _failed(experiments, name, below) <= FAILED_THRESHOLD < _failed(experiments, name, above)
    assert (items[name]["failure_fraction_pred"] > FAILED_THRESHOLD) == (name == "failing")
    assert res["failed_threshold"] == FAILED_THRESHOLD and res["knobs"] == ["step_time", "load"]


def test_off_the_range_it_says_on_which_side(found):
    items, _ = found
    for knob in ("step_time", "load"):
        assert items["never"][knob] == {"factor": None, "bracket": None, "beyond": ">"}
        assert items["always"][knob] == {"factor": None, "bracket": None, "beyond": "<"}
    assert factor_text(items["never"]["load"]) == ">4" and factor_text(items["always"]["load"]) == "<0.25"
    assert factor_text(items["margin"]["step_time"]).startswith("x1.")


def test_more_load_is_more_requests_in_the_same_time(experiments, found):
    spec = load_experiment(next(experiments.glob("x-margin-*")))
    more, expr = scaled_run(spec, EXPR, "load", 2.0)
    assert expr == EXPR and more.stages == ((6.0, 6),) and more.num_requests == 2 * spec.num_requests
    slower, scaled = scaled_run(spec, EXPR, "step_time", 2.0)
    assert slower is spec and scaled != EXPR
    items, _ = found
    # no load lightens a request too slow on its own; with 128 slots no load up to x4 builds a
    # queue; with two, one does
    assert items["failing"]["load"]["beyond"] == "<" and items["margin"]["load"]["beyond"] == ">"
    below, above = items["queue"]["load"]["bracket"]
    assert items["queue"]["load"]["factor"] == above > 1 >= items["queue"]["failure_fraction_pred"] / FAILED_THRESHOLD
    queue = load_experiment(next(experiments.glob("x-queue-*")))
    dep = default_resolver().resolve_experiment(queue)
    for factor, tipped in ((below, False), (above, True)):
        tight, _ = scaled_run(queue, EXPR, "load", factor)
        got = simulate(tight, dep, ExpressionLatencyModel(EXPR, dep, OVERHEADS), seed=0, record=False).metrics.summary
        assert (got.failures / (got.successes + got.failures) > FAILED_THRESHOLD) == tipped
    with pytest.raises(ValueError, match="unknown knob"):
        scaled_run(spec, EXPR, "memory", 2.0)


def test_validate_headroom_reaches_the_json_the_table_and_the_report(experiments, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    res = validate_entry(entry(EXPR), experiments, None, default_resolver(), jobs=2, headroom=True, plot_dir=tmp_path)
    names = [item["name"] for item in res["headroom"]["experiments"]]
    assert names == [item["name"] for item in res["experiments"]]
    console = Console(width=80, record=True, force_terminal=False)
    print_validation(console, res, "Validation of abc123")
    lines = console.export_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Headroom"))
    table = lines[start : next(i for i, line in enumerate(lines) if line.startswith("x1.30: ")) + 1]
    assert max(len(line) for line in table) <= 80
    assert len([line for line in table if line.startswith(" x-")]) == len(EXPERIMENTS)
    margin = next(i for i in res["headroom"]["experiments"] if i["name"].startswith("x-margin"))
    row = next(line for line in table if "x-margin" in line).split()
    assert row[-3:] == ["0.0%", factor_text(margin["step_time"]), ">4"]
    html = write_report(res, entry(EXPR), tmp_path / "report", str(experiments)).read_text()
    table = html.split("Headroom before requests time out")[1].split("</table>")[0]
    assert table.count("<tr>") == 1 + len(EXPERIMENTS) and "&gt;4" in table and "&lt;0.25" in table


def test_cli_headroom(experiments, tmp_path, monkeypatch, capsys):
    from test_cli_archive import one_error_line

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("evolve.cli._get_entry", lambda run_dir, entry_id: entry(EXPR))
    monkeypatch.setattr("evolve.cli._plots_dir", lambda run_dir: tmp_path)
    assert main(["validate", "abc123", "--experiments", str(experiments), "--headroom", "--lowo"]) == 2
    line = one_error_line(capsys)
    assert line.startswith("error: --headroom") and line.endswith("drop --lowo")
    assert main(["validate", "abc123", "--experiments", str(experiments), "--headroom", "--json", "v.json"]) == 0
    saved = json.loads((tmp_path / "v.json").read_text())
    assert {i["name"].split("-")[1] for i in saved["headroom"]["experiments"]} == set(EXPERIMENTS)
    assert "Headroom" in capsys.readouterr().out


def test_an_experiment_without_requests_has_no_headroom(tmp_path):
    """No request, no failed share: nothing to bisect, and the reports say so ('—'), not a margin."""
    name = "x-empty-llama-2-7b-tp1-general"  # 0.1 req/s for 5 s: int(0.5) = 0 requests are sent
    write_experiment(tmp_path, name, *LLAMA_7B, rate=0.1, duration=5, timeout=10.0, max_num_seqs=128)
    spec = find_experiments(tmp_path)
    res = headroom(spec, default_resolver(), EXPR, OVERHEADS, ClosedLoopSettings(jobs=1))
    (item,) = res["experiments"]
    assert item["failure_fraction_pred"] is None
    for knob in ("step_time", "load"):
        assert item[knob] == {"factor": None, "bracket": None, "beyond": None} and factor_text(item[knob]) == "—"


def test_the_curves_of_an_experiment_that_served_nothing_say_so():
    """An experiment without results whose every request timed out has no curve to draw: the
    figure says so instead of failing on a legend of no entries."""
    from evolve.html_report import curves_figure

    fig = curves_figure({"name": "x-always-llama-2-7b-tp1-general", "stages": []})
    assert "no successful request" in [t.get_text() for t in fig.axes[0].texts]
