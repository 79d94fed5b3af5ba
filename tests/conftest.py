import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# A subprocess of the tests runs this checkout (not whatever is installed) and inherits
# nothing of the caller's environment (a STEPSYNTH_* variable, a user's site folder).
SUBPROCESS_ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}


@pytest.fixture(scope="session", autouse=True)
def private_temp_folder(tmp_path_factory) -> Iterator[Path]:
    """The code under test writes its temp files (crash logs of the tests that make one, for
    instance) into pytest's own folder, not the machine's temp folder; subprocesses too."""
    folder = tmp_path_factory.mktemp("tmp")
    with pytest.MonkeyPatch.context() as patch:  # the session's monkeypatch, undone at its end
        patch.setattr(tempfile, "tempdir", str(folder))
        patch.setenv("TMPDIR", str(folder))
        yield folder


def load_benchmark(name: str):
    """The script ``benchmarks/NAME.py`` as a module (the benchmarks are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def shared_data_dir() -> Path:
    from primitives.data.roots import shared_data_root

    return shared_data_root() / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    d = shared_data_dir()
    needed = ["steps/step_traces.parquet", "experiments", "model_configs", "hardware", "kernels"]  # what tests read
    missing = [part for part in needed if not (d / part).exists()]
    if missing:
        pytest.skip(f"shared real data not found at {d}: no {', '.join(missing)} (set STEPSYNTH_SHARED to shared/)")
    return d


def small_trace(n: int = 400, experiment: str = "tiny", model: str = "llama-2-7b", tp: int = 1):
    """A small decode-only step trace in the real flat schema (seeded, so always the same)."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(1)
    decode = rng.integers(1, 100, n)
    ts = np.concatenate([[0], np.cumsum(8000 + 60 * decode)[:-1]]) * 1000  # cycle of step i ends at i+1
    return pd.DataFrame(
        {
            "experiment_id": experiment,
            "model": model,
            "tp": tp,
            "step.id": np.arange(n),
            "step.ts_start_ns": ts,
            "step.duration_us": 300,
            "batch.prefill_tokens": 0,
            "batch.decode_tokens": decode,
            "batch.num_prefill_reqs": 0,
            "batch.num_decode_reqs": decode,
            "kv.blocks_total_gpu": 7000,
            "kv.blocks_free_gpu": 7000 - decode * 40,
        }
    )


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A working directory holding good.csv, a small step trace; runs/ and runs/LATEST land here."""
    monkeypatch.chdir(tmp_path)
    small_trace(40).to_csv(tmp_path / "good.csv", index=False)
    return tmp_path


@pytest.fixture
def done(work, capsys) -> Path:
    """A finished tiny run in runs/a (LATEST names it)."""
    from error_lines import TINY, call

    rc, _, err = call(["run", *TINY, "--run-dir", "runs/a"], capsys)
    assert rc == 0, err
    return work / "runs" / "a"


@pytest.fixture(scope="session")
def short_default_run(tmp_path_factory) -> Path:
    """The run directory of one short search on the embedded default data (a small trace
    written here when the package ships none), shared by the Go export tests."""
    import os
    import subprocess

    from primitives.data.roots import default_data_dir

    work = tmp_path_factory.mktemp("short_run")
    cmd = [sys.executable, "-m", "evolve", "run", "--generations", "3", "--population", "30", "--run-dir", "runs/r0"]
    if not (default_data_dir() / "synthetic_step_traces.parquet").is_file():
        small_trace().to_csv(work / "trace.csv", index=False)
        cmd += ["--data", "trace.csv"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr
    return work / "runs" / "r0"


@pytest.fixture
def read_only_dir(work):
    """``work/ro``, read-only for the test, writable again afterwards (so tmp_path can be cleaned)."""
    ro = work / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    yield ro
    ro.chmod(0o755)


@pytest.fixture(scope="session")
def archive(tmp_path_factory):
    """A real (tiny) run directory, the id of an entry on its front, and its trace."""
    from error_lines import tiny_run  # it imports this module

    return tiny_run(tmp_path_factory.mktemp("archive"))


def tiny_replay_rows(probes=None):
    """Replayed rows of one experiment: two metrics, the first and the last of four step
    times of a column ``x`` whose true price is 10 per unit (PROBES: probe steps, or None)."""
    import numpy as np

    from fitness.replay_rows import ReplayRows
    from fitness.sim.latency_model import FITTED_NON_STEP_NAMES

    x = np.array([1.0, 2.0, 3.0, 4.0])
    w = np.array([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])  # the first and the last step time
    return ReplayRows(
        names=["e"],
        models=["m"],
        columns=[{"x": x}],
        weights=[w],
        overhead=[np.zeros((2, len(FITTED_NON_STEP_NAMES)))],
        fixed_us=[np.zeros(2)],
        observed_us=[w @ (10.0 * x)],
        labels=[[("e2e", "all"), ("itl", "all")]],
        probes=probes,
    )
