"""This project's front against two symbolic-regression peers, on the same budget.

Task: predict the cycle time of a vLLM step (``ts_start[i+1] - ts_start[i]``) from the
real step traces in ``$STEPSYNTH_SHARED/data/steps`` (two experiments). Every system
gets the same columns (the primitives that batch aggregates support,
``supported_primitives(AGGREGATE_FEATURES)``), fits on the training rows only (the
first 80% of each experiment in time, ``fitness.dataset.build_step_table``), and is
judged on the held-out last 20% of each experiment: per-step MAPE, mean over the
experiments.

Systems (same wall-clock budget, same number of cores):

* stepsynth: ``python -m evolve run --data ... --time-limit B --jobs J --generations 100000
  --seed S`` then ``archive list --json``: the archived Pareto front.
* pyoperon: ``pyoperon.sklearn.SymbolicRegressor``, NSGA-II on (R², length),
  ``max_time=B``, ``n_threads=J``: its ``pareto_front_``.
* gplearn: ``gplearn.genetic.SymbolicRegressor`` with parsimony pressure, ``n_jobs=J``,
  fitted on ``y / mean(y_train)`` with a MAPE fitness; gplearn has no time limit, so
  generations are added one at a time (``warm_start``) while the budget lasts. Its
  front: the non-dominated (training MAPE, complexity) programs of every generation.

Complexity is counted the same way for all three, on the final formula as printed
(``complexity_of``): one node per variable, constant and operator application; n-ary
max/min count as nested binary ones; a protected unary function (sqrt(|x|), log(1+x),
log(1+|x|): the project's psqrt/plog, gplearn's sqrt/log, Operon's sqrtabs/log1p) is
one node. Coefficients and intercepts are constants, so a fitted term ``c*x`` is 3.

Usage::

    python benchmarks/peers.py                      # 120 s per system on 2 cores
    python benchmarks/peers.py --budget 20 --systems stepsynth,gplearn
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evolve.cli_parser import OneLineParser, positive_float, positive_int, seed_arg  # noqa: E402
from primitives.data.roots import shared_data_root  # noqa: E402
from primitives.errors import InputError  # noqa: E402

if TYPE_CHECKING:
    from fitness.dataset import StepTable

COMPLEXITY_CAPS = (10, 20, 40)
HV_COMPLEXITY_SCALE = 40.0
HV_REFERENCE = (1.0, 1.0)
SYSTEMS = ("stepsynth", "pyoperon", "gplearn")


# --- data ---------------------------------------------------------------------------
def shared_steps() -> Path:
    """The shared step traces' folder; InputError where it holds none."""
    data_dir = shared_data_root() / "data" / "steps"
    if not (data_dir / "step_traces.parquet").is_file():
        raise InputError(data_dir, None, "no shared step traces (step_traces.parquet) here; set STEPSYNTH_SHARED")
    return data_dir


def load_table() -> tuple[StepTable, Path]:
    data_dir = shared_steps()
    from fitness.dataset import build_step_table
    from primitives.data.traces import load_steps
    from primitives.deployment import default_resolver
    from primitives.registry import AGGREGATE_FEATURES, supported_primitives

    data = load_steps([data_dir])
    names = supported_primitives(data.available_features)
    assert set(names) == set(supported_primitives(AGGREGATE_FEATURES))  # real traces: aggregates only
    return build_step_table(data, default_resolver(), names, validation_fraction=0.2), data_dir


def design(table: StepTable) -> np.ndarray:
    return np.column_stack([table.columns[n] for n in table.primitive_names])


def mape_by_split(table: StepTable, pred: np.ndarray) -> tuple[float, float]:
    """(training MAPE, held-out MAPE), each the mean over experiments of the per-step MAPE."""
    pred = np.asarray(pred, dtype=np.float64)
    if pred.shape != table.cycle_time_us.shape or not np.isfinite(pred).all():
        return float("inf"), float("inf")
    ape = np.abs(pred - table.cycle_time_us) / table.cycle_time_us
    out = []
    for rows in (table.is_train, ~table.is_train):
        per_exp = [ape[rows & (table.experiment == e)].mean() for e in range(len(table.experiment_names))]
        out.append(float(np.mean(per_exp)))
    return out[0], out[1]


# --- complexity ---------------------------------------------------------------------
_PROTECTED_SQRT = {"sqrt"}
_LOG = {"log"}
_ABS = {"abs"}
_NARY = {"max", "min", "fmax", "fmin"}


def _is_one(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and float(node.value) == 1.0


def _unwrap_abs(node: ast.AST) -> ast.AST:
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id.lower() in _ABS
        and len(node.args) == 1
    ):
        return node.args[0]
    return node


def _count(node: ast.AST) -> int:
    if isinstance(node, (ast.Constant, ast.Name)):
        return 1
    if isinstance(node, ast.UnaryOp):
        if isinstance(node.operand, ast.Constant):  # a negative constant is one constant
            return 1
        return 1 + _count(node.operand)
    if isinstance(node, ast.BinOp):
        return 1 + _count(node.left) + _count(node.right)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        name = node.func.id.lower()
        args = node.args
        if name in _PROTECTED_SQRT and len(args) == 1:  # sqrt(|x|) is one protected node
            return 1 + _count(_unwrap_abs(args[0]))
        if name in _LOG and len(args) == 1:  # log(1 + |x|), log(x + 1): one node (plog / log1p)
            a = args[0]
            if isinstance(a, ast.BinOp) and isinstance(a.op, ast.Add) and (_is_one(a.left) or _is_one(a.right)):
                inner = a.right if _is_one(a.left) else a.left
                return 1 + _count(_unwrap_abs(inner))
            return 1 + _count(_unwrap_abs(a))
        if name in _NARY:
            return max(len(args) - 1, 1) + sum(_count(a) for a in args)
        return 1 + sum(_count(a) for a in args)
    raise ValueError(f"unexpected syntax in expression: {ast.dump(node)[:80]}")


def complexity_of(text: str) -> int:
    """Node count of a printed formula (infix with calls, or gplearn's prefix calls)."""
    return _count(ast.parse(text.replace("^", "**"), mode="eval").body)


# --- fronts and hypervolume -----------------------------------------------------------
def non_dominated(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates (minimising both coordinates)."""
    keep = []
    for i, (a, b) in enumerate(points):
        if not any((c <= a and d <= b) and (c < a or d < b) for j, (c, d) in enumerate(points) if j != i):
            keep.append(i)
    return keep


def hypervolume_2d(points: list[tuple[float, float]], ref: tuple[float, float] = HV_REFERENCE) -> float:
    """Area dominated by the points and bounded by ``ref`` (both objectives minimised)."""
    pts = sorted((x, y) for x, y in points if x < ref[0] and y < ref[1])
    # slabs between consecutive x: each as high as the lowest y seen so far
    area, best_y = 0.0, ref[1]
    xs = [x for x, _ in pts] + [ref[0]]
    for i, (x, y) in enumerate(pts):
        best_y = min(best_y, y)
        area += (xs[i + 1] - x) * (ref[1] - best_y)
    return area


def summarise(name: str, models: list[dict], wall_s: float, note: str = "") -> dict:
    """models: dicts with expression, complexity, train_mape, test_mape."""
    models = [m for m in models if np.isfinite(m["train_mape"]) and np.isfinite(m["test_mape"])]
    row = {"system": name, "front_size": len(models), "wall_s": wall_s, "note": note}
    for cap in COMPLEXITY_CAPS:
        pool = [m for m in models if m["complexity"] <= cap]
        best = min(pool, key=lambda m: (m["train_mape"], m["complexity"])) if pool else None
        row[f"test_mape_le{cap}"] = best["test_mape"] if best else None
        row[f"model_le{cap}"] = best
    pts = [(m["test_mape"], m["complexity"] / HV_COMPLEXITY_SCALE) for m in models]
    row["hypervolume"] = hypervolume_2d(pts)
    try:
        import moocore

        inside = np.array([p for p in pts if p[0] < HV_REFERENCE[0] and p[1] < HV_REFERENCE[1]])
        row["hypervolume_moocore"] = float(moocore.hypervolume(inside, ref=list(HV_REFERENCE))) if len(inside) else 0.0
    except ImportError:
        row["hypervolume_moocore"] = None
    row["models"] = sorted(models, key=lambda m: (m["complexity"], m["train_mape"]))
    return row


# --- systems --------------------------------------------------------------------------
def run_stepsynth(table: StepTable, data_dir: Path, budget_s: float, jobs: int, seed: int, workdir: Path) -> dict:
    from primitives.language import evaluate_expr, parse_infix

    run_dir = workdir / "stepsynth-run"
    cmd = [
        sys.executable,
        "-m",
        "evolve",
        "run",
        "--data",
        str(data_dir),
        "--time-limit",
        f"{budget_s:g}",
        "--jobs",
        str(jobs),
        "--generations",
        "100000",
        "--seed",
        str(seed),
        "--run-dir",
        str(run_dir),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"stepsynth run failed: {res.stderr[-2000:]}")
    out = subprocess.run(
        [sys.executable, "-m", "evolve", "archive", "list", "--json", "--run-dir", str(run_dir)],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
    )
    front = json.loads(out.stdout)
    gens = next((ln.split(":", 1)[1].strip() for ln in res.stdout.splitlines() if ln.startswith("generations:")), "?")
    search_s = next(
        (ln.split(":", 1)[1].strip() for ln in res.stdout.splitlines() if ln.startswith("wall_time_s:")), "?"
    )
    models = []
    for e in front:
        expr = parse_infix(e["expression"])
        pred = evaluate_expr(expr, table.columns, table.n)
        tr, te = mape_by_split(table, pred)
        # cross-check: the archive's own held-out figure is the same quantity
        if abs(te - e["objectives"]["step_mape"]) > 1e-6 * max(1.0, te):
            print(f"warning: {e['id']} held-out MAPE {te} != archived {e['objectives']['step_mape']}", file=sys.stderr)
        models.append(
            {
                "expression": e["expression"],
                "complexity": complexity_of(e["expression"]),
                "native_complexity": e["complexity"],
                "train_mape": tr,
                "test_mape": te,
            }
        )
    return summarise("stepsynth", models, wall, note=f"{gens} generations, search {search_s} s, population 200")


def run_pyoperon(table: StepTable, budget_s: float, jobs: int, seed: int) -> dict:
    from pyoperon.sklearn import SymbolicRegressor

    X = design(table)
    y = table.cycle_time_us
    tr = table.is_train
    reg = SymbolicRegressor(
        # the project's operators where Operon has them: max/min, sqrt|x|, log(1+x)
        allowed_symbols="add,sub,mul,div,fmin,fmax,sqrtabs,log1p,constant,variable",
        objectives=["r2", "length"],
        max_time=int(round(budget_s)),
        n_threads=jobs,
        random_state=seed,
        generations=10**7,
        max_evaluations=10**12,
        population_size=1000,
        max_length=40,
        max_depth=10,
    )
    t0 = time.perf_counter()
    reg.fit(X[tr], y[tr])
    wall = time.perf_counter() - t0
    names = {f"X{i + 1}": n for i, n in enumerate(table.primitive_names)}
    models = []
    for m in reg.pareto_front_:
        pred = reg.evaluate_model(m["tree"], X)
        a, b = mape_by_split(table, pred)
        text = reg.get_model_string(m["tree"], precision=8)
        for short, long in sorted(names.items(), key=lambda kv: -len(kv[0])):  # X10 before X1
            text = text.replace(short, long)
        models.append(
            {
                "expression": text,
                "complexity": complexity_of(text),
                "native_complexity": m["complexity"],
                "train_mape": a,
                "test_mape": b,
            }
        )
    return summarise(
        "pyoperon", models, wall, note=f"{reg.stats_.get('generations', '?')} generations, population 1000"
    )


def _gplearn_mape(y, y_pred, w):
    with np.errstate(all="ignore"):
        v = np.average(np.abs(y_pred - y) / np.abs(y), weights=w)
    return v if np.isfinite(v) else 1e9


def run_gplearn(table: StepTable, budget_s: float, jobs: int, seed: int) -> dict:
    from gplearn.fitness import make_fitness
    from gplearn.genetic import SymbolicRegressor

    X = design(table)
    tr = table.is_train
    scale = float(table.cycle_time_us[tr].mean())  # fit y/scale: constants of order 1
    y = table.cycle_time_us / scale
    reg = SymbolicRegressor(
        population_size=1000,
        generations=1,
        tournament_size=20,
        const_range=(-1.0, 1.0),
        init_depth=(2, 5),
        function_set=("add", "sub", "mul", "div", "sqrt", "log", "max", "min"),
        metric=make_fitness(function=_gplearn_mape, greater_is_better=False, wrap=False),
        parsimony_coefficient=0.0005,
        p_crossover=0.7,
        p_subtree_mutation=0.1,
        p_hoist_mutation=0.05,
        p_point_mutation=0.1,
        max_samples=1.0,
        warm_start=True,
        n_jobs=jobs,
        random_state=seed,
        feature_names=list(table.primitive_names),
    )
    t0 = time.perf_counter()
    last = 0.0
    gen = 0
    while True:
        start = time.perf_counter()
        if gen and start - t0 + last > budget_s:  # the next generation would overrun the budget
            break
        gen += 1
        reg.set_params(generations=gen)
        reg.fit(X[tr], y[tr])
        last = time.perf_counter() - start
    wall = time.perf_counter() - t0
    # the front over every generation's programs (like the project's run-long archive)
    seen: dict[str, object] = {}
    for population in reg._programs:
        for p in population or []:
            if p is not None:
                seen.setdefault(str(p), p)
    cands = []
    for text, p in seen.items():
        pred = p.execute(X) * scale
        a, b = mape_by_split(table, pred)
        if np.isfinite(a):
            cands.append(
                {
                    "expression": f"mul({scale!r}, {text})",
                    "complexity": complexity_of(text) + 2,
                    "native_complexity": p.length_ + 2,
                    "train_mape": a,
                    "test_mape": b,
                }
            )
    keep = non_dominated([(c["train_mape"], c["complexity"]) for c in cands])
    return summarise("gplearn", [cands[i] for i in keep], wall, note=f"{gen} generations, population 1000")


# --- report ---------------------------------------------------------------------------
def _pct(v) -> str:
    return "—" if v is None else f"{100 * v:.2f}%"


def markdown(rows: list[dict], budget_s: float, jobs: int) -> str:
    lines = [
        "| system | held-out MAPE, cx ≤ 10 | cx ≤ 20 | cx ≤ 40 | hypervolume | front size | wall time | notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['system']} | {_pct(r['test_mape_le10'])} | {_pct(r['test_mape_le20'])} "
            f"| {_pct(r['test_mape_le40'])} "
            f"| {r['hypervolume']:.4f} | {r['front_size']} | {r['wall_s']:.0f} s | {r['note']} |"
        )
    lines.append(
        "| PySR | — | — | — | — | — | — | not run: PySR downloads Julia at run time, and this machine "
        "reaches no site but the package registries |"
    )
    lines.append("")
    lines.append(
        f"Budget {budget_s:g} s per system, {jobs} cores. Chosen model at each cap: the lowest *training* "
        "MAPE among front members within the cap."
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = OneLineParser(prog="python benchmarks/peers.py", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--budget", type=positive_float, default=120.0, metavar="SEC", help="wall-clock seconds per system (120)"
    )
    ap.add_argument("--jobs", type=positive_int, default=2, metavar="J", help="cores per system (default 2)")
    ap.add_argument("--seed", type=seed_arg, default=0, metavar="S")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    ap.add_argument("--json", metavar="FILE", help="also write every front to FILE")
    args = ap.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown or not systems:
        got = f"unknown systems {sorted(unknown)}" if unknown else "none"
        ap.error(f"--systems: expected some of {list(SYSTEMS)}, got {got}")
    missing = [s for s in systems if s != "stepsynth" and importlib.util.find_spec(s) is None]
    if missing:
        ap.error(f"--systems: {', '.join(missing)} not installed (pip install {' '.join(missing)})")
    from evolve.cli_files import check_writable_file

    try:  # every input and the output checked before the long runs
        check_writable_file(args.json, "--json")
        table, data_dir = load_table()
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    n_tr, n_te = int(table.is_train.sum()), int((~table.is_train).sum())
    print(
        f"data: {data_dir} ({len(table.experiment_names)} experiments, {n_tr} training / {n_te} held-out "
        f"cycle-time rows, {len(table.primitive_names)} columns: {', '.join(table.primitive_names)})"
    )
    print(f"load average before the runs: {os.getloadavg()[0]:.2f}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="stepsynth-peers-") as tmp:
        for s in systems:
            print(f"running {s} ({args.budget:g} s, {args.jobs} cores) ...", flush=True)
            if s == "stepsynth":
                rows.append(run_stepsynth(table, data_dir, args.budget, args.jobs, args.seed, Path(tmp)))
            elif s == "pyoperon":
                rows.append(run_pyoperon(table, args.budget, args.jobs, args.seed))
            else:
                rows.append(run_gplearn(table, args.budget, args.jobs, args.seed))
            r = rows[-1]
            r["load_after"] = os.getloadavg()[0]  # ~jobs when the machine was ours alone
            r["note"] += f", load {r['load_after']:.1f}"
            print(
                f"  {s}: wall {r['wall_s']:.1f} s, front {r['front_size']}, hypervolume {r['hypervolume']:.4f} "
                f"(moocore {r['hypervolume_moocore']}), {r['note']}",
                flush=True,
            )
            for cap in COMPLEXITY_CAPS:
                m = r[f"model_le{cap}"]
                if m:
                    print(
                        f"    cx<={cap}: held-out {_pct(m['test_mape'])} train {_pct(m['train_mape'])} "
                        f"cx={m['complexity']} (native {m['native_complexity']}): {m['expression'][:160]}"
                    )
    print()
    print(markdown(rows, args.budget, args.jobs))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [{k: v for k, v in r.items() if not k.startswith("model_le")} for r in rows], indent=1, default=float
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
