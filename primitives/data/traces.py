"""Step traces in one canonical form: steps with cycle-time targets.

Reads vLLM step-tracing exports in the flat schema of
``shared/data/steps/step_traces.parquet`` (Parquet or CSV). The target of step ``i`` is
its **cycle time**, ``ts_start[i+1] - ts_start[i]`` for two consecutive sampled step
ids; ``step.duration_us`` is scheduler CPU time and is never a target. Real traces
carry batch aggregates only; a sibling ``step_requests.parquet`` (``synthetic_step_requests.parquet`` from the
synthetic emulator) adds per-request detail, which unlocks the per-request features.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from primitives import checks
from primitives.deployment import KV_BLOCK_TOKENS
from primitives.errors import InputError
from primitives.files import require_regular_input
from primitives.registry import AGGREGATE_FEATURES, ALL_FEATURES

# the vLLM tracer's export names, then the embedded synthetic data's (named apart so it is
# never mistaken for real shared data)
STEP_FILE_NAMES = ("step_traces.parquet", "step_traces.csv", "synthetic_step_traces.parquet")
REQUEST_FILE_NAMES = ("step_requests.parquet", "step_requests.csv", "synthetic_step_requests.parquet")

# flat trace column -> what it must hold
REQUIRED_COLUMNS = {
    "experiment_id": "an experiment name",
    "model": "a model name such as llama-2-70b",
    "tp": "the tensor-parallel degree (integer >= 1)",
    "step.id": "the integer step id",
    "step.ts_start_ns": "the step start timestamp in ns",
    "batch.prefill_tokens": "a non-negative token count",
    "batch.decode_tokens": "a non-negative token count",
    "batch.num_prefill_reqs": "a non-negative request count",
    "batch.num_decode_reqs": "a non-negative request count",
    "kv.blocks_total_gpu": "a non-negative KV block count",
    "kv.blocks_free_gpu": "a non-negative KV block count",
}
NUMERIC_COLUMNS = [c for c in REQUIRED_COLUMNS if c not in ("experiment_id", "model")]
# ids, degrees and counts (tokens, requests, KV blocks) are whole numbers: a fractional one
# would be silently truncated, or priced as work no step does
INTEGER_COLUMNS = frozenset(
    {
        "step.id",
        "tp",
        "batch.prefill_tokens",
        "batch.decode_tokens",
        "batch.num_prefill_reqs",
        "batch.num_decode_reqs",
        "kv.blocks_total_gpu",
        "kv.blocks_free_gpu",
        "progress",
        "new_tokens",
        "input_len",
        "output_len",
    }
)
# physical sanity bounds of a column (checks' limits; ids and ns timestamps exact in a float64)
COLUMN_UPPER = {
    "tp": checks.MAX_TP,
    "step.id": 2.0**53,
    "step.ts_start_ns": 2.0**62,
    "batch.prefill_tokens": checks.MAX_STEP_TOKENS,
    "batch.decode_tokens": checks.MAX_STEP_TOKENS,
    "batch.num_prefill_reqs": checks.MAX_REQUESTS,
    "batch.num_decode_reqs": checks.MAX_REQUESTS,
    "kv.blocks_total_gpu": checks.MAX_STEP_TOKENS,
    "kv.blocks_free_gpu": checks.MAX_STEP_TOKENS,
    "step.duration_us": checks.MAX_DURATION_S * 1e6,
    "progress": checks.MAX_TOKENS,
    "new_tokens": checks.MAX_TOKENS,
    "input_len": checks.MAX_TOKENS,
    "output_len": checks.MAX_TOKENS,
}
REQUEST_COLUMNS = ("experiment_id", "step.id", "progress", "new_tokens", "input_len", "output_len")

# optional columns kept where a trace has them (NaN where a value is not a count): requests
# holding a slot, and queued, after scheduling; requests reported finished since the last step
QUEUE_MAP = {
    "queue.running_depth": "running_depth",
    "queue.waiting_depth": "waiting_depth",
    "batch.num_finished": "num_finished",
}
# canonical step columns (aggregate features keep their registry names)
AGGREGATE_MAP = {
    "batch.prefill_tokens": "prefill_tokens",
    "batch.decode_tokens": "decode_tokens",
    "batch.num_prefill_reqs": "num_prefill_reqs",
    "batch.num_decode_reqs": "num_decode_reqs",
}


@dataclass
class StepData:
    """Sampled steps with cycle-time targets, from one or more trace files.

    ``steps`` has one row per sampled step: experiment, model, tp, gpu, step_id,
    ts_start_us, cycle_time_us (NaN where the next step was not sampled) and the
    aggregate features; ``running_depth``, ``waiting_depth`` and ``num_finished`` too where
    the trace has them (``QUEUE_MAP``).
    ``requests`` (optional) has one row per request in a step: step_row (row index into
    ``steps``), progress, new_tokens, input_len, output_len.
    """

    steps: pd.DataFrame
    requests: pd.DataFrame | None = None
    sources: list[str] = field(default_factory=list)

    @property
    def available_features(self) -> frozenset[str]:
        """Features every step of this dataset supports."""
        return ALL_FEATURES if self.requests is not None else AGGREGATE_FEATURES

    @property
    def experiments(self) -> list[str]:
        return sorted(self.steps["experiment"].unique())

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        cols = ["experiment", "model", "tp", "step_id", "ts_start_us", "kv_tokens", *AGGREGATE_MAP.values()]
        h.update(pd.util.hash_pandas_object(self.steps[cols], index=False).values.tobytes())
        if self.requests is not None:
            h.update(pd.util.hash_pandas_object(self.requests, index=False).values.tobytes())
        return h.hexdigest()[:16]


def _read_table(path: Path) -> pd.DataFrame:
    require_regular_input(path)
    try:
        if path.stat().st_size == 0:
            raise InputError(path, None, "the file is empty; expected a step-trace table")
        if path.suffix == ".parquet":
            return pd.read_parquet(path)
        if path.suffix == ".csv":
            return pd.read_csv(path)
    except InputError:
        raise
    except OSError as exc:
        raise InputError(path, None, f"cannot read file ({exc.strerror})") from None
    except Exception as exc:  # pyarrow/pandas parse errors carry long messages
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if len(first) > 120:  # cut at a sentence's end, not in the middle of one
            end = first.rfind(". ", 0, 120)
            first = first[: end + 1] if end >= 40 else first[:117] + "..."
        raise InputError(path, None, f"not a readable {path.suffix[1:]} table ({first})") from None
    raise InputError(path, None, "unsupported file type; expected a .parquet or .csv file, or a folder holding one")


def _numeric(df: pd.DataFrame, col: str, path: Path, expected: str) -> np.ndarray:
    raw = df[col]
    if pd.api.types.is_bool_dtype(raw):  # to_numeric takes True for 1: a TP of True is no TP
        raise InputError(path, col, f"a column of true/false values; expected {expected}")
    values = pd.to_numeric(raw, errors="coerce")
    bad = values.isna() & raw.notna()
    if bad.any():
        row = int(np.flatnonzero(bad.to_numpy())[0])
        raise InputError(path, col, f"non-numeric value {raw.iloc[row]!r} in row {row}; expected {expected}")
    if values.isna().any():
        row = int(np.flatnonzero(values.isna().to_numpy())[0])
        raise InputError(path, col, f"missing value (NaN) in row {row}; expected {expected}")
    arr = values.to_numpy(dtype=np.float64)
    if not np.isfinite(arr).all():
        row = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise InputError(path, col, f"non-finite value {arr[row]:g} in row {row}; expected {expected}")
    if (arr < 0).any():
        row = int(np.flatnonzero(arr < 0)[0])
        raise InputError(path, col, f"negative value {arr[row]:g} in row {row}; expected {expected}")
    if col in INTEGER_COLUMNS and (arr != np.floor(arr)).any():
        row = int(np.flatnonzero(arr != np.floor(arr))[0])
        raise InputError(path, col, f"non-integer value {arr[row]:g} in row {row}; expected {expected}")
    upper = COLUMN_UPPER.get(col)
    if upper is not None and (arr > upper).any():
        row = int(np.flatnonzero(arr > upper)[0])
        raise InputError(
            path, col, f"value {arr[row]:g} in row {row} is beyond any real run; expected at most {upper:g}"
        )
    return arr


def _request_counts(column: pd.Series) -> np.ndarray:
    """An optional count column as floats, NaN where a value is not a whole number >= 0
    (booleans and times are not counts)."""
    types = pd.api.types
    if types.is_bool_dtype(column) or types.is_datetime64_any_dtype(column) or types.is_timedelta64_dtype(column):
        return np.full(len(column), np.nan)
    if types.is_object_dtype(column):  # a mixed column: its booleans and times are no counts either
        number = (int, float, str, np.integer, np.floating)
        column = column.map(lambda v: v if isinstance(v, number) and not isinstance(v, bool) else None)
    values = pd.to_numeric(column, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    ok = np.isfinite(values) & (values >= 0) & (values == np.floor(values))
    return np.where(ok, values, np.nan)


def step_table_path(path: Path) -> Path:
    """The step table PATH names: the file itself, or a folder's ``STEP_FILE_NAMES`` table,
    or else the folder's one table under another name (``held_out_steps.parquet``)."""
    path = Path(path)
    if not path.is_dir():
        return path
    steps = next((path / n for n in STEP_FILE_NAMES if (path / n).exists()), None)
    if steps is not None:
        return steps
    tables = sorted(
        f.name
        for f in path.iterdir()
        if f.suffix in (".parquet", ".csv") and f.name not in REQUEST_FILE_NAMES and not f.name.startswith(".")
    )
    if len(tables) != 1:
        found = f"; found {len(tables)} tables ({', '.join(tables[:3])}): name the file" if tables else ""
        raise InputError(
            path, None, f"no step trace here; expected one of {', '.join(STEP_FILE_NAMES)}, or one table{found}"
        )
    return path / tables[0]


def _resolve_files(path: Path) -> tuple[Path, Path | None]:
    """The step table and its per-request detail: the detail beside a table of a standard name
    only (``DIR`` and ``DIR/held_out_steps.parquet`` read the same data)."""
    path = Path(path)
    if not path.exists():
        raise InputError(path, None, "no such file or directory")
    steps = step_table_path(path)
    sibling = next((steps.parent / n for n in REQUEST_FILE_NAMES if (steps.parent / n).exists()), None)
    return steps, sibling if steps.name in STEP_FILE_NAMES else None


def load_trace(path: Path | str) -> StepData:
    """Load one trace file (or a directory holding step_traces.parquet)."""
    step_path, req_path = _resolve_files(Path(path))
    df = _read_table(step_path)
    if len(df) == 0:
        raise InputError(step_path, None, "the table has no rows; expected sampled steps")
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        c = missing[0]
        raise InputError(step_path, c, f"missing column; expected {REQUIRED_COLUMNS[c]}")
    num = {c: _numeric(df, c, step_path, REQUIRED_COLUMNS[c]) for c in NUMERIC_COLUMNS}
    for c in ("experiment_id", "model"):
        if df[c].isna().any():
            row = int(np.flatnonzero(df[c].isna().to_numpy())[0])
            raise InputError(step_path, c, f"missing value in row {row}; expected {REQUIRED_COLUMNS[c]}")
    if (num["tp"] < 1).any():
        raise InputError(step_path, "tp", "expected a tensor-parallel degree >= 1")
    _one_deployment_per_experiment(df, num["tp"], step_path)
    if (num["kv.blocks_free_gpu"] > num["kv.blocks_total_gpu"]).any():
        raise InputError(step_path, "kv.blocks_free_gpu", "more free blocks than kv.blocks_total_gpu")
    if "step.duration_us" in df.columns:
        dur = _numeric(df, "step.duration_us", step_path, "a positive scheduler duration in µs")
        if (dur <= 0).any():
            row = int(np.flatnonzero(dur <= 0)[0])
            raise InputError(step_path, "step.duration_us", f"non-positive duration {dur[row]:g} in row {row}")

    steps = pd.DataFrame(
        {
            "experiment": df["experiment_id"].astype(str).to_numpy(),
            "model": df["model"].astype(str).to_numpy(),
            "tp": num["tp"].astype(np.int64),
            "gpu": df["gpu"].astype(str).to_numpy() if "gpu" in df.columns else "",
            "step_id": num["step.id"].astype(np.int64),
            "ts_start_us": num["step.ts_start_ns"] / 1000.0,
            "kv_tokens": (num["kv.blocks_total_gpu"] - num["kv.blocks_free_gpu"]) * KV_BLOCK_TOKENS,
        }
    )
    for src, dst in AGGREGATE_MAP.items():
        steps[dst] = num[src]
    for src, dst in QUEUE_MAP.items():  # optional, informative only: a bad value is NaN, never an error
        if src in df.columns:
            steps[dst] = _request_counts(df[src])
    steps["source_row"] = np.arange(len(df))
    steps = steps.sort_values(["experiment", "step_id"], kind="stable").reset_index(drop=True)

    exp = steps["experiment"].to_numpy()
    same = exp[1:] == exp[:-1]
    dup = same & (np.diff(steps["step_id"].to_numpy()) == 0)
    if dup.any():
        row = int(steps["source_row"].iloc[int(np.flatnonzero(dup)[0]) + 1])
        raise InputError(step_path, "step.id", f"duplicate step id in row {row}; expected unique ids per experiment")
    dt = np.diff(steps["ts_start_us"].to_numpy())
    backwards = same & (dt <= 0)
    if backwards.any():
        row = int(steps["source_row"].iloc[int(np.flatnonzero(backwards)[0]) + 1])
        raise InputError(
            step_path,
            "step.ts_start_ns",
            f"timestamp does not increase with step.id at row {row}; expected monotonic time",
        )
    consecutive = same & (np.diff(steps["step_id"].to_numpy()) == 1)
    cycle = np.full(len(steps), np.nan)
    cycle[:-1][consecutive] = dt[consecutive]
    steps["cycle_time_us"] = cycle
    for name, g in steps.groupby("experiment", sort=True):
        if not np.isfinite(g["cycle_time_us"]).any():
            raise InputError(
                step_path,
                "step.id",
                f"experiment {name!r} has no two consecutive sampled step ids, so no cycle-time targets",
            )

    requests = _load_requests(req_path, steps) if req_path is not None else None
    return StepData(steps=steps.drop(columns=["source_row"]), requests=requests, sources=[str(step_path)])


def _one_deployment_per_experiment(df: pd.DataFrame, tp: np.ndarray, path: Path) -> None:
    """An experiment ran one model at one TP: rows that disagree are a merged or corrupted trace."""
    ids = pd.DataFrame({"e": df["experiment_id"].astype(str), "model": df["model"].astype(str), "tp": tp})
    for col in ("model", "tp"):
        counts = ids.groupby("e", sort=True)[col].nunique()
        if (counts > 1).any():
            name = counts.index[int(np.flatnonzero(counts.to_numpy() > 1)[0])]
            seen = sorted(str(v) for v in ids.loc[ids["e"] == name, col].unique())[:3]
            raise InputError(
                path, col, f"experiment {name!r} has rows with {', '.join(seen)}; expected one per experiment"
            )


def _load_requests(path: Path, steps: pd.DataFrame) -> pd.DataFrame:
    df = _read_table(path)
    if len(df) == 0:  # per-request mode with no data would switch on features it cannot compute
        raise InputError(path, None, "the table has no rows; expected the requests of every step (or no such file)")
    missing = [c for c in REQUEST_COLUMNS if c not in df.columns]
    if missing:
        raise InputError(path, missing[0], "missing column of the per-request detail")
    cols = {c: _numeric(df, c, path, "a non-negative integer") for c in REQUEST_COLUMNS[1:]}
    key = pd.MultiIndex.from_arrays([steps["experiment"], steps["step_id"]])
    rows = key.get_indexer(
        pd.MultiIndex.from_arrays([df["experiment_id"].astype(str), cols["step.id"].astype(np.int64)])
    )
    if (rows < 0).any():
        row = int(np.flatnonzero(rows < 0)[0])
        raise InputError(path, "step.id", f"row {row} names a step that is not in the step trace")
    out = pd.DataFrame({"step_row": rows.astype(np.int64)})
    for c in ("progress", "new_tokens", "input_len", "output_len"):
        out[c] = cols[c]
    _requests_match_steps(out, steps, path)
    return out.sort_values("step_row", kind="stable").reset_index(drop=True)


def _requests_match_steps(reqs: pd.DataFrame, steps: pd.DataFrame, path: Path) -> None:
    """Every step's request rows: as many as its batch has requests, their new tokens its tokens."""
    n = len(steps)
    count = np.bincount(reqs["step_row"].to_numpy(), minlength=n)
    tokens = np.bincount(reqs["step_row"].to_numpy(), weights=reqs["new_tokens"].to_numpy(), minlength=n)
    for got, want, what in (
        (count, steps["num_prefill_reqs"].to_numpy() + steps["num_decode_reqs"].to_numpy(), "requests"),
        (tokens, steps["prefill_tokens"].to_numpy() + steps["decode_tokens"].to_numpy(), "new tokens"),
    ):
        bad = np.flatnonzero(got != want)
        if len(bad):
            i = int(bad[0])
            raise InputError(
                path,
                "step.id",
                f"experiment {steps['experiment'].iloc[i]!r} step {int(steps['step_id'].iloc[i])} has {got[i]:g} "
                f"{what} here but {want[i]:g} in the step trace; expected the same",
            )


def load_steps(paths: list[Path | str]) -> StepData:
    """Load and concatenate several traces; per-request detail only if all have it."""
    parts = [load_trace(p) for p in paths]
    if len(parts) == 1:
        return parts[0]
    offset = 0
    steps, reqs = [], []
    for p in parts:
        steps.append(p.steps)
        if p.requests is not None:
            r = p.requests.copy()
            r["step_row"] += offset
            reqs.append(r)
        offset += len(p.steps)
    all_steps = pd.concat(steps, ignore_index=True)
    if all_steps.duplicated(["experiment", "step_id"]).any():
        dup = all_steps[all_steps.duplicated(["experiment", "step_id"])]["experiment"].iloc[0]
        raise InputError(", ".join(str(p) for p in paths), "experiment_id", f"experiment {dup!r} appears in two inputs")
    requests = pd.concat(reqs, ignore_index=True) if len(reqs) == len(parts) else None
    return StepData(steps=all_steps, requests=requests, sources=[s for p in parts for s in p.sources])
