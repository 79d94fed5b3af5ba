"""`python -m evolve archive ...` and the CLI's error handling, on a hand-filled archive."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from dataclasses import replace
from importlib import metadata
from pathlib import Path

import pytest
from conftest import SUBPROCESS_ENV

from archive.entry import ArchiveEntry, entry_id_for
from archive.rundir import record_latest
from archive.select import recommend
from archive.store import ArchiveStore
from evolve.cli import main

REPO = Path(__file__).resolve().parents[1]


def entry(expr: str, complexity: int, step_mape: float, e2e: float, generation: int = 0) -> ArchiveEntry:
    return ArchiveEntry(
        id=entry_id_for(expr),
        expression=expr,
        simplified=expr,
        complexity=complexity,
        constants=[0.5, 3.0],
        objectives={"step_mape": step_mape, "complexity": complexity, "e2e_error": e2e},
        generation=generation,
        primitives=["decode_tokens", "weight_bytes_per_gpu"],
        overheads={"inter_step_gap_us": 850.0},
        per_experiment={
            "llama-2-70b-tp4-general": {"mape": step_mape, "e2e_error": e2e, "n": 593},
            "codellama-34b-tp2-general": {"mape": step_mape * 1.1, "e2e_error": e2e, "n": 716},
        },
    )


FRONT = [
    entry("3.0*weight_bytes_per_gpu", 3, 0.40, 0.50),
    entry("0.5*decode_tokens + 3.0*weight_bytes_per_gpu", 7, 0.10, 0.12, generation=2),
    entry("max(0.5*decode_tokens, 3.0*weight_bytes_per_gpu)", 9, 0.09, float("inf"), generation=3),
]
OFF_FRONT = entry("decode_tokens", 1, 0.90, 0.95)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project folder with one finished run named in runs/LATEST; cwd is the folder."""
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "20240101T000000Z-seed0"
    with ArchiveStore(run_dir / "archive.sqlite") as store:
        store.start_run("run-1", {"generations": 4}, 0, "fp-abc")
        store.record_generation("run-1", 0, [OFF_FRONT], [OFF_FRONT], {})
        store.record_generation("run-1", 3, FRONT, FRONT, {"evals": 1000})
        store.finish_run("run-1", {"generations": 4})
    record_latest(run_dir)
    return run_dir


def one_error_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Traceback" not in err
    return lines[0]


def test_list_json(project: Path, capsys):
    assert main(["archive", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in rows] == [e.id for e in FRONT]
    for r in rows:
        assert {"id", "expression", "complexity", "objectives", "generation", "constants", "overheads"} <= set(r)
        assert isinstance(r["objectives"], dict)
    assert rows[1]["generation"] == 2 and rows[1]["constants"] == [0.5, 3.0]
    assert rows[2]["objectives"]["e2e_error"] is None  # inf is not JSON: printed as null
    assert [r["id"] for r in rows if r["recommended"]] == [recommend(FRONT).id]


def test_list_all_and_table(project: Path, capsys):
    assert main(["archive", "list", "--all", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert OFF_FRONT.id in {r["id"] for r in rows}
    assert next(r for r in rows if r["id"] == OFF_FRONT.id)["on_front"] is False
    assert main(["archive", "list", "--run-dir", str(project)]) == 0
    out = capsys.readouterr().out
    for e in FRONT:
        assert e.id in out
    assert "step MAPE" in out and "E2E err" in out and "10.00%" in out


def test_best_json(project: Path, capsys):
    assert main(["archive", "best", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)
    # worst-case error: the 9-node model has an infinite E2E error; the 7-node one wins
    assert best["id"] == FRONT[1].id == recommend(FRONT).id
    assert best["expression"] == FRONT[1].expression and best["complexity"] == 7
    assert best["objectives"]["step_mape"] == 0.10 and best["combined_error"] == 0.12
    assert main(["archive", "best"]) == 0
    assert FRONT[1].id in capsys.readouterr().out


def test_show(project: Path, capsys):
    target = FRONT[1]
    assert main(["archive", "show", target.id[:7]]) == 0
    out = capsys.readouterr().out
    assert target.id in out and "decode_tokens" in out
    # experiment names wrap at spaces, not inside a squeezed column; every line fits 80 columns
    assert "llama-2-70b tp4 general" in out and "codellama-34b tp2 general" in out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "inter_step_gap_us" in out and "850" in out
    assert "simplified (sympy)" in out
    assert "first found in generation" in out


def test_show_says_what_of_the_tree_the_expression_leaves_out(tmp_path: Path, monkeypatch, capsys):
    """Complexity, constants and primitives are the evolved tree's: a term fitted to 0 is not
    in the expression, nor its primitive; show says so, where a plain entry needs no note."""
    tree = replace(
        entry("1.17675*gemm_time_us + 1955.21*tp", 11, 0.03, 0.03),
        constants=[0.0, 1.17675, 0.0, 1955.21],
        primitives=["gemm_time_us", "moe_touched_fraction", "tp"],
    )
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "r"
    with ArchiveStore(run_dir / "archive.sqlite") as store:
        store.start_run("run-1", {"generations": 1}, 0, "fp")
        store.record_generation("run-1", 0, [tree, FRONT[1]], [tree, FRONT[1]], {})
        store.finish_run("run-1", {"generations": 1})
    record_latest(run_dir)
    assert main(["archive", "show", tree.id]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "intercept 0; terms 1.17675, 0, 1955.21" in out
    assert "moe_touched_fraction (not in the expression)" in out and "tp (not" not in out
    assert "the evolved tree's; the expression sums like terms, drops 0s" in out
    assert main(["archive", "show", FRONT[1].id]) == 0
    out = capsys.readouterr().out
    assert "intercept 0.5; terms 3" in out and "not in the expression" not in out and "drops 0s" not in out
    # a sum inside a bracket is one term; an entry without constants has nothing to explain
    for expr, constants in (("3.0 + 2.0*Max(a_us, b_us + c_us)", [3.0, 2.0]), ("2.0*x", [])):
        plain = replace(entry(expr, 5, 0.03, 0.03), constants=constants, primitives=[])
        with ArchiveStore(run_dir / "archive.sqlite") as store:
            store.record_generation("run-1", 1, [plain], [plain], {})
        assert main(["archive", "show", plain.id]) == 0
        assert "drops 0s" not in capsys.readouterr().out, expr


def test_a_tree_that_prints_as_a_simpler_entry_is_marked(tmp_path: Path, monkeypatch, capsys):
    """Two trees whose fits print alike (a refit may weigh the bigger one's zero terms, so the
    search keeps both): the bigger is marked '=', and the legend says what that means."""
    from evolve.front_view import COPY_LEGEND
    from evolve.report import printed_form

    simple = entry("11.837 + 1.12833*kv_io_time_us + 1601.92*tp", 17, 0.0389, 0.0177)
    bigger = entry("11.8370000004 + 1601.92*tp + 1.128329999*kv_io_time_us", 21, 0.0389, 0.0177)
    assert simple.id != bigger.id and printed_form(simple.expression) == printed_form(bigger.expression)
    assert printed_form("1.16*Max(w, g + k) - 2.5e-3*tp") == printed_form("-0.0025*tp + 1.16*Max(w, g + k)")
    assert printed_form("1.16*Max(w, g + k)") != printed_form("1.16*Max(w, g) + k")
    assert printed_form("2*log1p(x2)") == "2*log1p(x2)"  # digits inside names are no numbers
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "r"
    with ArchiveStore(run_dir / "archive.sqlite") as store:
        store.start_run("run-1", {"generations": 1}, 0, "fp")
        store.record_generation("run-1", 0, [simple, bigger], [simple, bigger], {})
        store.finish_run("run-1", {"generations": 1})
    record_latest(run_dir)
    assert main(["archive", "list"]) == 0
    out = capsys.readouterr().out

    def marked(entry_id: str) -> bool:  # '=' before the id, in the table's row or the expressions' line
        return any(entry_id in line and "=" in line.split(entry_id)[0] for line in out.splitlines())

    assert marked(bigger.id) and not marked(simple.id)
    assert COPY_LEGEND in out and max(map(len, out.splitlines())) <= 80


def test_tables_show_constants_to_six_digits_and_json_keeps_them_exact(tmp_path: Path, monkeypatch, capsys):
    """A fitted constant has 17 digits; the tables show 6, as the constants row does."""
    expr = "11.836989232876103 + 1601.9195722079112*tp + 1.128332799198561*kv_io_time_us + 0.5*x1"
    long = entry(expr, 11, 0.05, 0.05)
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "r"
    with ArchiveStore(run_dir / "archive.sqlite") as store:
        store.start_run("run-1", {"generations": 1}, 0, "fp")
        store.record_generation("run-1", 0, [long], [long], {})
        store.finish_run("run-1", {"generations": 1})
    record_latest(run_dir)
    for command in (["archive", "list"], ["archive", "best"]):
        assert main(command) == 0
        out = capsys.readouterr().out
        assert "11.837 + 1601.92*tp + 1.12833*kv_io_time_us + 0.5*x1" in " ".join(out.split()), command
        assert "1601.9195" not in out
    assert main(["archive", "show", long.id]) == 0
    out = capsys.readouterr().out  # the table cell wraps it; its literals are rounded all the same
    assert "11.837 + 1601.92*tp" in out and "1601.9195" not in out
    assert main(["archive", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["expression"] == expr


def _damage(archive: Path, change: str | tuple[str, object]) -> None:
    """CHANGE: an SQL statement, or (field, value) set in every entry's payload."""
    con = sqlite3.connect(archive)
    with con:
        if isinstance(change, str):
            con.execute(change)
        else:
            for rowid, payload in con.execute("SELECT rowid, payload FROM entries").fetchall():
                d = {**json.loads(payload), change[0]: change[1]}
                con.execute("UPDATE entries SET payload = ? WHERE rowid = ?", (json.dumps(d), rowid))
    con.close()


@pytest.mark.parametrize(
    "change,needles",
    [
        (("objectives", "x"), ["objectives", "expected dict"]),
        (("expression", 5), ["expression", "expected str"]),
        (("expression", "f((("), ["expression", "not an expression"]),
        (("overheads", [1]), ["overheads", "expected dict"]),
        (("complexity", "abc"), ["complexity", "expected int"]),
        (("constants", ["a"]), ["constants", "items"]),
        ("UPDATE generations SET front_ids = '{oops'", ["generations.front_ids", "damaged"]),
        ("UPDATE generations SET front_ids = '5'", ["generations.front_ids", "list of entry ids"]),
        ("UPDATE runs SET config_json = '[1]'", ["runs.config_json", "mapping"]),
    ],
)
def test_a_hand_damaged_archive_is_one_line_naming_the_field(project: Path, capsys, change, needles):
    """Entries are checked as they are read, so no command meets a field of the wrong kind later."""
    _damage(project / "archive.sqlite", change)
    commands = [["archive", "list"], ["archive", "best", "--json"]]
    if "generations" not in str(change):  # show reads the entry, not the front's list of ids
        commands.append(["archive", "show", FRONT[1].id])
    for command in commands:
        assert main(command) == 2, command
        line = one_error_line(capsys)
        assert "archive.sqlite" in line and all(n in line for n in needles), line


def test_a_latest_file_that_is_not_text_is_one_line(project: Path, capsys):
    (project.parent / "LATEST").write_bytes(b"\xff\xfe\x00garbage")
    assert main(["archive", "best"]) == 2
    assert "LATEST" in one_error_line(capsys)


def test_a_reader_that_goes_away_ends_the_listing_quietly(project: Path):
    """`archive list | head -1`: rich's console would exit 1; ours ends with 0 and no message."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "evolve", "archive", "list", "--all"],
        cwd=project.parents[1],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "COLUMNS": "80", "PYTHONPATH": str(REPO)},
    )
    proc.stdout.readline()
    proc.stdout.close()
    assert proc.wait(timeout=60) == 0
    assert proc.stderr.read() == b""


def test_a_path_this_user_may_not_open_is_one_line_exit_2(project: Path, capsys, monkeypatch):
    """Root reads through permission bits, so the refusal is raised where the archive is opened."""
    import evolve.cli

    def refuse(run_dir):
        raise PermissionError(13, "Permission denied", "runs/closed/archive.sqlite")

    monkeypatch.setattr(evolve.cli, "open_store", refuse)
    assert main(["archive", "list"]) == 2
    assert one_error_line(capsys) == "error: runs/closed/archive.sqlite: permission denied"

    def refuse_a_process(run_dir):  # no path: not the user's input, so the crash net with its log
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(evolve.cli, "open_store", refuse_a_process)
    assert main(["archive", "list"]) == 1
    assert "unexpected PermissionError" in capsys.readouterr().err


def test_an_empty_front_a_missing_entry_and_a_device_are_named(project: Path, capsys):
    con = sqlite3.connect(project / "archive.sqlite")
    with con:
        con.execute("UPDATE generations SET front_ids = '[]' WHERE generation = 3")
    assert main(["archive", "list"]) == 2
    assert "generation 3 recorded an empty front" in one_error_line(capsys)
    with con:
        con.execute("UPDATE generations SET front_ids = '[\"ffffffffffff\"]' WHERE generation = 3")
    con.close()
    assert main(["archive", "best"]) == 2
    assert "entry ffffffffffff" in (line := one_error_line(capsys)) and "not stored" in line
    assert main(["archive", "list", "--run-dir", os.devnull]) == 2
    assert "not a run directory (nor an archive file)" in one_error_line(capsys)


@pytest.mark.parametrize(
    "argv",
    [
        ["export-go", "x", "--out", ""],
        ["validate", "x", "--experiments", "e", "--report", " "],
        ["archive", "show", ""],
        ["run", "--generations", "1", "--data", ""],
    ],
)
def test_an_empty_value_is_refused_not_taken_for_the_current_directory(project: Path, capsys, argv):
    assert main(argv) == 2
    assert "expected a value, got an empty one" in one_error_line(capsys)
    assert not (project.parents[1] / "step_time.go").exists()


def test_export_go_checks_its_target_before_it_prints_anything(project: Path, capsys):
    (project.parents[1] / "a_file").write_text("x")
    assert main(["export-go", FRONT[1].id, "--out", "a_file/pkg"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--out" in err, err


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"python -m evolve {metadata.version('stepsynth')}"


def test_unknown_id_is_one_line(project: Path, capsys):
    assert main(["archive", "show", "ffffffffffff"]) == 2
    line = one_error_line(capsys)
    assert "archive.sqlite" in line and "id" in line and "archive list" in line


def test_missing_run_is_one_line(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for argv in (["archive", "list"], ["archive", "best", "--json"], ["archive", "show", "abc"]):
        assert main(argv) == 2
        line = one_error_line(capsys)
        assert "no run found in this directory" in line and "--run-dir" in line
    assert main(["archive", "list", "--run-dir", str(tmp_path / "nope")]) == 2
    assert "no such run directory" in one_error_line(capsys)


def test_empty_run_is_one_line(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with ArchiveStore(tmp_path / "r" / "archive.sqlite") as store:
        store.start_run("r", {}, 0, "fp")
    assert main(["archive", "best", "--run-dir", str(tmp_path / "r")]) == 2
    assert "no generation recorded yet" in one_error_line(capsys)


def test_usage_errors_exit_2(project: Path, capsys):
    assert main(["archive"]) == 2
    assert main(["run"]) == 2  # --generations is required
    assert main(["run", "--generations", "0"]) == 2
    capsys.readouterr()
    assert main(["--help"]) == 0


def test_python_dash_m_entry_point(project: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "evolve", "archive", "show", "0000000"],
        cwd=project.parent.parent,
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")
    proc = subprocess.run(
        [sys.executable, "-m", "evolve", "archive", "best", "--json"],
        cwd=project.parent.parent,
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["id"] == FRONT[1].id


def test_a_model_fitted_on_few_deployments_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    from conftest import small_trace

    from evolve.report import coverage_note

    # the real traces' two deployments hold about the same weights per GPU: a constant and
    # weight streaming are one column there, so `archive best` and `export-go` say so
    monkeypatch.chdir(tmp_path)
    two = [small_trace(40, "a", "llama-2-70b", 4), small_trace(40, "b", "codellama-34b", 2)]
    (tmp_path / "two.csv").write_text("".join(t.to_csv(index=False, header=i == 0) for i, t in enumerate(two)))
    run_dir = tmp_path / "runs" / "r"
    with ArchiveStore(run_dir / "archive.sqlite") as store:
        store.start_run("run-1", {"generations": 4, "data": [str(tmp_path / "two.csv")]}, 0, "fp")
        store.record_generation("run-1", 3, FRONT, FRONT, {})
        store.finish_run("run-1", {"generations": 4})
    assert main(["archive", "best", "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    note = out[out.index("note:") :].replace("\n", " ")
    assert "2 deployments (llama-2-70b TP4, codellama-34b TP2)" in note and "(34.5, 33.7 GB)" in note
    # the command to copy stands whole on one line
    assert any(f"python -m evolve score {FRONT[1].id} --data DIR --lodo" in line for line in out.splitlines())
    assert max(len(line) for line in out[out.index("note:") :].splitlines()) <= 80
    # export-go says the same after what it wrote, and nothing where it refuses the export
    # (these hand-filled entries' made-up overhead)
    assert main(["export-go", FRONT[1].id, "--run-dir", str(run_dir), "--out", str(tmp_path / "go")]) == 2
    assert capsys.readouterr().out == ""
    real = replace(entry("1.1*gemm_time_us + 1.2*kv_io_time_us", 7, 0.1, 0.1), overheads={})
    with ArchiveStore(run_dir / "archive.sqlite") as store:
        store.record_generation("run-1", 4, [real], [real], {})
    assert main(["export-go", real.id, "--run-dir", str(run_dir), "--out", str(tmp_path / "go")]) == 0, (
        capsys.readouterr()
    )
    out = capsys.readouterr().out
    assert (
        out.index("deployment: Llama-2-70b-hf TP4") < out.index("wrote ") < out.index("note: fitted on 2 deployments")
    )
    # data that moved, or a damaged record: nobody can tell, so no note and no error
    for data in ([str(tmp_path / "two.csv"), str(tmp_path / "gone.csv")], 5, "two.csv"):
        other = tmp_path / "runs" / f"r{len(str(data))}"
        with ArchiveStore(other / "archive.sqlite") as store:
            store.start_run("run-1", {"generations": 4, "data": data}, 0, "fp")
            store.record_generation("run-1", 3, FRONT, FRONT, {})
            store.finish_run("run-1", {"generations": 4})
        assert main(["archive", "best", "--run-dir", str(other)]) == 0
        assert "note:" not in capsys.readouterr().out
    # three deployments or more, or none found: no note; one: no leave-one-out to offer
    assert coverage_note([("a", 1, 1e9), ("b", 2, 2e9), ("c", 4, 3e9)], "x") is None
    assert coverage_note([], "x") is None
    one = coverage_note([("llama-2-7b", 1, 13.5e9)], "x")
    assert "1 deployment (llama-2-7b TP1)" in one and "--lodo" not in one and "same weights" not in one
    assert "same weights" not in coverage_note([("a", 1, 13.5e9), ("b", 2, 34e9)], "x")


def test_a_replay_run_counts_its_experiments_deployments_too(shared_data: Path):
    from archive.rundir import fitted_deployments, run_deployments

    config = {"data": [str(shared_data / "steps")], "experiments": str(shared_data / "experiments")}
    e = ArchiveEntry(**{**FRONT[1].__dict__, "run_config": config})
    fitted = {(d.model, d.tp) for d in fitted_deployments(e)}
    assert {("llama-2-70b", 4), ("codellama-34b", 2)} <= fitted and ("meta-llama/Llama-2-7b-hf", 1) in fitted
    assert {(d.model, d.tp) for d in run_deployments(e)} == {("llama-2-70b", 4), ("codellama-34b", 2)}  # traces first


def test_the_command_line_starts_without_sympy():
    """Every command (--version, --help, a bad option) pays for sympy only when it prices
    an expression: archive.entry checks expressions with ast alone."""
    code = "import sys, evolve.cli, archive.entry; print('sympy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "False"


def test_wrapped_lines_keep_an_option_with_its_value_and_a_command_whole():
    from evolve.report import fill_whole

    others = ", ".join(f"--model model-{i}-v0-1 --tp {2**i}" for i in range(6))
    text = fill_whole(f"deployment: X TP1 on H100 (the run's first deployment; others: {others})", 80)
    lines = text.splitlines()
    assert len(lines) > 1 and max(map(len, lines)) <= 80
    assert not any(line.rstrip(",)").endswith(("--tp", "--model")) for line in lines), text
    assert all(f"model-{i}-v0-1" in text.replace("\n", " ") for i in range(6))  # names unbroken at hyphens
    assert "--tp -1" in fill_whole("x " * 37 + "--tp -1", 80)  # a negative value stays too
    command = "python -m evolve score abc --data DIR --lodo"
    wrapped = fill_whole("word " * 13 + command + " checks.", 80, keep=(command,))
    assert any(command in line for line in wrapped.splitlines()), wrapped
