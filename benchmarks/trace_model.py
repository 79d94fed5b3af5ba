"""What the trace benchmarks share: their command line, the archived model they read, and its
price of every sampled step of the real traces."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from archive.rundir import RunDir  # noqa: E402
from archive.store import ArchiveStore  # noqa: E402
from evolve.cli_parser import OneLineParser, load_draws_arg  # noqa: E402
from fitness.dataset import build_step_table  # noqa: E402
from fitness.kv_sharing import run_seed, trace_kv_sharing  # noqa: E402
from primitives.data.roots import shared_data_root  # noqa: E402
from primitives.errors import InputError  # noqa: E402
from primitives.language import evaluate_expr, parse_infix  # noqa: E402


def model_parser(prog: str, doc: str, draws: int, required: bool = True) -> OneLineParser:
    """The command line of a benchmark that simulates an archived model against the traces. Not
    REQUIRED: the model is optional, and --draws without it reads None (the caller's default)."""
    ap = OneLineParser(prog=f"python benchmarks/{prog}", description=doc.splitlines()[0])
    ap.add_argument("--shared", type=Path, default=shared_data_root(), help="the shared folder (default ../shared)")
    with_other = ("", "") if required else (" (with --id)", " (with --run-dir)")
    ap.add_argument(
        "--run-dir", type=Path, required=required, help="run directory of the archived model" + with_other[0]
    )
    ap.add_argument("--id", required=required, help="archive entry id (or prefix)" + with_other[1])
    default = draws if required else None
    ap.add_argument("--draws", type=load_draws_arg, default=default, help=f"draws of the load (default {draws})")
    return ap


def archived_entry(run_dir: Path, entry_id: str):
    """The archive entry ENTRY_ID (or prefix) of the run in RUN_DIR; InputError where there is none."""
    archive = RunDir(run_dir).archive
    if not archive.is_file():
        raise InputError(archive, None, "no archive there (--run-dir)")
    with ArchiveStore(archive, create=False, read_only=True) as store:
        return store.get(entry_id)


def trace_prices_us(data, resolver, entry, experiments: Path | None) -> np.ndarray:
    """ENTRY's step time (µs) of every sampled step of DATA, in its order; a block-counted trace's
    KV scaled to the per-request sum as the entry's run measured it where EXPERIMENTS has its
    experiment folder (``fitness.kv_sharing``)."""
    sharing = trace_kv_sharing(data, experiments, resolver, run_seed(entry.run_config)) if experiments else None
    table = build_step_table(data, resolver, validation_fraction=0, kv_sharing=sharing, every_step=True)
    return np.asarray(evaluate_expr(parse_infix(entry.expression), table.columns, table.n), dtype=np.float64)


if __name__ == "__main__":
    print(
        "error: trace_model.py holds what trace_checks.py, knee_whatif.py and fresh_server.py share; run those",
        file=sys.stderr,
    )
    raise SystemExit(2)
