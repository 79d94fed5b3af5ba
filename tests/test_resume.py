"""Checkpoint and resume at the run level: SIGKILL a real `python -m evolve run`.

A run killed mid-generation and continued with ``--resume`` must end with the very
same archive as an uninterrupted run of the same seed (ids, expressions, objectives,
generations found: bit for bit), and no kill may ever leave a corrupt archive or
checkpoint behind.
"""

import json
import pickle
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from error_lines import run_evolve, spawn_evolve

# a kill lands long before the end: 40 generations take about 6 s (2026-11-29, 2 cores),
# and a kill waits at most 0.31 s after the generation it is aimed at
GENERATIONS = 40
POPULATION = 60
SEED = 7


def _tiny_trace(path: Path) -> None:
    """Two experiments in the real flat schema; cycle = 8000 + 60*decode (+ a prefill term)."""
    rng = np.random.default_rng(1)
    frames = []
    for exp, model, tp in (("tiny-a", "llama-2-7b", 1), ("tiny-b", "codellama-34b", 2)):
        n = 300
        decode = rng.integers(1, 100, n)
        prefill = rng.choice([0, 0, 0, 512], n)
        cycle_us = 8000 * tp + 60 * decode + 3 * prefill
        ts = np.concatenate([[0], np.cumsum(cycle_us)[:-1]]) * 1000
        frames.append(
            pd.DataFrame(
                {
                    "experiment_id": exp,
                    "model": model,
                    "tp": tp,
                    "step.id": np.arange(n),
                    "step.ts_start_ns": ts,
                    "step.duration_us": 300,
                    "batch.prefill_tokens": prefill,
                    "batch.decode_tokens": decode,
                    "batch.num_prefill_reqs": (prefill > 0).astype(int),
                    "batch.num_decode_reqs": decode,
                    "kv.blocks_total_gpu": 7000,
                    "kv.blocks_free_gpu": 7000 - decode * 40,
                }
            )
        )
    pd.concat(frames).to_csv(path, index=False)


def _run_args(run_dir: str, checkpoint_every: int) -> list[str]:
    return [
        "run",
        "--generations",
        str(GENERATIONS),
        "--population",
        str(POPULATION),
        "--data",
        "trace.csv",
        "--seed",
        str(SEED),
        "--checkpoint-every",
        str(checkpoint_every),
        "--run-dir",
        run_dir,
    ]


def _resume_args(run_dir: str) -> list[str]:
    return ["run", "--generations", str(GENERATIONS), "--resume", run_dir]


def _last_generation(run_dir: Path) -> int | None:
    """Highest recorded generation, read through a read-only connection (never blocks the writer)."""
    db = run_dir / "archive.sqlite"
    if not db.is_file():
        return None
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            return con.execute("SELECT max(generation) FROM generations").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return None


def _checkpoint_generation(run_dir: Path) -> int | None:
    path = run_dir / "checkpoint.pkl"
    if not path.is_file():
        return None
    with open(path, "rb") as fh:
        return pickle.load(fh)["state"].generation  # a torn checkpoint would raise here


def _checkpoint_mtime(run_dir: Path) -> float:
    try:
        return (run_dir / "checkpoint.pkl").stat().st_mtime
    except FileNotFoundError:
        return float("-inf")


def _kill_after(
    proc: subprocess.Popen, run_dir: Path, min_generation: int, extra_s: float, new_checkpoint: bool = False
) -> None:
    """SIGKILL the run once the archive holds ``min_generation`` (plus ``extra_s``).

    ``new_checkpoint``: also wait until this process has written a checkpoint of its own
    (a resumed run re-records generations the killed one had already recorded).
    """
    deadline = time.monotonic() + 120
    since = _checkpoint_mtime(run_dir) if new_checkpoint else float("-inf")
    while (_last_generation(run_dir) or -1) < min_generation or _checkpoint_mtime(run_dir) <= since:
        if proc.poll() is not None:
            pytest.fail(
                f"the run ended (status {proc.returncode}) before generation {min_generation}: "
                f"{proc.stderr.read()[-2000:]}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the run made no progress within 120 s")
        time.sleep(0.02)
    time.sleep(extra_s)
    if proc.poll() is not None:
        pytest.fail("the run finished before it could be killed; make it longer")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()


def _archive(run_dir: str, cwd: Path, everything: bool = False) -> list[tuple]:
    res = run_evolve(
        cwd, "archive", "list", "--json", "--run-dir", run_dir, *(["--all"] if everything else []), timeout=300
    )
    assert res.returncode == 0, res.stderr
    entries = json.loads(res.stdout)
    # run_id names the run directory, which differs on purpose; everything else must match
    return [
        (
            e["id"],
            e["expression"],
            e["simplified"],
            e["complexity"],
            e["objectives"],
            e["generation"],
            e["constants"],
            e["on_front"],
        )
        for e in entries
    ]


def _integrity(run_dir: Path) -> str:
    con = sqlite3.connect(str(run_dir / "archive.sqlite"))
    try:
        return con.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        con.close()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    _tiny_trace(d / "trace.csv")
    return d


@pytest.fixture(scope="module")
def uninterrupted(workdir):
    res = run_evolve(workdir, *_run_args("runs/whole", 2), timeout=300)
    assert res.returncode == 0, res.stderr
    return _archive("runs/whole", workdir), _archive("runs/whole", workdir, everything=True)


def test_killed_then_resumed_run_equals_an_uninterrupted_one(workdir, uninterrupted):
    run_dir = workdir / "runs" / "killed"
    proc = spawn_evolve(workdir, *_run_args("runs/killed", 2))
    _kill_after(proc, run_dir, min_generation=4, extra_s=0.15)  # inside generation 5 or 6
    killed_at = _checkpoint_generation(run_dir)
    assert killed_at is not None and 4 <= killed_at < GENERATIONS
    assert _integrity(run_dir) == "ok"

    res = run_evolve(workdir, *_resume_args("runs/killed"), timeout=300)
    assert res.returncode == 0, res.stderr
    assert _checkpoint_generation(run_dir) == GENERATIONS

    front, everything = uninterrupted
    assert _archive("runs/killed", workdir) == front
    assert _archive("runs/killed", workdir, everything=True) == everything


def test_repeated_kills_never_corrupt_the_archive_or_the_checkpoint(workdir, uninterrupted):
    """Checkpoint (and record) every generation, kill at staggered moments, resume each time."""
    run_dir = workdir / "runs" / "stormy"
    proc = spawn_evolve(workdir, *_run_args("runs/stormy", 1))
    _kill_after(proc, run_dir, min_generation=1, extra_s=0.0)
    kills = 1
    # staggered delays so that kills land in scoring, in sympy, in sqlite writes and in fsync
    for i, extra in enumerate((0.05, 0.31, 0.17)):
        assert _integrity(run_dir) == "ok", f"archive corrupt after kill {i}"
        done = _checkpoint_generation(run_dir)  # loads: never a torn pickle
        assert done is not None
        if done >= GENERATIONS - 4:  # too close to the end to kill reliably
            break
        proc = spawn_evolve(workdir, *_resume_args("runs/stormy"))
        try:
            _kill_after(proc, run_dir, min_generation=done + 1, extra_s=extra, new_checkpoint=True)
        except pytest.fail.Exception:
            proc.kill()
            raise
        kills += 1
    assert kills >= 3, f"only {kills} kills landed before the run neared its end"
    assert _integrity(run_dir) == "ok"
    res = run_evolve(workdir, *_resume_args("runs/stormy"), timeout=300)
    assert res.returncode == 0, res.stderr
    assert _integrity(run_dir) == "ok"
    # checkpointing every generation records more generations, but the last front is the same
    front, _ = uninterrupted
    assert _archive("runs/stormy", workdir) == front
    con = sqlite3.connect(str(run_dir / "archive.sqlite"))
    gens = [g for (g,) in con.execute("SELECT generation FROM generations ORDER BY generation")]
    status = con.execute("SELECT status FROM runs").fetchall()
    con.close()
    assert gens == list(range(1, GENERATIONS + 1))
    assert status == [("finished",)]
