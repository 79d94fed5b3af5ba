"""Wall time of the README's replay command, end to end, and where it went.

    python benchmarks/bench_search.py [--generations 60] [--population 150] [--jobs 2] [--seed 0]
    python benchmarks/bench_search.py --default --generations 200      # the embedded-data run

Runs ``python -m evolve run`` in a subprocess (into a temporary run directory), stamps
each line it prints with the time it arrived, and splits the wall time into the run's
phases: start-up (data, primitive columns, probes), trajectory recording and calibration,
the search's generations, the trajectory refreshes inside the search, and the closed-loop
checks of the front. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evolve.cli_parser import OneLineParser, positive_int, seed_arg  # noqa: E402
from primitives.data.roots import shared_data_root  # noqa: E402
from primitives.errors import InputError  # noqa: E402

# the line that opens each phase (the run's own log lines); a phase lasts until the next one opens
PHASES = [
    ("recording and calibration", re.compile(r"^recording reference trajectories")),
    ("search", re.compile(r"^search: \d+ generations")),
    ("refresh", re.compile(r"refreshing trajectories with the current best model")),
    ("search", re.compile(r"^gen \d+/\d+")),
    ("closed-loop checks", re.compile(r"^closed-loop check of")),
    ("summary", re.compile(r"^search finished")),
]


def split_phases(stamped: list[tuple[float, str]], total_s: float) -> dict[str, float]:
    """Seconds per phase from (seconds since start, line) pairs."""
    spent: dict[str, float] = {}
    phase, since = "start-up", 0.0
    for t, line in stamped:
        for name, pattern in PHASES:
            if pattern.search(line):
                if name != phase:
                    spent[phase] = spent.get(phase, 0.0) + t - since
                    phase, since = name, t
                break
    spent[phase] = spent.get(phase, 0.0) + total_s - since
    return spent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = OneLineParser(prog="python benchmarks/bench_search.py", description=__doc__.splitlines()[0])
    ap.add_argument("--default", action="store_true", help="the embedded dataset, no experiments")
    ap.add_argument("--data", metavar="PATH", help="step traces (default: the shared folder's data/steps)")
    ap.add_argument("--experiments", metavar="DIR", help="experiments (default: the shared folder's)")
    ap.add_argument("--generations", type=positive_int, default=60, metavar="N")
    ap.add_argument("--population", type=positive_int, default=150, metavar="P")
    ap.add_argument("--jobs", type=positive_int, default=2, metavar="J")
    ap.add_argument("--seed", type=seed_arg, default=0, metavar="S")
    args = ap.parse_args(argv)
    if args.default and (args.data or args.experiments):
        ap.error("--default runs on the embedded data: give --data and --experiments without it")
    if not args.default:
        args.data = args.data or str(shared_data_root() / "data" / "steps")
        args.experiments = args.experiments or str(shared_data_root() / "data" / "experiments")
    return args


def search_command(args: argparse.Namespace, workdir: Path) -> tuple[list[str], Path]:
    """The ``python -m evolve run`` timed and the folder it runs in: WORKDIR (a temporary one), so
    its runs/ and runs/LATEST land there, never in the checkout's or the caller's. The paths given
    are the caller's: resolved against the current directory, not the checkout or WORKDIR."""
    cmd = [sys.executable, "-m", "evolve", "run", "--generations", str(args.generations)]
    if not args.default:
        cmd += ["--data", str(Path(args.data).absolute()), "--experiments", str(Path(args.experiments).absolute())]
        cmd += ["--population", str(args.population), "--jobs", str(args.jobs), "--seed", str(args.seed)]
    cmd += ["--run-dir", str(workdir / "run")]
    return cmd, workdir


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.default:  # the inputs, checked before the long run
        from evolve.cli_files import must_exist

        try:
            must_exist(args.data, "--data")
            must_exist(args.experiments, "--experiments", "dir")
        except InputError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory(prefix="bench-search-") as tmp:
        cmd, cwd = search_command(args, Path(tmp))
        print("$ " + " ".join(cmd[1:]), flush=True)
        stamped: list[tuple[float, str]] = []
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for raw in proc.stdout:
            for line in raw.replace("\r", "\n").splitlines():
                if line.strip():
                    stamped.append((time.perf_counter() - t0, line.strip()))
        rc = proc.wait()
        total = time.perf_counter() - t0
    if rc != 0:
        print("\n".join(line for _, line in stamped[-20:]), file=sys.stderr)
        print(f"the run failed (exit {rc})", file=sys.stderr)
        return rc
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"wall time {total:.1f} s ({total / 60:.2f} min); CPU of the run and its workers {cpu.ru_utime:.1f} s")
    for name, seconds in sorted(split_phases(stamped, total).items(), key=lambda it: -it[1]):
        print(f"  {name:28s} {seconds:8.1f} s  {100 * seconds / total:5.1f}%")
    best = [line for _, line in stamped if line.startswith("* ")]
    if best:
        print("recommended: " + best[-1][:76])
    return 0


if __name__ == "__main__":
    sys.exit(main())
