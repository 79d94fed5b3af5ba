"""Tails in ``validate``: the JSON fields, the ranking check, the blackbox baseline, the
80-column tables and the HTML report (opened in a real headless browser where one exists)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console
from scipy.stats import kendalltau
from test_validate import LLAMA_7B, LLAMA_70B, entry, observe, write_experiment

from evolve.baseline import blackbox_baseline
from evolve.front_view import RECOMMENDED_LEGEND, print_entries
from evolve.html_report import write_report
from evolve.validation import validate_entry
from evolve.validation_view import baseline_wrong, print_validation
from fitness.ranking import ranking, ranking_check
from fitness.validate import ClosedLoopSettings, every_request_failed
from primitives.deployment import default_resolver

STATS = ("mean", "p50", "p90", "p99")
# the law behind the 'observations': another model than the validated one
LAW = "1500.0 + 1.2*weight_time_us + 1.5*kv_io_time_us + 30.0*allreduce_calls"


@pytest.fixture(scope="module")
def validated(tmp_path_factory):
    """Four experiments with results (two models, two stages each) and one withheld, validated
    with the baseline; the result and the folder."""
    root = tmp_path_factory.mktemp("exps")
    for (model, tp), short in [(LLAMA_7B, "llama-2-7b-tp1"), (LLAMA_70B, "llama-2-70b-hf-tp4")]:
        for stages, workload in [([(1.0, 8), (3.0, 8)], "codegen"), ([(2.0, 8), (5.0, 8)], "general")]:
            d = write_experiment(root, f"20260101-000000-{short}-{workload}", model, tp, stages=stages)
            observe(d, LAW)
    write_experiment(root, "20260101-000000-llama-2-7b-tp1-reasoning", *LLAMA_7B, rate=3.0, duration=8)
    res = validate_entry(entry(), root, None, default_resolver(), jobs=1, baseline=True, plot_dir=root / "report")
    return res, root


def test_the_json_keeps_every_field_and_adds_the_tails(validated, tmp_path, monkeypatch):
    res, _ = validated
    items = {i["name"].split("-", 2)[-1]: i for i in res["experiments"]}
    got, withheld = items["llama-2-70b-hf-tp4-general"], items["llama-2-7b-tp1-reasoning"]
    for scope in [got, *got["stages"]]:
        for m in ("e2e", "ttft", "itl", "tpot"):
            for stat in STATS:
                p, o, e = (scope[f"{m}_{stat}_{k}"] for k in ("pred_s", "obs_s", "error"))
                assert p > 0 and o > 0 and e == pytest.approx(p / o - 1)
        assert scope["e2e_error"] == scope["e2e_mean_error"] and scope["e2e_mean_pred_s"] > 0
        assert scope["failure_fraction_pred"] == 0.0 and scope["failure_fraction_obs"] == 0.0
        curves = scope["percentiles_s"]["ttft"]
        assert list(curves["obs"]) == list(curves["pred"]) and curves["obs"]["p90"] == scope["ttft_p90_obs_s"]
    assert got["e2e_p99_pred_s"] >= got["e2e_p90_pred_s"] >= got["e2e_p50_pred_s"]
    assert withheld["e2e_p99_pred_s"] > 0 and withheld["e2e_p99_obs_s"] is None and withheld["e2e_p99_error"] is None
    summary = res["summary"]
    assert summary["e2e_p99_error_max"] == pytest.approx(
        max(abs(i["e2e_p99_error"]) for i in items.values() if i["e2e_p99_error"] is not None)
    )
    assert {"e2e_error_mean", "itl_p90_error_mean", "tpot_p50_error_max"} <= set(summary)
    json.dumps(res)  # plain JSON all the way down


def test_self_observed_tails_have_no_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    observe(write_experiment(tmp_path, "x-llama-2-7b-tp1-general", *LLAMA_7B, stages=[(2.0, 8), (6.0, 8)]))
    res = validate_entry(entry(), tmp_path, None, default_resolver(), jobs=1)
    (item,) = res["experiments"]
    for scope in [item, *item["stages"]]:
        for m in ("e2e", "ttft", "itl", "tpot"):
            for stat in STATS:
                assert scope[f"{m}_{stat}_error"] == pytest.approx(0.0, abs=1e-9), (m, stat)
    assert res["ranking"][0]["experiments"] == 1 and res["ranking"][0]["pairs"] == 0 and "baseline" not in res


def _item(name, obs, pred, stat="e2e_p99"):
    return {"name": name, f"{stat}_obs_s": obs, f"{stat}_pred_s": pred}


def test_ranking_counts_wrong_orders_among_pairs_apart():
    obs = [1.0, 1.05, 2.0, 4.0, 3.0]
    pred = [1.1, 1.0, 3.0, 2.5, 2.5]
    items = [_item(n, o, p) for n, o, p in zip("abcde", obs, pred, strict=True)] + [_item("f", None, 9.0)]
    r = ranking(items, "e2e_p99")
    # a-b are 5% apart: not counted (though ordered wrongly); every other pair is apart by more than 10%
    assert r["experiments"] == 5 and r["pairs"] == 9
    # c-d (2.0 < 4.0, predicted 3.0 > 2.5), c-e (2.0 < 3.0, 3.0 > 2.5), d-e (tie: wrong)
    assert r["inversions"] == 3 and sorted(map(tuple, r["inverted_pairs"])) == [("c", "d"), ("c", "e"), ("d", "e")]
    assert r["kendall_tau"] == pytest.approx(kendalltau(obs, pred).statistic)
    perfect = ranking([_item(n, o, 2 * o) for n, o in zip("abcde", obs, strict=True)], "e2e_p99")
    assert perfect["inversions"] == 0 and perfect["kendall_tau"] == pytest.approx(1.0)
    both = ranking_check(
        items + [_item("a", None, None, "ttft_p99")], [_item(n, o, 2 * o) for n, o in zip("abcde", obs, strict=True)]
    )
    assert [b["stat"] for b in both] == ["e2e_p99", "ttft_p99"]
    assert both[0]["baseline_inversions"] == 0 and both[0]["baseline_pairs"] == both[0]["pairs"] == 9
    assert both[1]["experiments"] == 0 and both[1]["kendall_tau"] is None


def test_baseline_is_a_per_model_blackbox_in_the_closed_loop(validated):
    res, root = validated
    base = res["baseline"]
    assert set(base["models"]) == {"Llama-2-7b-hf", "Llama-2-70b-hf"}
    for fit in base["models"].values():
        assert re.search(r"prefill_tokens", fit["expression"]) or re.search(r"decode_tokens", fit["expression"])
        assert not {"weight_time_us", "kv_io_time_us"} & set(re.findall(r"[a-z_]+", fit["expression"]))
    names = sorted(i["name"] for i in base["experiments"])
    assert names == sorted(i["name"] for i in res["experiments"] if i["e2e_mean_obs_s"] is not None)
    # the observations follow one law per model; three coefficients per model track its means
    assert base["summary"]["e2e_error_max"] < 0.05
    assert all("baseline_inversions" in r for r in res["ranking"])


def test_blackbox_baseline_fits_each_model_apart(tmp_path):
    """Two models whose steps follow different blackbox laws: one shared blackbox could not
    follow both, the per-model fits do (E2E and ITL; the means' rows leave TTFT less pinned)."""
    laws = {
        LLAMA_7B: "4000.0 + 2.0*prefill_tokens + 60.0*decode_tokens",
        LLAMA_70B: "9000.0 + 9.0*prefill_tokens + 150.0*decode_tokens",
    }
    for (model, tp), law in laws.items():
        for rate, workload in [(1.0, "codegen"), (4.0, "general")]:
            name = f"x-{model.split('/')[1].lower()}-tp{tp}-{workload}"
            observe(write_experiment(tmp_path, name, model, tp, rate=rate, duration=8), law)
    base = blackbox_baseline(tmp_path, default_resolver(), ClosedLoopSettings(jobs=1))
    assert len({v["expression"] for v in base["models"].values()}) == 2
    assert len(base["experiments"]) == 4
    for m in ("e2e", "itl"):
        assert max(abs(i[f"{m}_error"]) for i in base["experiments"]) < 0.03, m


def _lines(renderable_printer) -> list[str]:
    console = Console(width=80, record=True, force_terminal=False)
    renderable_printer(console)
    return console.export_text().splitlines()


def test_validate_tables_fit_80_columns(validated):
    res, _ = validated
    res = {**res, "load_draws": 100, "load_seed": 10**6}  # the most draws the CLI takes: its lines fit too
    inside = {f"{m}_mean": [100, 100] for m in ("e2e", "ttft", "itl", "tpot")}
    res["summary"] = {**res["summary"], "obs_in_range": inside}
    lines = _lines(lambda c: print_validation(c, res, "Validation of abc123 (step time x1.05)"))
    assert max(len(line) for line in lines) <= 80
    assert any("the mean of 100 draws of the load" in line for line in lines)
    assert "seeds 1000000-1000099" in " ".join(lines)
    one = _lines(lambda c: print_validation(c, {**res, "load_draws": 1, "load_seed": 7}, "Validation of abc123"))
    assert "predicted: draw 7 of the load (--seed)" in one and max(len(line) for line in one) <= 80
    assert any("means inside the draws' range: E2E 100/100, TTFT 100/100" in line for line in lines)
    text = "\n".join(lines)
    for words in ("E2E s", "p99", "Ranking", "model wrong", "TTFT p90", "llama-2-70b tp4", "errors in %"):
        assert words in text
    # the longest title, the stage transfer's, stays one line above tables whose titles are short
    from evolve.validation_view import VALIDATE_MODES

    title = f"Validation of fe955dd8f116 ({VALIDATE_MODES['stage-transfer'][1]})"  # as validate builds it
    staged = _lines(lambda c: print_validation(c, res, title))
    assert staged[0] == title and staged[1].rstrip() == "Means: predicted / observed"


def test_a_table_too_wide_for_its_names_folds_them_and_never_cuts_a_number():
    from evolve.report import rows_table

    row = {"deployment": "20260218-135247-mixtral-8x7b-v0-1-tp2-reasoning", "n": 123456, "mape as stored": 0.0312}
    row |= {"mape refitted": 0.0401, "pinned": "yes", "flag": "on the bound (4)"}  # score --lodo's columns
    lines = _lines(lambda c: c.print(rows_table([row], title="t")))
    text = "\n".join(lines)
    assert "123456" in text and "3.12%" in text and "4.01%" in text and "yes" in text  # cut short before
    assert max(len(line) for line in lines) <= 80
    term = {"term": "prefill_attention_time_us", "kind": "efficiency", "coefficient": "4"}
    term["flag"] = "on the upper bound (4)"
    lines = _lines(lambda c: c.print(rows_table([term], title="Fitted efficiencies")))
    assert any("prefill_attention_time_us" in line for line in lines)  # it fits: the name stays whole


def test_a_front_table_marks_which_errors_are_simulated_end_to_end():
    from evolve.front_view import CLOSED_LOOP_LEGEND

    objectives = {"e2e_error": 0.1457, "closed_loop": 1.0}
    checked = replace(entry("2.0*decode_tokens"), id="checked00000", objectives=objectives)
    estimated = replace(entry("3.0*decode_tokens"), id="estimated000", objectives={"e2e_error": 0.1311})
    lines = _lines(lambda c: print_entries(c, [checked, estimated], None, "all"))
    assert any("checked00000" in line and "14.57% c" in line for line in lines)
    assert any("estimated000" in line and "13.11%" in line and "13.11% c" not in line for line in lines)
    assert CLOSED_LOOP_LEGEND in lines and max(len(line) for line in lines) <= 80
    alone = _lines(lambda c: print_entries(c, [checked], None, "all"))  # nothing to tell apart: no marks
    assert CLOSED_LOOP_LEGEND not in alone and not any("14.57% c" in line for line in alone)


def test_experiment_labels_fit_a_line_and_name_a_held_out_stage_by_its_rate():
    from evolve.validation_view import experiment_label, print_validation, summary_table

    name = "20260218-135247-mixtral-8x7b-v0-1-tp2-reasoning"
    assert experiment_label({"name": name}) == "mixtral-8x7b tp2 reasoning"
    assert experiment_label({"name": "20260218-065057-llama-2-70b-hf-tp4-reasoning"}) == "llama-2-70b tp4 reasoning"
    staged = {"name": "20260217-202857-llama-2-70b-tp4-general", "held_out_stage": 1, "rate_per_s": 20.0}
    assert experiment_label(staged) == "llama-2-70b tp4 general @20/s"
    two = {**staged, "held_out_stage": 2, "held_out_stages": 2}  # two stages at the top rate: which one
    assert experiment_label(two) == "llama-2-70b tp4 general @20/s stage_2"
    withheld = {"name": name, "e2e_mean_pred_s": 93.8, "e2e_mean_obs_s": None, "failure_fraction_pred": 0.0}
    lines = _lines(lambda c: print_validation(c, {"experiments": [withheld], "summary": {}}, "Validation of x"))
    assert any("mixtral-8x7b tp2 reasoning" in line and "93.8 / —" in line for line in lines)  # one line
    assert any(line.startswith("—: nothing to compare (results withheld") for line in lines)
    summary = {"itl_p50_error_mean": 0.429, "itl_p50_error_max": 0.741}
    shown = "\n".join(_lines(lambda c: c.print(summary_table(summary))))
    assert "ITL p50 is the gap between a token's two events" in shown


def test_stage_transfer_rows_go_under_their_rate_and_rows_without_results_leave_the_errors_table():
    """The longest stage-transfer labels took two lines at 80 columns with the rate in each;
    the rate now heads its rows. A withheld experiment's row of dashes leaves the errors
    table (the means table still shows what it predicts)."""
    from evolve.validation_view import print_validation

    def staged(name, rate, error):
        return {"name": name, "held_out_stage": 1, "rate_per_s": rate, "e2e_mean_error": error, "e2e_p99_error": -0.113}

    items = [
        staged("20260218-150304-codellama-34b-tp2-general", 20.0, 0.012),
        staged("20260218-150956-codellama-34b-tp2-codegen", 10.0, -0.019),
        staged("20260218-130541-mixtral-8x7b-v0-1-tp2-general", 20.0, 0.027),
    ]
    lines = _lines(lambda c: print_validation(c, {"experiments": items, "summary": {}}, "Validation of x"))
    assert max(len(line) for line in lines) <= 80
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("Signed errors")) :]
    heads = [i for i, line in enumerate(table) if line.strip() in ("@10/s", "@20/s")]
    assert [table[i].strip() for i in heads] == ["@10/s", "@20/s"]  # by rate, each once
    assert table[heads[0] + 1].split()[:4] == ["codellama-34b", "tp2", "codegen", "-1.9"]
    assert table[heads[1] + 1].split()[:4] == ["codellama-34b", "tp2", "general", "+1.2"]
    assert table[heads[1] + 2].split()[:4] == ["mixtral-8x7b", "tp2", "general", "+2.7"]  # items' order within
    withheld = {"name": "20260218-160939-codellama-34b-tp2-reasoning", "e2e_mean_pred_s": 64.3, "e2e_mean_obs_s": None}
    seen = {**items[0], "name": "20260218-155500-codellama-34b-tp2-roleplay"}
    del seen["held_out_stage"]
    lines = _lines(lambda c: print_validation(c, {"experiments": [seen, withheld], "summary": {}}, "V"))
    errors = lines[next(i for i, line in enumerate(lines) if line.startswith("Signed errors")) :]
    assert any("64.3 / —" in line for line in lines) and not any("reasoning" in line for line in errors)
    assert any(line.split()[:3] == ["codellama-34b", "tp2", "roleplay"] for line in errors)
    only = _lines(lambda c: print_validation(c, {"experiments": [withheld], "summary": {}}, "V"))
    assert not any(line.startswith("Signed errors") for line in only)


def test_a_transfer_check_keeps_its_names_whole_and_its_counts_readable(validated):
    """--lomo: the held-out models' table names each model unbroken, within 80 columns, and
    the summary's counts read as words below its table, not as keys squeezed into a caption."""
    res, _ = validated
    groups = {"CodeLlama-34b-Instruct-hf": {"e2e_error_mean": 0.0178, "e2e_error_max": 0.0178}}
    groups["Llama-2-7b-hf"] = {k: 1.1868 for k in ("e2e_error_mean", "ttft_error_max", "itl_error_max")}
    summary = {**res["summary"], "experiments": 3, "e2e_error_mean_over_models": 0.132977, "models": groups}
    lines = _lines(lambda c: print_validation(c, {**res, "summary": summary}, "Validation of abc123 (leave one out)"))
    assert max(len(line) for line in lines) <= 80
    text = "\n".join(lines)
    assert "CodeLlama-34b-Instruct-hf" in text and "118.7%" in text
    assert "e2e error mean over models 13.30%" in text and "e2e_error" not in text
    assert "(held out)" not in text  # the title says what is held out, every row is


def test_long_expressions_go_below_the_table():
    long = " + ".join(f"{i}.5*kv_tokens*batch_size" for i in range(12))
    entries = [replace(entry(e), id=f"id{i:010d}") for i, e in enumerate(["2.0*decode_tokens", long])]
    lines = _lines(lambda c: print_entries(c, entries, entries[1].id, "front"))
    table = lines[: next(i for i, line in enumerate(lines) if line.startswith("expressions"))]
    assert max(len(line) for line in table) <= 80 and "kv_tokens" not in "\n".join(table)
    assert table[-1] == RECOMMENDED_LEGEND  # one line below the table, not wrapped to its width
    below = lines[len(table) + 2 :]  # after the first entry's line: wrapped between terms, within 80 columns
    assert below[0].startswith(f"* {entries[1].id}  0.5*kv_tokens*batch_size + ") and len(below) > 1
    assert max(len(line) for line in below) <= 80 and " ".join(" ".join(below).split()[2:]) == long
    short = _lines(lambda c: print_entries(c, entries[:1], None, "front"))
    assert any("2*decode_tokens" in line and "id0000000000" in line for line in short)  # in its column; 2.0 shows as 2
    assert RECOMMENDED_LEGEND not in short  # nothing recommended among them


def _browser() -> str | None:
    return next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


CHECK = """<script>
window.addEventListener('load', () => {
  const imgs = [...document.images];
  const ok = imgs.filter(i => i.complete && i.naturalWidth > 0).length;
  const headings = [...document.querySelectorAll('h2')].map(h => h.textContent);
  const tables = document.querySelectorAll('table').length;
  document.body.setAttribute('data-check', JSON.stringify({images: imgs.length, loaded: ok, tables, headings}));
});
</script></body>"""


def test_html_report_opens_in_a_browser_with_every_image(validated, tmp_path):
    res, root = validated
    page = write_report(res, entry(), tmp_path / "report", str(root))
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>") and "src='http" not in html and 'src="http' not in html
    # every row's ITL p50 (the 10th error column) is shown without a verdict colour, and the page says why
    rows = re.findall(r"<tr><td class=name>.*?</tr>", html.split("Errors per experiment")[1].split("</table>")[0])
    scored = [re.findall(r"<td class='(\w+)'", r) for r in rows if "<td>—</td>" not in r]  # withheld: no errors
    assert scored and all(cells[9] == "info" and "info" not in cells[:9] + cells[10:] for cells in scored)
    assert "ITL p50 is uncoloured" in html
    # a stage's row says its rate and its lifecycle file, counted from 0 ("stage 1" read as the first)
    assert "&nbsp;&nbsp;@1/s stage_0</td>" in html and "&nbsp;&nbsp;@3/s stage_1</td>" in html
    # the kernel floor on every catalog deployment the export ships the model for
    floor = html.split("Step time over the measured kernels")[1].split("</table>")[0]
    assert all(f"<td class=name>{m}</td>" in floor for m in ("Llama-2-7b-hf", "Mixtral-8x7B-v0.1"))
    assert html.count("data:image/png;base64,") == 1 + len(res["experiments"])  # the grid, one curve figure each
    browser = _browser()
    if browser is None:
        pytest.skip("no headless browser (chromium) on this machine: install the system package to run this check")
    probe = tmp_path / "probe.html"
    probe.write_text(html.replace("</body>", CHECK))
    out = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--virtual-time-budget=10000",
            "--dump-dom",
            probe.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    m = re.search(r"data-check=\"([^\"]*)\"", out.stdout)
    assert m, out.stderr[-2000:]
    check = json.loads(m.group(1).replace("&quot;", '"'))
    assert check["images"] == 1 + len(res["experiments"]) and check["loaded"] == check["images"]
    assert check["tables"] >= 6
    for section in (
        "Summary",
        "Ranking check",
        "Headroom before requests time out",
        "The model",
        "Baseline: BLIS blackbox",
    ):
        assert any(h.startswith(section) for h in check["headings"]), check["headings"]


def test_cli_report_and_its_bad_input(tmp_path, monkeypatch, capsys, validated):
    from test_cli_commands import ENTRY, fake_module

    from evolve.cli import main

    res, _ = validated
    seen = {}

    def fake_validate_entry(entry, experiments_dir, mode, resolver, **options):
        seen.update(baseline=options["baseline"], plot_dir=options["plot_dir"], headroom=options["headroom"])
        return res

    monkeypatch.chdir(tmp_path)
    from archive.rundir import RunDir, record_latest
    from archive.store import ArchiveStore

    with ArchiveStore(RunDir(tmp_path / "runs" / "r0").archive) as store:
        store.start_run("r0", {}, 0, "fp")
        store.record_generation("r0", 1, [ENTRY], [ENTRY], {})
    record_latest(tmp_path / "runs" / "r0")
    fake_module(monkeypatch, "evolve.validation", validate_entry=fake_validate_entry)
    (tmp_path / "exps").mkdir()
    assert main(["validate", ENTRY.id, "--experiments", "exps", "--report", "out/rep", "--json", "v.json"]) == 0
    assert seen == {"baseline": True, "plot_dir": Path("out/rep"), "headroom": True}  # the report has both
    assert (tmp_path / "out" / "rep" / f"validate-{ENTRY.id}.html").is_file()
    assert json.loads((tmp_path / "v.json").read_text())["ranking"][0]["stat"] == "e2e_p99"
    assert "report: " in capsys.readouterr().out
    assert main(["validate", ENTRY.id, "--experiments", "exps", "--report", "r", "--lomo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "--report" in err
    (tmp_path / "afile").write_text("x")
    assert main(["validate", ENTRY.id, "--experiments", "exps", "--report", "afile"]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert np.isfinite(res["ranking"][0]["kendall_tau"])


def test_the_report_says_what_the_figures_are_the_mean_of(validated):
    """``validate --load-draws N --report``: the page says so, and a cell's hover gives the range."""
    import copy

    from evolve.html_report import render

    res, root = validated
    assert "draws of the load" not in render(res, entry(), str(root))
    assert "draw 0" not in render(res, entry(), str(root))  # the default draw goes unsaid
    other = {**res, "load_seed": 5}  # validate --seed 5, one draw: the items carry no load_seeds
    assert not any(i.get("load_seeds") for i in other["experiments"])
    assert "The load is the generator's draw 5 (validate --seed 5)." in render(other, entry(), str(root))
    res = copy.deepcopy(res)
    res["load_draws"] = 3
    item = res["experiments"][0]
    item.update(load_seeds=[0, 1, 2], e2e_mean_pred_min_s=0.5, e2e_mean_pred_max_s=0.75, e2e_mean_obs_in_range=False)
    res["summary"] = {**res["summary"], "obs_in_range": {"e2e_mean": [3, 4]}}
    page = render(res, entry(), str(root))
    assert "the mean of 3 draws of the load (arrival times and prompt lengths; seeds 0-2)" in page
    assert "simulated 0.5 to 0.75 s over the draws of the load: the observation is outside" in page
    assert "observed inside the range of the draws" in page and "<td>3 of 4</td>" in page


def test_the_failed_share_reads_as_the_terminal_gives_it():
    from evolve.html_report import error_rows

    item = {"name": "20260218-x-tp2-reasoning", "failure_fraction_pred": 0.0635, "failure_fraction_obs": None}
    assert error_rows([item], stages=False)[0][-1] == "6.3% / —"  # one decimal, as fmt_share; no result: —
    # coloured by the difference as shown: 0.0% / 10.0% is within the 10-point goal
    near = {**item, "failure_fraction_pred": 0.0, "failure_fraction_obs": 0.1004}
    assert error_rows([near], stages=False)[0][-1].startswith("<td class='good' title='10.0 percentage points")


def test_a_run_whose_every_request_failed_is_scored_on_its_failed_share(tmp_path, monkeypatch):
    """The real run's lifecycle files count failures only (no latency block): it has results,
    its failed share is compared and coloured by the 10-point goal, its latencies are not."""
    monkeypatch.chdir(tmp_path)
    d = write_experiment(tmp_path, "20260101-000000-llama-2-7b-tp1-reasoning", *LLAMA_7B, rate=1.0, duration=4)
    none = {"count": 0, "latency": {k: None for k in ("request_latency", "time_to_first_token")}}
    (d / "results" / "summary_lifecycle_metrics.json").write_text(
        json.dumps({"successes": none, "failures": {"count": 4, "request_latency": None}})
    )
    observe(write_experiment(tmp_path, "20260101-000000-llama-2-70b-hf-tp4-general", *LLAMA_70B, duration=4), LAW)
    res = validate_entry(entry(), tmp_path, None, default_resolver(), jobs=1, baseline=True)
    item = next(i for i in res["experiments"] if "reasoning" in i["name"])
    assert item["failure_fraction_obs"] == 1.0 and item["failure_fraction_pred"] == 0.0
    assert item["e2e_mean_obs_s"] is None and item["e2e_error"] is None and item["e2e_mean_pred_s"] > 0
    assert res["summary"]["with_results"] == 2 and res["summary"]["all_failed"] == 1
    assert res["summary"]["failure_fraction_diff_pp_max"] == 100.0
    # the baseline has no latency of Llama-2-7B to fit: it is fitted for the other model only
    assert res["baseline"]["unfitted"] == ["Llama-2-7b-hf"] and list(res["baseline"]["models"]) == ["Llama-2-70b-hf"]
    assert [i["name"] for i in res["baseline"]["experiments"]] == ["20260101-000000-llama-2-70b-hf-tp4-general"]
    lines = _lines(lambda c: print_validation(c, res, "V"))
    assert any("0 / 100" in line for line in lines) and any("every request failed" in line for line in lines)
    assert "no baseline for Llama-2-7b-hf: every request of its runs failed" in lines
    page = write_report(res, entry(), tmp_path / "report", str(tmp_path)).read_text()
    assert "(2 with results; in 1 every request failed, so only the failed share is compared)" in page
    assert "no baseline for Llama-2-7b-hf: every request of its runs failed.</p>" in page
    # results that count no request at all are not a run whose every request failed
    assert not every_request_failed({"failures_obs": 0, "e2e_mean_obs_s": None}) and every_request_failed(item)
    # where the baseline ranks fewer pairs than the model, its count says out of how many
    assert baseline_wrong({"pairs": 5, "baseline_pairs": 3, "baseline_inversions": 1}) == "1 of 3"
    assert baseline_wrong({"pairs": 5, "baseline_pairs": 5, "baseline_inversions": 1}) == "1"
    assert "every request of the real run failed: simulated curves only" in page and "results withheld" not in page
    assert "<td class='bad' title='100.0 percentage points apart'>0.0% / 100.0%</td>" in page


def test_an_overloaded_runs_ttft_reads_in_seconds_in_the_means_table():
    item = {"name": "20260217-170634-llama-2-7b-tp1-reasoning", "ttft_mean_pred_s": 100.03, "ttft_mean_obs_s": 9.4}
    lines = _lines(lambda c: print_validation(c, {"experiments": [item], "summary": {}}, "V"))
    assert any("100 s / 9400" in line for line in lines)  # not 100030 in a column of milliseconds


def test_a_panel_over_many_decades_labels_its_decades_only():
    """An overloaded run's TTFT (minutes) beside the others' (tens of ms): labels at 1, 2 and 5
    of each of five decades overlapped; a panel of short range keeps them."""
    from evolve.validation_view import predicted_vs_observed_figure

    base = {"model": "m", "e2e_mean_obs_s": 2.0, "e2e_mean_pred_s": 2.1}
    wide = [
        {**base, "name": "a", "ttft_mean_obs_s": 0.03, "ttft_mean_pred_s": 0.03},
        {**base, "name": "b", "ttft_mean_obs_s": 150.0, "ttft_mean_pred_s": 100.0},
    ]
    fig = predicted_vs_observed_figure(wide, "t")
    e2e, ttft = fig.axes[0], fig.axes[1]
    lo, hi = ttft.get_xlim()
    shown = [t for t in ttft.xaxis.get_majorticklocs() if lo <= t <= hi]
    assert shown and all(np.isclose(np.log10(t), round(np.log10(t))) for t in shown)  # 0.1, 1, 10, 100
    lo, hi = e2e.get_xlim()
    assert any(not np.isclose(np.log10(t), round(np.log10(t))) for t in e2e.xaxis.get_majorticklocs() if lo <= t <= hi)
