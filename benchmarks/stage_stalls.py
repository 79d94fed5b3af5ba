"""The longest pause each client saw, per load stage: where real servers stall.

    python benchmarks/stage_stalls.py [--experiments DIR]

Reads only the lifecycle files of the experiments with results (no model). For every load
stage: the longest gap between two streamed events of one request (``inter_token_latency``
``max``: a pause of the server while that request was running), how far the E2E's p99
and p99.9 lie above its median (a pause lengthens every request running through it), and
the TTFT's p99 and maximum. Then, per deployment, the longest gap of its first stages
against that of its later stages.

A pause of the whole server shows as a long gap in every request running through it, and
a run's later stages show none (docs/RESULTS.md, "Where real servers stall"). The
simulator has no such pause (a what-if: ``benchmarks/fresh_server.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evolve.cli_parser import OneLineParser  # noqa: E402
from evolve.report import short_experiment_name  # noqa: E402
from primitives import checks  # noqa: E402
from primitives.data.experiments import LATENCY_FILE_KEYS, find_experiments  # noqa: E402
from primitives.data.roots import shared_data_root  # noqa: E402
from primitives.errors import InputError  # noqa: E402
from primitives.files import read_mapping  # noqa: E402

NAME_WIDTH = 30
HEADER = (
    f"{'experiment':<{NAME_WIDTH}} {'stage':>5} {'gap s':>6} {'E2E p99':>8} {'p99.9':>6} {'TTFT p99':>9} {'max':>6}"
)


def stage_row(path: Path) -> dict[str, float] | None:
    """The pauses of one stage's lifecycle file, seconds; None where no request succeeded."""
    data = read_mapping(path, "json")  # unreadable or not JSON: one line naming the file
    latency = (data.get("successes") or {}).get("latency")
    if not latency:
        return None

    def stat(metric: str, key: str) -> float:
        field = f"successes.latency.{LATENCY_FILE_KEYS[metric]}"
        block = latency.get(LATENCY_FILE_KEYS[metric])
        if not isinstance(block, dict):
            raise InputError(path, field, "the client's percentiles of this latency")
        return float(checks.number(block.get(key), path, f"{field}.{key}", allow_zero=True))

    median = stat("e2e", "median")
    return {
        "gap_s": stat("itl", "max"),
        "e2e_p99_over_s": stat("e2e", "p99") - median,
        "e2e_p999_over_s": stat("e2e", "p99.9") - median,
        "ttft_p99_s": stat("ttft", "p99"),
        "ttft_max_s": stat("ttft", "max"),
    }


def table(experiments_dir: Path) -> list[str]:
    """The stage table and the per-deployment summary, lines of at most 80 characters."""
    specs = [s for s in find_experiments(experiments_dir) if s.observed is not None]
    if not specs:
        raise InputError(experiments_dir, None, "experiments with results (results/*_lifecycle_metrics.json)")
    lines = [HEADER]
    by_deployment: dict[str, list[list[float]]] = {}
    for spec in specs:
        for k in range(len(spec.observed.stages)):  # a run may have a summary and no stage files
            row = stage_row(Path(spec.path) / "results" / f"stage_{k}_lifecycle_metrics.json")
            if row is None:
                continue
            name = short_experiment_name(spec.name)[:NAME_WIDTH]
            lines.append(
                f"{name:<{NAME_WIDTH}} {k:>5} {row['gap_s']:>6.3f} {row['e2e_p99_over_s']:>+8.2f} "
                f"{row['e2e_p999_over_s']:>+6.2f} {row['ttft_p99_s'] * 1e3:>7.0f}ms {row['ttft_max_s'] * 1e3:>4.0f}ms"
            )
            gaps = by_deployment.setdefault(f"{spec.model.split('/')[-1]} TP{spec.tp}", [[], []])
            gaps[0 if k == 0 else 1].append(row["gap_s"])
    lines += ["", "E2E columns: above the stage's median, s. Longest gap per deployment, s:"]
    lines.append(f"{'deployment':<34} {'first stages':>14} {'later stages':>14}")
    for deployment, (first, later) in sorted(by_deployment.items()):
        span = [f"{min(g):.3f}-{max(g):.3f}" if g else "—" for g in (first, later)]
        lines.append(f"{deployment[:34]:<34} {span[0]:>14} {span[1]:>14}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python benchmarks/stage_stalls.py", description=__doc__.splitlines()[0])
    default = shared_data_root() / "data" / "experiments"
    ap.add_argument("--experiments", type=Path, default=default, metavar="DIR", help="default: the shared folder's")
    args = ap.parse_args(argv)
    try:
        lines = table(args.experiments)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
