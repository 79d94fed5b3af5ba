"""Check 3 of ``trace_checks.py``: the queue at each load stage, the simulator against a trace.

With ``--run-dir`` and ``--id``, for traces whose experiment folder is in
``../shared/data/experiments``. Per stage, from ``QUEUE_SKIP_S`` into it: the mean cycle
time of every step (from the step ids); the mean and spread of the requests holding a slot
(``queue.running_depth``); the share of steps with every slot held and with requests
waiting; the whole stage's mean TTFT. For the real run (its trace and its client), for the
archived model simulated (``--draws`` draws of the load; how many of them put the TTFT below
the real one), and for the model scaled until its simulated cycle time is the trace's. The
last row tells the simulator's queueing apart from the model's step price: near
``max_num_seqs`` a few percent of step time move the queue, and the TTFT with it, by tens of
percent.

The first line under each traced experiment's name checks how the real server frees a finished request's
slot (the simulator holds it for exactly the next step): on how many pairs of consecutive
sampled steps the slots held outside a step's batch are as many as the requests the tracer
reports finished at the next (and how many pairs have either above 0: the others test
nothing). Its second, how fast a fresh server starts: the requests present at the trace's
first sampled step against the draws at the same step (the load sends at its rate whatever
the server does, so more present means slower first steps).

Then how bursty the arrivals at the server are: per stage, the variance over the mean of the
new prefills per step, on the steps with nobody waiting (the tracer counts a new request in
two steps, its prompt and its first decode, and the simulated count does the same; Poisson
arrivals give 1); and how many requests wait on the steps where some do.

Last, how far and for how long the requests present (holding a slot or waiting) wander: their
99th percentile over the stage's steps, and the correlation of the count with itself
``MEMORY_LAG_S`` later (pairs of steps that far apart, within ``MEMORY_TOLERANCE``). Near
``max_num_seqs`` a queue that lasts longer and reaches higher waits longer at the same mean.
A trace's steps are a 10% sample, so its figures are noisier than the simulated ones (taken
on every step), and the real run is one draw of its load: the count of draws below it says
how unusual it is among the simulated ones.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evolve.report import short_experiment_name  # noqa: E402
from fitness.sim.engine import simulate  # noqa: E402
from fitness.sim.models import ExpressionLatencyModel  # noqa: E402
from fitness.step_scatter import step_scales  # noqa: E402
from primitives.language import scaled_expression  # noqa: E402

QUEUE_SKIP_S = 30.0  # check 3 leaves out each stage's first seconds, while its batch fills
QUEUE_DRAWS = 3
SCALE_ROUNDS = 4  # secant rounds of the scale that puts the model's cycle time on the trace's
SCALE_TOLERANCE = 1e-3  # close enough: no more rounds
SCALE_MATCH = 0.01  # a scaled row further than this from the trace's cycle time says "no fit"
SCALE_LIMITS = (0.25, 4.0)
STAGE_IDLE_S = 0.5  # an idle gap this long after a stage's duration is the next stage's start (interval: 1 s)
LOCAL_PAIRS = 50  # the sampled pairs before a gap whose median cycle prices its steps
MEMORY_LAG_S = 8.0  # longer than a request's 5-6 s in its slot at the knees: what lasts beyond it
MEMORY_TOLERANCE = 0.15  # a pair counts when its steps are MEMORY_LAG_S apart within this share


def short(experiment: str) -> str:
    """An experiment as the reports name it, at most 26 characters (its end, where the
    workload is)."""
    name = short_experiment_name(str(experiment))
    return name if len(name) <= 26 else "…" + name[-25:]


def id_rate_cycle_us(start_s: np.ndarray, step_id: np.ndarray, k: np.ndarray) -> float:
    """The mean cycle (µs) of every step from sample K[0] to K[-1], sampled or not (the
    ids count them; idle time between steps included)."""
    return float((start_s[k[-1]] - start_s[k[0]]) * 1e6 / (step_id[k[-1]] - step_id[k[0]]))


@dataclass
class StepSeries:
    """Steps of one run in time order: start (s from the run's first step), id (steps
    between two are the ones not sampled), requests holding a slot, requests waiting
    after scheduling and new requests as the tracer counts them (``tracer_prefills``;
    None where unknown)."""

    start_s: np.ndarray
    step_id: np.ndarray
    running: np.ndarray | None
    waiting: np.ndarray | None
    prefills: np.ndarray | None = None


def lagged_correlation(start_s: np.ndarray, values: np.ndarray, lag_s: float) -> float:
    """Pearson correlation of VALUES with themselves LAG_S later: each step paired with the step
    that starts nearest to LAG_S after it, where that is within ``MEMORY_TOLERANCE`` of LAG_S
    (START_S ascending; the same lag whether every step is known or a sample). NaN with under
    10 pairs or no spread."""
    ok = np.isfinite(values)
    t, v = start_s[ok], values[ok]
    if len(t) < 2:
        return float("nan")
    after = np.clip(np.searchsorted(t, t + lag_s), 1, len(t) - 1)
    j = np.where(np.abs(t[after - 1] - t - lag_s) <= np.abs(t[after] - t - lag_s), after - 1, after)
    paired = np.abs(t[j] - t - lag_s) <= MEMORY_TOLERANCE * lag_s
    a, b = v[paired], v[j[paired]]
    if len(a) < 10 or a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


def share(values: np.ndarray | None, test) -> float:
    """The share of finite VALUES that pass TEST (NaN: no values)."""
    finite = values[np.isfinite(values)] if values is not None else np.zeros(0)
    return float(test(finite).mean()) if len(finite) else float("nan")


def dispersion(prefills: np.ndarray, waiting: np.ndarray | None) -> float:
    """Variance over mean of PREFILLS on the steps with nobody WAITING (every step where the
    trace has no waiting depth; a step whose depth is unknown is left out). While nobody
    waits, a step admits whoever arrived, so Poisson arrivals give about 1. NaN with under
    3 steps or no prefill."""
    free = prefills[waiting == 0] if waiting is not None else prefills
    free = free[np.isfinite(free)]
    return float(free.var() / free.mean()) if len(free) >= 3 and free.mean() > 0 else float("nan")


def tracer_prefills(admit_step: np.ndarray, n_steps: int) -> np.ndarray:
    """New requests per step as vLLM's tracer counts prefills: a request admitted at step k
    in steps k and k+1 (its prompt, then its first decode, scheduled before the prompt's
    token came back). ``admit_step``: each request's (-1: never admitted)."""
    admitted = np.bincount(admit_step[admit_step >= 0], minlength=n_steps)[:n_steps].astype(np.float64)
    return admitted + np.concatenate([[0.0], admitted[:-1]])


def slot_release(g) -> tuple[int, int, int] | None:
    """How the real server frees a finished request's slot: over the pairs of consecutive
    sampled steps (ids k, k+1), on how many the requests holding a slot outside step k's
    batch (``running_depth`` - prefill - decode requests) are as many as the tracer
    reports finished at k+1; the pairs; and those of them where either count is above 0
    (a pair with neither tests nothing). The simulator holds each finished request's
    slot for exactly the next step (``fitness.sim.scheduler``). None without the columns."""
    if not {"running_depth", "num_finished"} <= set(g.columns):
        return None
    held = (g["running_depth"] - g["num_prefill_reqs"] - g["num_decode_reqs"]).to_numpy(dtype=np.float64)
    finished = g["num_finished"].to_numpy(dtype=np.float64)
    pairs = np.flatnonzero(np.diff(g["step_id"].to_numpy()) == 1)
    pairs = pairs[np.isfinite(held[pairs]) & np.isfinite(finished[pairs + 1])]
    tested = int(((held[pairs] > 0) | (finished[pairs + 1] > 0)).sum())
    return int((held[pairs] == finished[pairs + 1]).sum()), len(pairs), tested


def stage_stats(steps: StepSeries, lo_s: float, hi_s: float, max_running: int) -> dict | None:
    """Over the steps that start in [LO_S, HI_S): the mean cycle (ms, every step between
    the first and the last, sampled or not), the running requests' mean and sd, the share
    of steps with all MAX_RUNNING slots held and with requests waiting, how many wait on
    those steps (``queued``), the prefills' ``dispersion``, and the requests present (running
    and waiting): their 99th percentile and ``lagged_correlation`` at ``MEMORY_LAG_S``; None
    with under 3."""
    k = np.flatnonzero((steps.start_s >= lo_s) & (steps.start_s < hi_s))
    if len(k) < 3:
        return None
    running, waiting = (v[k] if v is not None else None for v in (steps.running, steps.waiting))
    known = running[np.isfinite(running)] if running is not None else np.zeros(0)
    queued = waiting[waiting > 0] if waiting is not None else np.zeros(0)
    present = running + waiting if running is not None and waiting is not None else np.zeros(0)
    counted = present[np.isfinite(present)]
    return {
        "present_p99": float(np.percentile(counted, 99)) if len(counted) else float("nan"),
        "memory": lagged_correlation(steps.start_s[k], present, MEMORY_LAG_S) if len(counted) else float("nan"),
        "dispersion": dispersion(steps.prefills[k], waiting) if steps.prefills is not None else float("nan"),
        "cycle_ms": id_rate_cycle_us(steps.start_s, steps.step_id, k) / 1e3,
        "running": float(known.mean()) if len(known) else float("nan"),
        "sd": float(known.std()) if len(known) else float("nan"),
        "full": share(running, lambda r: r >= max_running),
        "waiting": share(waiting, lambda w: w > 0),
        "queued": float(queued.mean()) if len(queued) else float("nan"),
    }


def trace_series(g) -> StepSeries:
    """A trace's sampled steps (``primitives.data.traces`` columns) as a StepSeries."""
    start_us = g["ts_start_us"].to_numpy(dtype=np.float64)
    queue = {c: g[c].to_numpy(dtype=np.float64) if c in g else None for c in ("running_depth", "waiting_depth")}
    return StepSeries(
        (start_us - start_us.min()) / 1e6,
        g["step_id"].to_numpy(dtype=np.float64),
        queue["running_depth"],
        queue["waiting_depth"],
        g["num_prefill_reqs"].to_numpy(dtype=np.float64),
    )


def trace_stage_starts_s(steps: StepSeries, durations_s: list[float]) -> list[float] | None:
    """Where each load stage starts in a trace (s): its first step, then for each next
    stage the first idle gap of ``STAGE_IDLE_S`` or more once the stage before has run its
    duration (between stages the engine idles: the load generator waits for the stage to
    drain, then the interval). A gap's idle time is what its steps' own time, at the
    median cycle of the ``LOCAL_PAIRS`` pairs before it, leaves over. None where a stage
    start is not found."""
    dt_s, steps_between = np.diff(steps.start_s), np.diff(steps.step_id)
    cycle_s = dt_s / np.maximum(steps_between, 1)
    starts = [float(steps.start_s[0])] if len(steps.start_s) else []
    for duration_s in durations_s[:-1]:
        if not starts:
            return None
        after = np.flatnonzero(steps.start_s[:-1] >= starts[-1] + duration_s)
        found = None
        for j in after:
            local_s = float(np.median(cycle_s[max(j - LOCAL_PAIRS, 0) : j])) if j else float(cycle_s[0])
            if dt_s[j] - steps_between[j] * local_s >= STAGE_IDLE_S:
                found = float(steps.start_s[j + 1])
                break
        if found is None:
            return None
        starts.append(found)
    return starts


@dataclass
class SimulatedStage:
    stats: dict | None  # ``stage_stats`` of the stage's window
    ttft_ms: float  # the stage's mean TTFT (NaN: nothing served)
    window_s: tuple[float, float]  # from QUEUE_SKIP_S in to the stage's end, s from the first step


@dataclass
class SimulatedRun:
    stages: list[SimulatedStage]
    present: np.ndarray  # requests holding a slot or waiting after each step's scheduling


def simulate_stages(spec, deployment, expression: str, overheads: dict, seed: int, scatter) -> SimulatedRun:
    """One simulation of SPEC's load with EXPRESSION, per load stage."""
    model = ExpressionLatencyModel(expression, deployment, overheads)
    result = simulate(spec, deployment, model, seed=seed, record=True, step_scales=step_scales(scatter, seed))
    traj, status = result.trajectory, result.requests.status
    origin_us = float(traj.step_start_us[0])
    series = StepSeries(
        (traj.step_start_us - origin_us) / 1e6,
        np.arange(traj.n_steps, dtype=np.float64),
        traj.running_depth(status).astype(np.float64),
        traj.waiting_depth(status, spec.request_timeout_s).astype(np.float64),
        tracer_prefills(traj.admit_step, traj.n_steps),
    )
    out = []
    for i, (_, duration_s) in enumerate(spec.stages):
        start_s = (float(result.stage_start_us[i]) - origin_us) / 1e6
        window = (start_s + QUEUE_SKIP_S, start_s + duration_s)
        ttft_s = result.metrics.stages[i].ttft_mean_s
        ttft_ms = ttft_s * 1e3 if ttft_s is not None else float("nan")
        out.append(SimulatedStage(stage_stats(series, *window, spec.max_num_seqs), ttft_ms, window))
    return SimulatedRun(out, series.running + series.waiting)


def stage_draws(
    spec, deployment, expression: str, overheads: dict, scatter, i: int, draws: int
) -> list[SimulatedStage]:
    """Stage I of ``simulate_stages`` for the load seeds 0 .. DRAWS - 1."""
    return [simulate_stages(spec, deployment, expression, overheads, s, scatter).stages[i] for s in range(draws)]


def first_step_present(trace, runs: list[SimulatedRun]) -> str | None:
    """The requests present (holding a slot or waiting) at the trace's first sampled step,
    and at the same step id in each draw: the load sends from its first request on at the
    stage's rate whatever the server does, so more requests there than in the draws means
    the real server's first steps took longer than the model's (a server warming up).
    The tracer's step ids and the simulator's step indices are both taken to count from 0
    (counting from 1 would only lower the draws' range). None where the trace has no
    queue depths."""
    first = first_step_present_count(trace)
    if first is None:
        return None
    k, real = first
    drawn = [float(run.present[k]) for run in runs if k < len(run.present)]
    if not drawn:
        return None
    return f"  requests present at step {k}, the first sampled: {real:g}; simulated {min(drawn):g}-{max(drawn):g}"


def first_step_present_count(trace) -> tuple[int, float] | None:
    """(the trace's first sampled step id, the requests present there: running and waiting), or
    None where the trace has no queue depths."""
    if not {"running_depth", "waiting_depth"} <= set(trace.columns) or not len(trace):
        return None
    first = trace.loc[trace["step_id"].idxmin()]
    real = float(first["running_depth"] + first["waiting_depth"])
    return (int(first["step_id"]), real) if np.isfinite(real) else None


def mean_stats(stats: list[dict | None]) -> dict | None:
    """Each figure's mean over the draws that have the window and the figure (NaN: no draw
    has the figure, e.g. no step with requests waiting; None: no draw has the window)."""
    have = [s for s in stats if s is not None]
    if not have:
        return None
    return {k: float(np.nanmean(v)) if np.isfinite(v := [s[k] for s in have]).any() else float("nan") for k in have[0]}


def cell(value: float | None, width: int, form: str) -> str:
    """VALUE formatted as FORM in WIDTH characters: '-' where there is none (None or not a
    number); past what fits, '>' and the largest number of that form that fits."""
    if value is None or not np.isfinite(value):
        return f"{'-':>{width}}"
    text = f"{value:{width}{form}}"
    if len(text) <= width:
        return text
    digits = int(form.strip("f").lstrip("."))
    digits = min(digits, max(width - 3, 0))  # '>', at least one integer digit and the point
    return ">" + ("9" * (width - digits - 2) + "." + "9" * digits if digits else "9" * (width - 1))


def queue_row(stage: str, label: str, stats: dict | None, ttft_ms: float, below: str = "") -> str:
    """One row of check 3 (79 characters): ``stage_stats``, the stage's mean TTFT and, for
    the simulated rows, how many draws' TTFT lie below the real one."""
    head = f"{stage:<20} {label:<7}"
    if stats is None:
        return f"{head} no steps in this window"
    return (
        f"{head} {cell(stats['cycle_ms'], 8, '.2f')} {cell(stats['running'], 7, '.1f')} {cell(stats['sd'], 4, '.1f')}"
        f" {cell(100 * stats['full'], 5, '.1f')}% {cell(100 * stats['waiting'], 6, '.1f')}%"
        f" {cell(ttft_ms, 7, '.1f')} {below:>5}"
    ).rstrip()


def count_below(drawn, real: float) -> str:
    """How many of the DRAWN figures lie under the REAL one, of those the draws have ('' where
    the real run has none)."""
    got = np.asarray(drawn, dtype=np.float64)
    got = got[np.isfinite(got)]  # a draw without the figure (one that served nobody) is left out
    return f"{int((got < real).sum())}/{len(got)}" if np.isfinite(real) else ""


def below(draws: list[SimulatedStage], real: dict | None, key: str) -> str:
    """``count_below`` of the figure KEY of the DRAWS' windows."""
    return count_below(
        [d.stats[key] for d in draws if d.stats is not None], real[key] if real is not None else float("nan")
    )


def draws_row(label: str, draws: list[SimulatedStage], observed_ms: float) -> str:
    """A simulated row: the draws' mean figures."""
    ttft = np.array([d.ttft_ms for d in draws])
    served = ttft[np.isfinite(ttft)]  # a draw that served nobody has no TTFT to compare
    mean_ttft = float(served.mean()) if len(served) else float("nan")
    return queue_row("", label, mean_stats([d.stats for d in draws]), mean_ttft, count_below(ttft, observed_ms))


def match_cycle(
    spec, deployment, entry, draws: int, scatter, i: int, target_ms: float, model: list[SimulatedStage]
) -> tuple[float, list[SimulatedStage], dict | None]:
    """The factor on the model's step time that puts stage I's simulated cycle time on
    TARGET_MS (``MODEL``: the draws at factor 1): secant rounds on the logs (a slower step
    holds more requests, which slows it again), within SCALE_LIMITS. Returns the factor, its
    draws and their mean figures."""
    factor, scaled, elasticity = 1.0, model, 1.0
    stats = mean_stats([d.stats for d in model])
    for _ in range(SCALE_ROUNDS):
        if stats is None or not stats["cycle_ms"] > 0 or abs(stats["cycle_ms"] / target_ms - 1) < SCALE_TOLERANCE:
            break
        previous = (factor, stats["cycle_ms"])
        factor = float(np.clip(factor * (target_ms / previous[1]) ** (1.0 / elasticity), *SCALE_LIMITS))
        if factor == previous[0]:  # held at a limit: another round would simulate the same
            break
        scaled = stage_draws(
            spec, deployment, scaled_expression(entry.expression, factor), entry.overheads, scatter, i, draws
        )
        stats = mean_stats([d.stats for d in scaled])
        if stats is not None and stats["cycle_ms"] > 0 and factor != previous[0] and stats["cycle_ms"] != previous[1]:
            slope = np.log(stats["cycle_ms"] / previous[1]) / np.log(factor / previous[0])
            elasticity = float(np.clip(slope, 0.5, 5.0))
    return factor, scaled, stats


def scaled_row(
    spec, deployment, entry, draws: int, scatter, i: int, target_ms: float, model, observed_ms
) -> tuple[str, list[SimulatedStage]]:
    """The row of the model scaled until stage I's simulated cycle time is TARGET_MS
    (``match_cycle``); where it does not get within SCALE_MATCH, says so."""
    factor, scaled, stats = match_cycle(spec, deployment, entry, draws, scatter, i, target_ms, model)
    if stats is None or abs(stats["cycle_ms"] / target_ms - 1) > SCALE_MATCH:
        got = f"{stats['cycle_ms']:.2f} ms" if stats is not None else "no steps"
        return f"{'':<20} {'scaled':<7} no fit: x{factor:.3g} gives {got}", []
    return draws_row(f"x{factor:.3f}", scaled, observed_ms), scaled


def queue_by_stage(data, specs: dict, resolver, entry, draws: int, scatter) -> list[str]:
    """Check 3: per experiment and load stage, the real run, the model simulated and the
    model scaled until its simulated cycle time is the trace's (``queue_row`` lines)."""
    out = [
        f"the queue per load stage, from {QUEUE_SKIP_S:.0f} s in: the real run, {entry.id} ({draws} draws),",
        "and the model scaled to the trace's cycle time",
        "(full: every max_num_seqs slot held; below: draws with a TTFT under the real)",
        f"{'experiment, stage':<20} {'':<7} {'cycle ms':>8} {'running':>7} {'sd':>4} {'full':>6} {'waiting':>7}"
        f" {'TTFT ms':>7} {'below':>5}",
    ]
    bursts = [
        "arrivals: new prefills per step, nobody waiting: variance / mean (Poisson: 1);",
        "queued: the requests waiting, on the steps where some wait (mean)",
        f"{'':<20} {'arrivals':^15} {'queued':^15}".rstrip(),
        f"{'experiment, stage':<20} {'real':>7} {'model':>7} {'real':>7} {'model':>7}",
    ]
    wander = [
        "the requests present (holding a slot or waiting): their 99th percentile, and",
        f"their correlation with the count {MEMORY_LAG_S:g} s later (scaled: the model at the",
        "trace's cycle time; below: scaled draws whose correlation is under the real)",
        f"{'':<20} {'p99':^23} {f'{MEMORY_LAG_S:g} s later':^23}".rstrip(),
        f"{'experiment, stage':<20}" + f" {'real':>7} {'model':>7} {'scaled':>7}" * 2 + f" {'below':>5}",
    ]
    for name in sorted(data.steps["experiment"].unique()):
        spec = specs.get(name)
        if spec is None:
            out.append(f"{short(name):<26} no experiment folder of this name: skipped")
            continue
        out.append(short(name))
        dep = resolver.resolve_experiment(spec)
        trace = data.steps.loc[data.steps["experiment"] == name]
        runs = [simulate_stages(spec, dep, entry.expression, entry.overheads, s, scatter) for s in range(draws)]
        released = slot_release(trace)
        if released is not None:
            matched, pairs, tested = released
            out.append(f"  held slots = finished next step: {matched} of {pairs} pairs ({tested} not both 0)")
        present = first_step_present(trace, runs)
        if present is not None:
            out.append(present)
        real = trace_series(trace)
        starts_s = trace_stage_starts_s(real, [d for _, d in spec.stages])
        if starts_s is None:
            out.append("  (no stage starts found in the trace: its rows use the first draw's windows)")
        for i, (rate, duration_s) in enumerate(spec.stages):
            # the trace's own stage, or where it cannot tell its stages apart, the first draw's
            window = (starts_s[i] + QUEUE_SKIP_S, starts_s[i] + duration_s) if starts_s else runs[0].stages[i].window_s
            real_stats = stage_stats(real, *window, spec.max_num_seqs)
            obs = spec.observed.stages[i].ttft_mean_s if spec.observed and i < len(spec.observed.stages) else None
            observed_ms = obs * 1e3 if obs is not None else float("nan")
            model = [run.stages[i] for run in runs]
            out.append(queue_row(f"  {i + 1}  {rate:g} req/s", "real", real_stats, observed_ms))
            out.append(draws_row("model", model, observed_ms))
            scaled: list[SimulatedStage] = []
            target_ms = real_stats["cycle_ms"] if real_stats is not None else float("nan")
            if np.isfinite(target_ms) and target_ms > 0:
                line, scaled = scaled_row(spec, dep, entry, draws, scatter, i, target_ms, model, observed_ms)
                out.append(line)
            if i == 0:
                bursts.append(short(name))
                wander.append(short(name))
            simulated, at_cycle = mean_stats([d.stats for d in model]), mean_stats([d.stats for d in scaled])
            for lines, columns, rows in (
                (bursts, (("dispersion", ".3f"), ("queued", ".2f")), (real_stats, simulated)),
                (wander, (("present_p99", ".1f"), ("memory", ".3f")), (real_stats, simulated, at_cycle)),
            ):
                cells = [
                    cell(st[key] if st is not None else float("nan"), 7, form) for key, form in columns for st in rows
                ]
                lines.append(f"{f'  {i + 1}  {rate:g} req/s':<20} " + " ".join(cells))
            wander[-1] += f" {below(scaled, real_stats, 'memory'):>5}"
    return out + [""] + bursts + [""] + wander if len(bursts) > 4 else out


if __name__ == "__main__":
    print(
        "error: trace_queue.py holds check 3 of trace_checks.py and what knee_whatif.py and fresh_server.py"
        " share with it; run those",
        file=sys.stderr,
    )
    raise SystemExit(2)
