"""How the TTFT's body grows with load, observed against simulated, per load stage.

    python benchmarks/ttft_load.py VALIDATION.json [MORE.json ...]

Reads what ``python -m evolve validate ID --json F`` wrote. For every load stage of every
experiment with results: the requests running on average (Little's law on the observed
run: rate times the mean E2E), the observed median TTFT, and how far the simulation's
median and mean TTFT lie below the observation (ms; > 0: simulated too fast). Then the
least-squares line of the medians' gap against the running requests, and its correlation.

A queueing time that ignores the load leaves a gap that grows with the running requests
(µs per request > 0); ``queueing_per_running_request_us`` is the term that takes it up
(docs/HOW_IT_WORKS.md, "Non-step terms"). Medians, because a mean also carries the queue's tail.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evolve.cli_parser import OneLineParser  # noqa: E402
from evolve.report import short_experiment_name  # noqa: E402

STAGE_FIELDS = (
    "rate_per_s",
    "e2e_mean_obs_s",
    "ttft_p50_obs_s",
    "ttft_p50_pred_s",
    "ttft_mean_obs_s",
    "ttft_mean_pred_s",
)
NAME_WIDTH = 34


class BadInput(Exception):
    """One line: which file, which field, what was expected."""


def stage_rows(path: Path) -> tuple[str, list[dict]]:
    """(the entry id, one row per load stage with observed and simulated TTFT) of one validation JSON."""
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise BadInput(f"{path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise BadInput(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None
    experiments = data.get("experiments") if isinstance(data, dict) else None
    if not isinstance(experiments, list):
        raise BadInput(f"{path}: experiments: expected the list `validate --json` writes")
    rows = []
    for i, exp in enumerate(experiments):
        for k, stage in enumerate(exp.get("stages") or []):
            if stage.get("ttft_p50_obs_s") is None:  # a run without results (withheld)
                continue
            values = {}
            for field in STAGE_FIELDS:
                v = stage.get(field)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
                    raise BadInput(f"{path}: experiments[{i}].stages[{k}].{field}: expected a number, got {v!r}")
                values[field] = float(v)
            name = short_experiment_name(str(exp.get("name", f"experiment {i}")))
            running = values["rate_per_s"] * values["e2e_mean_obs_s"]  # Little's law on the observed run
            rows.append({"name": name, "stage": k, "running": running, **values})
    if not rows:
        raise BadInput(f"{path}: experiments: no load stage with observed results")
    return str(data.get("id", "?")), rows


def gap_line(rows: list[dict]) -> tuple[float, float, float]:
    """(intercept ms, slope µs per running request, correlation) of the median TTFT's gap."""
    running = np.array([r["running"] for r in rows])
    gap_ms = np.array([1e3 * (r["ttft_p50_obs_s"] - r["ttft_p50_pred_s"]) for r in rows])
    if len(rows) < 3 or np.ptp(running) == 0:
        return float("nan"), float("nan"), float("nan")
    slope, intercept = np.polyfit(running, gap_ms, 1)
    return float(intercept), float(slope * 1e3), float(np.corrcoef(running, gap_ms)[0, 1])


def report(entry: str, rows: list[dict]) -> str:
    lines = [
        f"entry {entry}: TTFT observed minus simulated, per load stage (ms)",
        f"{'experiment':<{NAME_WIDTH}} {'stg':>3} {'req/s':>5} {'run':>5} {'p50':>6} {'gap':>5} {'mean':>6}",
    ]
    for r in rows:
        lines.append(
            f"{r['name'][:NAME_WIDTH]:<{NAME_WIDTH}} {r['stage']:>3} {r['rate_per_s']:>5.1f} {r['running']:>5.1f}"
            f" {1e3 * r['ttft_p50_obs_s']:>6.1f} {1e3 * (r['ttft_p50_obs_s'] - r['ttft_p50_pred_s']):>+5.1f}"
            f" {1e3 * (r['ttft_mean_obs_s'] - r['ttft_mean_pred_s']):>+6.1f}"
        )
    a, b, r = gap_line(rows)
    lines.append(f"median gap = {a:+.2f} ms {b:+.1f} us x running requests (r = {r:+.2f}, {len(rows)} stages)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python benchmarks/ttft_load.py", description=__doc__.splitlines()[0])
    ap.add_argument("validations", nargs="+", type=Path, help="JSON files written by `validate --json`")
    args = ap.parse_args(argv)
    try:
        reports = [report(*stage_rows(p)) for p in args.validations]
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n\n".join(reports))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
