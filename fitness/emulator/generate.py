"""The whole dataset: every experiment, written as Parquet with its metadata.

Output mirrors the real step traces (``synthetic_step_traces.parquet``, same flat schema
and names) from a 10 % Bernoulli sample of steps, plus the full per-request detail of
every sampled step (``synthetic_step_requests.parquet``) and ``metadata.json`` (generator
version, seed, noise sigma, row counts and the *noise floor*: the step MAPE that an
oracle knowing the noiseless physics gets on the shipped cycle-time targets).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict
from pathlib import Path

from fitness.emulator.experiment import DEFAULT_SAMPLE_FRACTION, DEFAULT_SEED, generate_experiment
from fitness.emulator.physics import EmulatorPhysics, expected_noise_floor_mape
from fitness.emulator.server import SERVER_OVERHEADS
from fitness.emulator.workloads import DURATION_SCALE, SERVED_MODELS, WORKLOADS, all_experiments, experiment_id
from fitness.sim.latency_model import SIMULATED_NON_STEP_NAMES
from primitives.data.roots import default_data_dir
from primitives.errors import InputError
from primitives.files import atomic_write_bytes, atomic_write_json

GENERATOR_VERSION = "1.0.0"
DEFAULT_DATA_DIR = default_data_dir()
STEP_TRACES_FILE = "synthetic_step_traces.parquet"
STEP_REQUESTS_FILE = "synthetic_step_requests.parquet"
METADATA_FILE = "metadata.json"


def _write_parquet(df, path: Path, delta_columns: tuple[str, ...] = ()) -> None:
    """zstd Parquet, one row group, no pandas index; integer detail columns delta-encoded."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(df, preserve_index=False)
    encodings = {c: "DELTA_BINARY_PACKED" for c in delta_columns}
    sink = pa.BufferOutputStream()
    pq.write_table(
        table,
        sink,
        compression="zstd",
        compression_level=19,
        row_group_size=max(len(df), 1),
        use_dictionary=[c for c in df.columns if c not in encodings],
        column_encoding=encodings or None,
        write_statistics=False,
    )
    atomic_write_bytes(path, sink.getvalue().to_pybytes())


def sources_fingerprint() -> str:
    """Digest of the simulator (``fitness/sim``) and this package, the code the data most
    depends on (not all of it: the deployments and the runs' defaults live in
    ``primitives``). A record, not a check: ``tests/test_emulator.py`` regenerates two
    experiments and compares them with the shipped rows."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for package in (here.parent / "sim", here):
        for path in sorted(package.glob("*.py")):
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def frame_digest(df) -> str:
    """A short digest of a frame's rows (recorded in the metadata, checked by the tests)."""
    import pandas as pd

    return hashlib.sha256(pd.util.hash_pandas_object(df, index=False).values.tobytes()).hexdigest()[:16]


def generate(
    out_dir: Path | str = DEFAULT_DATA_DIR,
    seed: int = DEFAULT_SEED,
    jobs: int = 2,
    physics: EmulatorPhysics | None = None,
    duration_scale: float = DURATION_SCALE,
    sample_fraction: float = DEFAULT_SAMPLE_FRACTION,
    experiments: list[str] | None = None,
    verbose: bool = True,
) -> dict:
    """Simulate every experiment and write the three files to OUT_DIR; returns the metadata."""
    import pandas as pd
    from joblib import Parallel, delayed

    physics = physics or EmulatorPhysics()
    todo = [
        (i, m, w)
        for i, (m, w) in enumerate(all_experiments())
        if experiments is None
        or experiment_id(m, w) in experiments
        or w.name in experiments
        or m.trace_name in experiments
    ]
    if not todo:
        raise InputError(
            "--experiments",
            "experiments",
            "no experiment matches; expected ids such as "
            f"{experiment_id(SERVED_MODELS[0], WORKLOADS['general'])}, model names or workloads",
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # biggest first so two workers finish together
    order = sorted(todo, key=lambda t: -sum(r * d * t[2].output_len for r, d in t[2].stages))
    parts = Parallel(n_jobs=jobs, backend="loky")(
        delayed(generate_experiment)(m, w, seed, i, physics, duration_scale, sample_fraction) for i, m, w in order
    )
    parts = sorted(parts, key=lambda p: p.summary["experiment_id"])
    steps = pd.concat([p.steps for p in parts], ignore_index=True)
    requests = pd.concat([p.requests for p in parts], ignore_index=True)
    _write_parquet(steps, out_dir / STEP_TRACES_FILE, ("step.id", "step.ts_start_ns", "step.ts_end_ns"))
    _write_parquet(
        requests, out_dir / STEP_REQUESTS_FILE, ("step.id", "progress", "new_tokens", "input_len", "output_len")
    )
    elapsed = time.perf_counter() - t0

    pairs = sum(p.summary["cycle_pairs"] for p in parts)
    ape_sum = sum(p.summary.pop("oracle_ape_sum") for p in parts)
    sim_seconds = {p.summary["experiment_id"]: p.summary.pop("simulate_s") for p in parts}  # not stored: varies
    metadata = {
        "generator": "fitness.emulator",
        "generator_version": GENERATOR_VERSION,
        "seed": int(seed),
        "sources_sha256": sources_fingerprint(),
        "command": f"python -m fitness.emulator --out <dir> --seed {seed}",
        "noise_sigma": physics.noise_sigma,
        "noise_floor_mape": ape_sum / pairs if pairs else None,
        "noise_floor_mape_expected": expected_noise_floor_mape(physics.noise_sigma),
        "noise_floor_note": (
            "step MAPE of an oracle that knows the noiseless hidden physics, over every "
            "cycle-time target (consecutive sampled step ids) of the shipped data; no step-time "
            "model can expect to beat it"
        ),
        "sample_fraction": sample_fraction,
        "duration_scale": duration_scale,
        "gpu": "H100 SXM",
        "physics": asdict(physics),
        "server_overheads": {name: getattr(SERVER_OVERHEADS, name) for name in SIMULATED_NON_STEP_NAMES},
        "files": {
            STEP_TRACES_FILE: {
                "rows": int(len(steps)),
                "sha256_rows": frame_digest(steps),
                "bytes": (out_dir / STEP_TRACES_FILE).stat().st_size,
            },
            STEP_REQUESTS_FILE: {
                "rows": int(len(requests)),
                "sha256_rows": frame_digest(requests),
                "bytes": (out_dir / STEP_REQUESTS_FILE).stat().st_size,
            },
        },
        "cycle_pairs": int(pairs),
        "experiments": [p.summary for p in parts],
    }
    atomic_write_json(out_dir / METADATA_FILE, metadata, indent=1, sort_keys=False)
    if verbose:
        _print_report(metadata, elapsed, sim_seconds)
    metadata["_elapsed_s"] = elapsed
    return metadata


def _print_report(meta: dict, elapsed: float, sim_seconds: dict[str, float]) -> None:
    print(
        f"{'experiment':44s} {'steps':>7s} {'rows':>6s} {'pairs':>5s} {'cycle ms':>8s} {'decode':>6s} "
        f"{'oracle':>6s} {'ok/fail':>11s} {'preempt':>7s} {'sim s':>6s}"
    )
    for e in meta["experiments"]:
        cyc = e["mean_cycle_us"] / 1e3 if e["mean_cycle_us"] else float("nan")
        print(
            f"{e['experiment_id']:44s} {e['simulated_steps']:7d} {e['sampled_steps']:6d} {e['cycle_pairs']:5d} "
            f"{cyc:8.2f} {e['mean_decode_tokens'] or 0:6.1f} {100 * (e['oracle_mape'] or 0):5.2f}% "
            f"{e['successes']:5d}/{e['failures']:<5d} {e['preemptions']:7d} {sim_seconds[e['experiment_id']]:6.1f}"
        )
    f = meta["files"]
    print(
        f"rows: {f[STEP_TRACES_FILE]['rows']} steps ({f[STEP_TRACES_FILE]['bytes'] / 1e6:.2f} MB), "
        f"{f[STEP_REQUESTS_FILE]['rows']} request rows ({f[STEP_REQUESTS_FILE]['bytes'] / 1e6:.2f} MB); "
        f"{meta['cycle_pairs']} cycle pairs; noise floor MAPE {100 * meta['noise_floor_mape']:.2f}% "
        f"(sigma {meta['noise_sigma']}); {elapsed:.0f} s"
    )
