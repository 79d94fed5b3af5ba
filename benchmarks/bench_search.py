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
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from primitives.data.roots import shared_data_root  # noqa: E402

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--default", action="store_true", help="the embedded dataset, no experiments")
    ap.add_argument("--data", default=str(shared_data_root() / "data" / "steps"))
    ap.add_argument("--experiments", default=str(shared_data_root() / "data" / "experiments"))
    ap.add_argument("--generations", type=int, default=60)
    ap.add_argument("--population", type=int, default=150)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "evolve", "run", "--generations", str(args.generations)]
        if not args.default:
            cmd += ["--data", args.data, "--experiments", args.experiments]
            cmd += ["--population", str(args.population), "--jobs", str(args.jobs), "--seed", str(args.seed)]
        cmd += ["--run-dir", str(Path(tmp) / "run")]
        print("$ " + " ".join(cmd[1:]), flush=True)
        stamped: list[tuple[float, str]] = []
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
