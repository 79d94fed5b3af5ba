"""`run`, `score`, `validate`, `export-go` plumbing and the run UI.

The heavy implementations (search, scoring, replay, Go export) are replaced by small
fakes in ``sys.modules`` so these tests check only what the CLI does: parse, check
inputs, call, write JSON, show tables, and turn errors into one line.
"""

from __future__ import annotations

import io
import json
import sys
import types
from pathlib import Path

import pytest

from archive.entry import ArchiveEntry, entry_id_for
from archive.rundir import RunDir, record_latest
from archive.store import ArchiveStore
from evolve.cli import main
from evolve.config import RunConfig
from evolve.ui import RunUI
from primitives.errors import InputError

ENTRY = ArchiveEntry(
    id=entry_id_for("2.0*decode_tokens"),
    expression="2.0*decode_tokens",
    simplified="2.0*decode_tokens",
    complexity=3,
    constants=[2.0],
    objectives={"step_mape": 0.2},
    generation=1,
    primitives=["decode_tokens"],
)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "r0"
    with ArchiveStore(RunDir(run_dir).archive) as store:
        store.start_run("r0", {}, 0, "fp")
        store.record_generation("r0", 1, [ENTRY], [ENTRY], {})
    record_latest(run_dir)
    return tmp_path


def fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs) -> None:
    module = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(module, k, v)
    monkeypatch.setitem(sys.modules, name, module)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    return err.strip()


# -- run ------------------------------------------------------------------------------
def test_run_builds_config_and_calls_search(project: Path, monkeypatch, capsys):
    seen: dict = {}

    def run_search(config: RunConfig, ui, *_):
        seen["config"] = config
        root = Path(config.run_dir)
        with ArchiveStore(RunDir(root).archive) as store:
            store.start_run("x", config.to_dict(), config.seed, "fp")
            store.record_generation("x", 1, [ENTRY], [ENTRY], {})
        ui.start(config.generations, config.time_limit_s)
        ui.update(1, 0.2, 1, 100.0)
        ui.finish([ENTRY], {"status": "finished"})
        return [ENTRY]

    fake_module(monkeypatch, "evolve.run", run_search=run_search)
    data = project / "steps.parquet"
    data.write_bytes(b"")
    rc = main(
        [
            "run",
            "--generations",
            "3",
            "--population",
            "20",
            "--seed",
            "7",
            "--data",
            str(data),
            "--jobs",
            "2",
            "--time-limit",
            "60",
            "--checkpoint-every",
            "2",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    config = seen["config"]
    assert (config.generations, config.population, config.seed, config.jobs) == (3, 20, 7, 2)
    assert config.data == [str(data)] and config.time_limit_s == 60.0 and config.checkpoint_every == 2
    assert config.backend == "loky" and config.resume is None
    run_dir = Path(config.run_dir)
    assert run_dir.parent == project / "runs" and run_dir.name.endswith("-seed7")
    out = capsys.readouterr().out
    assert "gen 1/3" in out and ENTRY.id in out and "run directory:" in out


def test_run_bad_inputs_are_one_line(project: Path, monkeypatch, capsys):
    fake_module(monkeypatch, "evolve.run", run_search=lambda c, ui, *_: pytest.fail("must not run"))
    assert main(["run", "--generations", "2", "--data", "missing.parquet"]) == 2
    assert "missing.parquet: --data: no such file" in one_error_line(capsys)
    assert main(["run", "--generations", "2", "--scheduler", "tcp://x:8786"]) == 2
    assert "--backend dask" in one_error_line(capsys)
    assert main(["run", "--generations", "2", "--resume", "nowhere"]) == 2
    assert "--resume" in one_error_line(capsys)

    def bad_input(config, ui, *_):
        raise InputError("traces.parquet", "step.id", "expected integers")

    fake_module(monkeypatch, "evolve.run", run_search=bad_input)
    assert main(["run", "--generations", "2"]) == 2
    assert one_error_line(capsys) == "error: traces.parquet: step.id: expected integers"
    # a run that failed before creating its archive leaves LATEST alone
    assert (project / "runs" / "LATEST").read_text().strip() == str(Path("runs") / "r0")


def test_run_interrupted_is_one_line_130(project: Path, monkeypatch, capsys):
    def interrupted(config, ui, *_):
        raise KeyboardInterrupt

    fake_module(monkeypatch, "evolve.run", run_search=interrupted)
    assert main(["run", "--generations", "2", "--run-dir", "somewhere"]) == 130
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("interrupted") and "nothing was written" in err

    def interrupted_after_a_checkpoint(config, ui, *_):
        RunDir(Path(config.run_dir)).root.mkdir(parents=True)
        RunDir(Path(config.run_dir)).checkpoint.write_bytes(b"")
        raise KeyboardInterrupt

    fake_module(monkeypatch, "evolve.run", run_search=interrupted_after_a_checkpoint)
    assert main(["run", "--generations", "2", "--run-dir", "somewhere"]) == 130
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("interrupted") and "--resume somewhere" in err

    def interrupted_inside_compiled_code(config, ui, *_):
        try:
            raise KeyboardInterrupt("signal 2")
        except KeyboardInterrupt as exc:  # as numba's dispatcher reports a signal handled on its return
            raise SystemError("CPUDispatcher(<function f>) returned a result with an exception set") from exc

    fake_module(monkeypatch, "evolve.run", run_search=interrupted_inside_compiled_code)
    assert main(["run", "--generations", "2", "--run-dir", "elsewhere"]) == 130
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("interrupted"), err


# -- score / validate / export-go ------------------------------------------------------
def test_score_writes_json_and_table(project: Path, monkeypatch, capsys):
    calls = []

    def score_entry(entry, data_paths, resolver, experiments_dir, seed):
        calls.append((entry.id, data_paths, type(resolver).__name__, experiments_dir, seed))
        bins = [
            {"from": 1.0, "to": 30.0, "n": 50, "bias": -0.04, "mape": 0.09},
            {"from": 31.0, "to": 128.0, "n": 50, "bias": 0.061, "mape": 0.11},
        ]
        factor = 1.16 if experiments_dir else None
        return [
            {
                "experiment": "llama-2-70b-tp4",
                "n": 100,
                "mape": 0.10,
                "median_ape": 0.08,
                "by_batch_size": bins,
                "kv_sharing": factor,
            },
            {"experiment": "codellama-34b-tp2", "n": 300, "mape": 0.20, "median_ape": 0.15, "kv_sharing": None},
        ]

    fake_module(monkeypatch, "fitness.step_errors", score_entry=score_entry)
    (project / "d").mkdir()
    assert main(["score", ENTRY.id[:5], "--data", "d", "--json", "out.json"]) == 0
    assert calls == [(ENTRY.id, ["d"], "DeploymentResolver", None, 0)]
    result = json.loads((project / "out.json").read_text())
    assert result["id"] == ENTRY.id and len(result["experiments"]) == 2
    assert result["overall_mape"] == pytest.approx((0.1 * 100 + 0.2 * 300) / 400)
    assert result["experiments"][0]["by_batch_size"][1]["bias"] == 0.061
    out = capsys.readouterr().out
    assert "llama-2-70b-tp4" in out and "10.00%" in out
    # the signed error by batch size is a table of its own, not a column of the first
    assert "by_batch_size" not in out and "Signed step error by batch size" in out
    assert "31-128" in out and "+6.1%" in out and "-4.0%" in out
    assert "KV as the traces count it" in out and "kv_sharing" not in out
    # --experiments: KV counted per request as the run counts it, with the run's seed, and said so
    (project / "exps").mkdir()
    run3 = project / "runs" / "r3"
    with ArchiveStore(RunDir(run3).archive) as store:
        store.start_run("r3", {"seed": 3}, 3, "fp")
        store.record_generation("r3", 1, [ENTRY], [ENTRY], {})
    capsys.readouterr()
    assert main(["score", ENTRY.id, "--data", "d", "--experiments", "exps", "--run-dir", str(run3)]) == 0
    assert calls[-1][3:] == ("exps", 3)
    out = capsys.readouterr().out
    assert "KV per request" in out and "seed 3" in out and "llama-2-70b-tp4  x1.160" in out
    assert main(["score", ENTRY.id, "--data", "d", "--experiments", "no-such"]) == 2
    assert "--experiments" in one_error_line(capsys)


def test_unwritable_json_fails_before_work(project: Path, monkeypatch, capsys):
    fake_module(monkeypatch, "fitness.step_errors", score_entry=lambda *a: pytest.fail("must not score"))
    (project / "d").mkdir()
    assert main(["score", ENTRY.id, "--data", "d", "--json", "no/such/dir/out.json"]) == 2
    assert "--json" in one_error_line(capsys)
    assert main(["score", ENTRY.id, "--data", "d", "--json", "d"]) == 2
    assert "is a directory" in one_error_line(capsys)


def test_validate(project: Path, monkeypatch, capsys):
    def validate_entry(entry, experiments_dir, mode, resolver, **options):
        assert mode == "lomo" and experiments_dir == "exps"
        assert options["refit_rounds"] == 1 and options["load_draws"] == 3 and options["step_time_scale"] == 1.0
        assert options["seed"] == 4  # the load's first draw
        item = {
            "name": "a",
            "e2e_mean_pred_s": 1.05,
            "e2e_mean_obs_s": 1.0,
            "e2e_error": 0.05,
            "ttft_mean_pred_s": 0.022,
            "ttft_mean_obs_s": 0.02,
            "ttft_error": 0.1,
            "itl_mean_pred_s": None,
            "itl_mean_obs_s": None,
            "itl_error": None,
            "failures_pred": 0,
            "failures_obs": 0,
        }
        return {"summary": {"e2e_error_mean": 0.07}, "experiments": [item]}

    fake_module(monkeypatch, "evolve.validation", validate_entry=validate_entry)
    (project / "exps").mkdir()
    assert (
        main(
            ["validate", ENTRY.id, "--experiments", "exps", "--lomo", "--refit-rounds", "1", "--load-draws", "3"]
            + ["--seed", "4", "--json", "v.json"]
        )
        == 0
    )
    saved = json.loads((project / "v.json").read_text())
    assert saved["lomo"] is True and saved["summary"]["e2e_error_mean"] == 0.07 and saved["id"] == ENTRY.id
    assert saved["experiments"][0]["itl_error"] is None
    out = " ".join(capsys.readouterr().out.split())  # (table titles wrap)
    assert "+5.0" in out and "+10.0" in out and "errors in %" in out and "leave one model out" in out
    assert main(["validate", ENTRY.id, "--experiments", "nowhere"]) == 2
    assert "no such directory" in one_error_line(capsys)
    for flag, bad in [("--load-draws", "0"), ("--load-draws", "101"), ("--load-draws", "two")] + [
        ("--step-time-scale", "0"),
        ("--step-time-scale", "nan"),
        ("--seed", "-1"),
        ("--seed", "x"),
    ]:
        assert main(["validate", ENTRY.id, "--experiments", "exps", flag, bad]) == 2
        assert flag in one_error_line(capsys)
    assert main(["validate", ENTRY.id, "--experiments", "exps", "--step-time-scale", "1.1", "--lowo"]) == 2
    assert "--step-time-scale" in one_error_line(capsys)
    assert main(["validate", ENTRY.id, "--experiments", "exps", "--step-scatter", "no-traces"]) == 2
    assert "--step-scatter" in one_error_line(capsys)


def test_validate_measures_the_step_scatter_where_asked(project: Path, monkeypatch, capsys):
    seen = {}

    def measured_step_scatter(steps_dir, resolver):
        seen["dir"] = steps_dir
        return "the scatter"

    def validate_entry(entry, experiments_dir, mode, resolver, **options):
        seen["options"] = options
        summary = {"source": "traces", "steps": 1309, "p1": 0.91, "p50": 0.989, "p90": 1.03, "p99": 1.19, "top": 2.2}
        return {"summary": {}, "experiments": [], "step_scatter": summary if options["step_scatter"] else None}

    fake_module(
        monkeypatch, "evolve.validation", validate_entry=validate_entry, measured_step_scatter=measured_step_scatter
    )
    (project / "exps").mkdir()
    (project / "traces").mkdir()
    assert main(["validate", ENTRY.id, "--experiments", "exps", "--lowo", "--step-scatter", "traces"]) == 0
    assert seen == {"dir": "traces", "options": {**seen["options"], "step_scatter": "the scatter"}}
    out = " ".join(capsys.readouterr().out.split())
    assert "simulated steps scatter as the 1309 steps of traces" in out and "p99 x1.19" in out
    (project / "run").mkdir()  # a folder named like the default is still a folder of traces
    assert main(["validate", ENTRY.id, "--experiments", "exps", "--step-scatter", "run"]) == 0
    assert seen["dir"] == "run" and seen["options"]["step_scatter"] == "the scatter"
    capsys.readouterr()
    assert main(["validate", ENTRY.id, "--experiments", "exps", "--step-scatter", "none"]) == 0
    assert seen["options"]["step_scatter"] is None and "scatter" not in capsys.readouterr().out
    assert main(["validate", ENTRY.id, "--experiments", "exps"]) == 0
    assert seen["options"]["step_scatter"] == "run"  # the one the entry's run measured


def test_validate_transfer_modes_are_mutually_exclusive(project: Path, monkeypatch, capsys):
    seen = []

    def validate_entry(entry, experiments_dir, mode, resolver, **options):
        seen.append(mode)
        return {
            "summary": {"e2e_error_mean": 0.0, "workloads": {"codegen": {"e2e_error_mean": 0.0}}},
            "experiments": [],
        }

    fake_module(monkeypatch, "evolve.validation", validate_entry=validate_entry)
    (project / "exps").mkdir()
    for flag, mode in [("--lowo", "lowo"), ("--stage-transfer", "stage-transfer"), (None, None)]:
        args = ["validate", ENTRY.id, "--experiments", "exps", "--json", "v.json"] + ([flag] if flag else [])
        assert main(args) == 0
        saved = json.loads((project / "v.json").read_text())
        assert seen[-1] == mode and saved["mode"] == (mode or "closed-loop") and saved["lomo"] is False
    assert "per held-out workload" in " ".join(capsys.readouterr().out.split())
    assert main(["validate", ENTRY.id, "--experiments", "exps", "--lomo", "--lowo"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert len(seen) == 3


def test_export_go(project: Path, monkeypatch, capsys):
    seen = {}

    def export_go(entry, deployment, out_dir, package, interface):
        seen.update(entry=entry.id, deployment=deployment, out=Path(out_dir), package=package, interface=interface)
        target = Path(out_dir) / "step_time.go"
        target.write_text("package x\n")
        return [target]

    def run_deployments(entry, run_dir=None):
        return [types.SimpleNamespace(experiment="exp-a", model="llama-2-7b", tp=1, gpu=None)]

    fake_module(monkeypatch, "translate_go.export", export_go=export_go)
    monkeypatch.setattr("archive.rundir.run_deployments", run_deployments)
    assert (
        main(
            [
                "export-go",
                ENTRY.id,
                "--out",
                "go/out",
                "--package",
                "sim",
                "--interface",
                "seed",
                "--model",
                "llama-2-70b",
                "--tp",
                "4",
            ]
        )
        == 0
    )
    assert seen["entry"] == ENTRY.id and seen["package"] == "sim" and seen["interface"] == "seed"
    assert seen["deployment"].tp == 4 and seen["out"] == Path("go/out")
    assert "step_time.go" in capsys.readouterr().out
    assert main(["export-go", ENTRY.id, "--out", "go2"]) == 0
    assert seen["deployment"].tp == 1 and seen["interface"] == "blis"  # the default
    assert "deployment: Llama-2-7b-hf TP1" in capsys.readouterr().out
    assert main(["export-go", ENTRY.id, "--out", "go3", "--model", "no-such-model", "--tp", "1"]) == 2
    assert "no-such-model" in one_error_line(capsys)
    assert main(["export-go", ENTRY.id, "--out", "go3", "--tp", "1"]) == 2
    assert "--model" in one_error_line(capsys)


def test_missing_implementation_is_reported_not_faked(project: Path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "evolve.validation", None)  # import fails as if the module were absent
    (project / "exps").mkdir()
    rc = main(["validate", ENTRY.id, "--experiments", "exps"])
    err = capsys.readouterr().err
    # 1, not 2: a missing piece of this build is no fault of the user's input
    assert rc == 1 and len(err.strip().splitlines()) == 1 and err.startswith("error: ") and "evolve.validation" in err


# -- UI ------------------------------------------------------------------------------
def test_quiet_ui_prints_plain_lines():
    buf = io.StringIO()
    ui = RunUI(quiet=True, min_interval_s=3600, stream=buf)
    ui.start(10, time_limit_s=120)
    for g in range(1, 11):
        ui.update(g, 0.5 / g, g, 250.0)
    ui.log("checkpoint written")
    ui.finish([ENTRY], {"status": "finished", "evaluations": 1000})
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("search: 10 generations")
    gen_lines = [line for line in lines if line.startswith("gen ")]
    assert [line.split()[1] for line in gen_lines] == ["1/10", "10/10"]  # rate-limited: first and last
    assert "holdout 5.00%" in gen_lines[-1] and "250 evals/s" in gen_lines[-1] and "ETA" in gen_lines[-1]
    assert "checkpoint written" in lines
    assert any(ENTRY.id in line and line.startswith("*") for line in lines)
    assert "status: finished" in lines


def test_rich_ui_renders_progress_and_tables(monkeypatch):
    from rich.console import Console

    clock = [100.0]  # the UI's own clock, so the estimate is exact
    monkeypatch.setattr("evolve.ui.time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    ui = RunUI(console=console)
    assert not ui.quiet
    ui.start(5, None)
    clock[0] = 110.0
    ui.update(2, 0.25, 4, 80.0)
    assert ui.eta_s(2) == 15.0  # 10 s for 2 generations, 3 to go
    ui.start(5, 12.0)
    clock[0] = 120.0
    assert ui.eta_s(2) == 2.0  # the time limit comes first
    assert ui.eta_s(0) == 2.0 and RunUI(console=console).eta_s(0) is None
    ui.finish([ENTRY], {"status": "finished"})
    text = buf.getvalue()
    assert "Pareto front" in text and ENTRY.id in text and "Run summary" in text
