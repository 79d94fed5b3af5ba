"""Speed and sanity of the closed-loop simulator and the teacher-forced replay.

Prints:
1. the closed-loop CPU time of the 16,800-request Llama-2-70B TP4 general experiment
   (2 stages of 600 s at 8 and 20 req/s) with a hand-made physics expression, on one core,
   through the Python reference loop and the compiled core in the same run (their ratio,
   and whether the per-request latencies are identical), and the compiled core's one-off
   costs: compiling in a process with an empty cache, loading the cache in a later one;
2. the teacher-forced replay time of one candidate over the 12 experiments with results
   (given per-step times), and the time to build / apply the linear forms;
3. simulated vs observed E2E / TTFT / ITL means per experiment (and per stage) for a
   hand-made physics model: a sanity check of the simulator, not a fit.

Usage: ``python benchmarks/bench_simulator.py [--experiments DIR] [--only-speed]``
(``DIR`` defaults to ``$STEPSYNTH_SHARED/data/experiments``).
"""

from __future__ import annotations

import os

# one core: keep numpy's thread pools out of the measurement
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evolve.cli_parser import OneLineParser, seed_arg  # noqa: E402
from fitness.sim.engine import simulate  # noqa: E402
from fitness.sim.models import ExpressionLatencyModel  # noqa: E402
from fitness.sim.replay import evaluate_weights, metric_weights, replay  # noqa: E402
from primitives.data.experiments import find_experiments  # noqa: E402
from primitives.data.roots import shared_data_root  # noqa: E402
from primitives.deployment import DeploymentResolver  # noqa: E402
from primitives.errors import InputError  # noqa: E402

SPEED_EXPERIMENT = "llama-2-70b-tp4-general"


# weights or matmuls (roofline), KV reads, per-layer launches, TP all-reduce latency, per-request CPU
HAND_EXPRESSION = (
    "max(1.2*weight_time_us, 1.4*matmul_time_us) + 1.2*kv_io_time_us + 15*n_layers"
    " + 6*(tp - 1)*allreduce_calls + 15*batch_size"
)


def hand_model(deployment) -> ExpressionLatencyModel:
    """A plausible hand-made physics model (not fitted), with ~9 ms of API overhead."""
    return ExpressionLatencyModel(HAND_EXPRESSION, deployment, {"queueing_base_us": 9000.0})


COMPILE_PROBE = """
import sys, time
sys.path.insert(0, {root!r})
from fitness.sim.engine import simulate
from fitness.sim.models import ExpressionLatencyModel
from primitives.data.experiments import ExperimentSpec
from primitives.deployment import DeploymentResolver
dep = DeploymentResolver().resolve("meta-llama/Llama-2-7b-hf", 1)
model = ExpressionLatencyModel({expr!r}, dep, {{"queueing_base_us": 9000.0}})
spec = ExperimentSpec(name="probe", model=dep.model.name, tp=1, stages=((4.0, 10.0),), num_groups=2,
    num_prompts_per_group=3, system_prompt_len=40, question_len=60, output_len=20,
    max_num_batched_tokens=256, max_num_seqs=8, stage_interval_s=0.5)
t1 = time.perf_counter()
simulate(spec, dep, model, engine="compiled", kv_capacity_blocks=1000)
t2 = time.perf_counter()
simulate(spec, dep, model, engine="compiled", kv_capacity_blocks=1000)
t3 = time.perf_counter()
print(t2 - t1 - (t3 - t2))
"""


def first_call_cost_s(cache_dir: str) -> float:
    """Seconds the first compiled run of a fresh process costs beyond a warm one, with CACHE_DIR as numba's cache."""
    import subprocess

    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    root = str(Path(__file__).resolve().parent.parent)
    probe = COMPILE_PROBE.format(root=root, expr=HAND_EXPRESSION)
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def closed_loop_speed(spec, dep, seed: int) -> None:
    """The Python loop against the compiled core on SPEC, same model, same run."""
    model = hand_model(dep)
    simulate(spec, dep, model, seed=seed, record=False, engine="compiled")  # warm-up (compile or load)
    for record in (False, True):
        cpu, res = {}, {}
        for engine in ("python", "compiled"):
            c0 = time.process_time()
            res[engine] = simulate(spec, dep, model, seed=seed, record=record, engine=engine)
            cpu[engine] = time.process_time() - c0
        steps = res["compiled"].n_steps
        same = all(
            np.array_equal(getattr(res["python"].requests, f), getattr(res["compiled"].requests, f), equal_nan=True)
            for f in ("e2e_us", "ttft_us", "tpot_us", "status")
        )
        print(
            f"closed loop {spec.name[-30:]} record={record}: python {cpu['python']:.2f} s CPU "
            f"({1e6 * cpu['python'] / steps:.1f} us/step), compiled {cpu['compiled']:.3f} s "
            f"({1e6 * cpu['compiled'] / steps:.2f} us/step): {cpu['python'] / cpu['compiled']:.0f}x; "
            f"{spec.num_requests} requests, {steps} steps; per-request latencies identical: {same}"
        )
    with tempfile.TemporaryDirectory() as cache:
        first = first_call_cost_s(cache)
        later = first_call_cost_s(cache)
    print(f"compiled core, first call in a new process: {first:.1f} s with an empty cache, {later:.2f} s cached")


def _pct(sim, obs) -> str:
    if sim is None or obs is None:
        return "      -"
    return f"{100.0 * (sim / obs - 1.0):+6.1f}%"


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python benchmarks/bench_simulator.py", description=__doc__.splitlines()[0])
    ap.add_argument("--experiments", default=str(shared_data_root() / "data" / "experiments"), metavar="DIR")
    ap.add_argument("--only-speed", action="store_true", help="skip the per-experiment sanity table")
    ap.add_argument("--seed", type=seed_arg, default=0, metavar="S")
    args = ap.parse_args(argv)
    try:
        specs = find_experiments(args.experiments)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    resolver = DeploymentResolver()

    # 1. closed-loop speed ----------------------------------------------------------
    big = next((s for s in specs if s.name.endswith(SPEED_EXPERIMENT)), None)
    if big is None:
        print(f"error: {args.experiments}: --experiments: no experiment named *{SPEED_EXPERIMENT}", file=sys.stderr)
        return 2
    closed_loop_speed(big, resolver.resolve(big.model, big.tp), args.seed)

    # 2. replay speed -----------------------------------------------------------------
    with_results = [s for s in specs if s.observed is not None]
    trajs, models = [], []
    t0 = time.perf_counter()
    rows = []
    for spec in with_results:
        d = resolver.resolve(spec.model, spec.tp)
        m = hand_model(d)
        t1 = time.perf_counter()
        r = simulate(spec, d, m, seed=args.seed, record=True)
        rows.append((spec, r, time.perf_counter() - t1))
        trajs.append(r.trajectory)
        models.append(m)
    sim_all = time.perf_counter() - t0
    print(
        f"closed loop of the {len(with_results)} experiments with results: {sim_all:.1f} s "
        f"(max {max(w for _, _, w in rows):.1f} s)"
    )
    rng = np.random.default_rng(0)
    candidates = [tr.step_time_us * rng.uniform(0.8, 1.2) for tr in trajs]  # some other candidate
    for tr, c, m in zip(trajs, candidates, models, strict=False):  # warm the per-trajectory path cache
        replay(tr, c, m)
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        for tr, c, m in zip(trajs, candidates, models, strict=False):
            replay(tr, c, m)
    rep_ms = 1e3 * (time.perf_counter() - t0) / reps
    print(
        f"teacher-forced replay of one candidate over {len(trajs)} experiments: {rep_ms:.1f} ms (summary + per stage)"
    )
    t0 = time.perf_counter()
    forms = [metric_weights(tr) for tr in trajs]
    print(
        f"metric_weights for {len(trajs)} experiments: {1e3 * (time.perf_counter() - t0):.0f} ms (once per trajectory)"
    )
    t0 = time.perf_counter()
    for _ in range(reps):
        for f, c, m in zip(forms, candidates, models, strict=False):
            evaluate_weights(f, c, m)
    print(f"applying the linear forms over {len(trajs)} experiments: {1e3 * (time.perf_counter() - t0) / reps:.2f} ms")
    worst = 0.0
    for tr, f, c, m in zip(trajs, forms, candidates, models, strict=False):
        a = replay(tr, c, m).summary
        b = evaluate_weights(f, c, m)
        worst = max(
            worst,
            abs(a.e2e_mean_s * 1e6 / b["e2e"] - 1),
            abs(a.ttft_mean_s * 1e6 / b["ttft"] - 1),
            abs(a.itl_mean_s * 1e6 / b["itl"] - 1),
        )
    print(f"  linear forms vs replay: max relative difference {worst:.1e}")

    if args.only_speed:
        return 0

    # 3. sanity table -----------------------------------------------------------------
    print()
    print("hand-made physics model (not fitted): simulated / observed means and error")
    print(f"{'experiment':44s} {'E2E s':>15s} {'err':>7s} {'TTFT ms':>15s} {'err':>7s} {'ITL ms':>13s} {'err':>7s}")
    errs = {"e2e": [], "ttft": [], "itl": []}
    for spec, r, _ in rows:
        obs = spec.observed
        scopes = [("", r.metrics.summary, obs.summary)]
        if len(obs.stages) > 1:
            scopes += [
                (f"  stage {i}", a, b) for i, (a, b) in enumerate(zip(r.metrics.stages, obs.stages, strict=False))
            ]
        for label, a, b in scopes:
            name = spec.name if not label else label
            print(
                f"{name[-44:]:44s} {a.e2e_mean_s:6.3f}/{b.e2e_mean_s:6.3f}  {_pct(a.e2e_mean_s, b.e2e_mean_s)} "
                f"{1e3 * a.ttft_mean_s:6.1f}/{1e3 * b.ttft_mean_s:6.1f}  {_pct(a.ttft_mean_s, b.ttft_mean_s)} "
                f"{1e3 * a.itl_mean_s:5.2f}/{1e3 * b.itl_mean_s:5.2f}  {_pct(a.itl_mean_s, b.itl_mean_s)}"
            )
        errs["e2e"].append(abs(r.metrics.summary.e2e_mean_s / obs.summary.e2e_mean_s - 1))
        errs["ttft"].append(abs(r.metrics.summary.ttft_mean_s / obs.summary.ttft_mean_s - 1))
        errs["itl"].append(abs(r.metrics.summary.itl_mean_s / obs.summary.itl_mean_s - 1))
    print(
        f"mean |error| over {len(rows)} experiments: E2E {100 * np.mean(errs['e2e']):.1f}%, "
        f"TTFT {100 * np.mean(errs['ttft']):.1f}%, ITL {100 * np.mean(errs['itl']):.1f}%"
    )
    blind = [s for s in specs if s.observed is None]
    if blind:
        print("\nblind runs (no results): simulated outcome with the same model")
        for spec in blind:
            d = resolver.resolve(spec.model, spec.tp)
            r = simulate(spec, d, hand_model(d), seed=args.seed, record=False)
            s = r.metrics.summary
            e2e = f"{s.e2e_mean_s:7.1f}" if s.e2e_mean_s is not None else "      -"
            print(
                f"{spec.name[-44:]:44s} successes {s.successes:5d} failures {s.failures:5d} E2E {e2e} s "
                f"preemptions {r.total_preemptions}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
