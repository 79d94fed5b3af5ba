"""One emulated experiment: simulate it, sample 10 % of its steps, build the flat rows.

How the flat columns are derived from the simulation (``generate_experiment``):

* ``step.ts_start_ns``: the simulated step start (a fixed origin + µs * 1000), so the
  difference of two consecutive step ids is that step's cycle (plus engine idle time in
  the rare case the next step waited for arrivals; ``idle_pairs`` in the metadata);
* ``step.duration_us`` (= ts_end - ts_start): a scheduler-CPU-time distractor shaped
  like the real one (sub-ms, with multi-ms pauses above ~60 running); never the cycle;
* ``batch.*``: from the per-request rows with the project's phase rule (prefill while
  ``progress < input_len``; a preempted request's recompute of its output therefore counts
  as decode tokens); ``queue.running_depth`` = requests in the batch;
* ``queue.waiting_depth``: enqueued, not yet (re)admitted, not yet aborted;
* ``kv.blocks_free_gpu``: capacity (``Deployment.kv_capacity_blocks()``, at vLLM's default 0.9) minus the
  distinct blocks the batch holds after the step (``ceil(context/16)`` per request,
  prompt blocks shared through the prefix cache counted once per group/user).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from fitness.emulator.physics import EmulatorPhysics
from fitness.emulator.server import EmulatedVLLM
from fitness.emulator.workloads import (
    DURATION_SCALE,
    ServedModel,
    Workload,
    experiment_id,
    experiment_spec,
)
from fitness.sim.engine import simulate
from fitness.sim.loadgen import build_load
from primitives.deployment import KV_BLOCK_TOKENS, DeploymentResolver

DEFAULT_SEED = 0
DEFAULT_SAMPLE_FRACTION = 0.10  # the real tracer kept about 10 % of steps

STEP_COLUMNS = (
    "experiment_id",
    "model",
    "workload",
    "tp",
    "step.id",
    "step.ts_start_ns",
    "step.ts_end_ns",
    "step.duration_us",
    "queue.running_depth",
    "queue.waiting_depth",
    "batch.num_prefill_reqs",
    "batch.num_decode_reqs",
    "batch.scheduled_tokens",
    "batch.prefill_tokens",
    "batch.decode_tokens",
    "batch.num_finished",
    "batch.num_preempted",
    "kv.usage_gpu_ratio",
    "kv.blocks_total_gpu",
    "kv.blocks_free_gpu",
)
REQUEST_COLUMNS = ("experiment_id", "step.id", "progress", "new_tokens", "input_len", "output_len")
TS_ORIGIN_NS = 10_000_000_000_000  # a monotonic-clock origin, like the real traces'


def scheduler_cpu_us(running: np.ndarray, scheduled_tokens: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The tracer's ``step.duration_us``: the scheduler's own Python time, not the step.

    Tens to hundreds of µs growing with the running requests, plus (as in the real
    traces, where the median jumps from ~0.3 ms to ~5 ms above ~60 running requests)
    occasional millisecond-long pauses whose odds grow with the live request objects.
    """
    running = np.asarray(running, dtype=np.float64)
    base = 40.0 + 6.5 * running + 0.03 * np.asarray(scheduled_tokens, dtype=np.float64)
    base = base * np.exp(0.35 * rng.standard_normal(len(running)))
    p_pause = 0.8 / (1.0 + np.exp(-(running - 60.0) / 8.0))
    pause = (rng.random(len(running)) < p_pause) * rng.exponential(5000.0, len(running))
    return np.maximum(np.rint(base + pause), 1.0)


def _experiment_seeds(seed: int, index: int) -> dict[str, np.random.SeedSequence | int]:
    """Independent streams per experiment: load plan, cycle noise, step sample, CPU times."""
    seq = np.random.SeedSequence([int(seed), int(index)])
    load_seq, noise_seq, sample_seq, cpu_seq = seq.spawn(4)
    return {
        "load": int(load_seq.generate_state(1, dtype=np.uint32)[0]),
        "noise": noise_seq,
        "sample": sample_seq,
        "cpu": cpu_seq,
    }


def _kv_blocks_used(traj, load, kept_steps: np.ndarray) -> np.ndarray:
    """Distinct KV blocks held by the batch of each kept step, once it has run.

    Every request holds ``ceil(context / 16)`` blocks; the full blocks of its prompt are
    shared through the prefix cache: the group's system-prompt blocks with every request
    of the group, the rest of the prompt with the requests of the same user.
    """
    off = traj.step_offsets
    lo, hi = off[kept_steps], off[kept_steps + 1]
    counts = hi - lo
    rows = np.repeat(lo - np.cumsum(np.r_[0, counts[:-1]]), counts) + np.arange(counts.sum())
    step_of_row = np.repeat(np.arange(len(kept_steps)), counts)
    req = traj.batch_request[rows].astype(np.int64)
    ctx = traj.batch_progress[rows].astype(np.int64) + traj.batch_new_tokens[rows]
    user = load.request_user[req]
    group = load.shapes.user_group[user]
    sys_blocks = load.shapes.group_system_len[group] // KV_BLOCK_TOKENS
    prompt_blocks = load.shapes.user_prompt_len[user] // KV_BLOCK_TOKENS
    full = ctx // KV_BLOCK_TOKENS
    g_blocks = np.minimum(full, sys_blocks)
    u_blocks = np.maximum(np.minimum(full, prompt_blocks) - sys_blocks, 0)
    private = -(-ctx // KV_BLOCK_TOKENS) - g_blocks - u_blocks
    used = np.bincount(step_of_row, weights=private, minlength=len(kept_steps))
    for key, blocks in ((group, g_blocks), (user, u_blocks)):
        # shared blocks count once per (step, key): the longest chain among its requests
        k = step_of_row * (int(key.max()) + 1) + key
        order = np.lexsort((-blocks, k))
        first = np.r_[True, k[order][1:] != k[order][:-1]]
        sel = order[first]
        used += np.bincount(step_of_row[sel], weights=blocks[sel], minlength=len(kept_steps))
    return used.astype(np.int64)


@dataclass
class ExperimentData:
    """One experiment's sampled rows (pandas DataFrames) and its calibration summary."""

    steps: object  # STEP_COLUMNS, one row per sampled step
    requests: object  # REQUEST_COLUMNS, one row per request of a sampled step
    summary: dict


def generate_experiment(
    model: ServedModel,
    workload: Workload,
    seed: int = DEFAULT_SEED,
    index: int = 0,
    physics: EmulatorPhysics | None = None,
    duration_scale: float = DURATION_SCALE,
    sample_fraction: float = DEFAULT_SAMPLE_FRACTION,
) -> ExperimentData:
    """Simulate one experiment and return its sampled flat rows and per-request detail."""
    import pandas as pd

    physics = physics or EmulatorPhysics()
    resolver = DeploymentResolver()
    dep = resolver.resolve(model.trace_name, model.tp)
    spec = experiment_spec(model, workload, duration_scale)
    seeds = _experiment_seeds(seed, index)
    server = EmulatedVLLM(dep, physics, seed=seeds["noise"])
    load = build_load(spec, seeds["load"])
    t0 = time.perf_counter()
    result = simulate(spec, dep, server, seed=seeds["load"], record=True, load=load)
    sim_s = time.perf_counter() - t0
    traj = result.trajectory
    n_steps = traj.n_steps
    exp_id = experiment_id(model, workload)

    # Bernoulli sample of steps, as the real tracer's ~10 %
    keep = np.random.default_rng(seeds["sample"]).random(n_steps) < sample_fraction
    kept = np.flatnonzero(keep)
    off = traj.step_offsets
    counts = (off[kept + 1] - off[kept]).astype(np.int64)
    rows = np.repeat(off[kept] - np.cumsum(np.r_[0, counts[:-1]]), counts) + np.arange(counts.sum())
    step_of_row = np.repeat(np.arange(len(kept)), counts)
    prog = traj.batch_progress[rows]
    new = traj.batch_new_tokens[rows]
    inl = traj.batch_input_len[rows]
    outl = traj.batch_output_len[rows]
    is_prefill = prog < inl  # the project's phase rule (primitives.registry.IS_PREFILL)
    nk = len(kept)
    prefill_tokens = np.bincount(step_of_row, weights=new * is_prefill, minlength=nk).astype(np.int64)
    decode_tokens = np.bincount(step_of_row, weights=new * ~is_prefill, minlength=nk).astype(np.int64)
    n_prefill = np.bincount(step_of_row, weights=is_prefill, minlength=nk).astype(np.int64)
    n_decode = counts - n_prefill

    status = result.requests.status
    finished_at = np.bincount(traj.last_step[traj.last_step >= 0], minlength=n_steps)
    waiting = traj.waiting_depth(status, spec.request_timeout_s)[kept]
    blocks_total = result.kv_capacity_blocks
    used = np.minimum(_kv_blocks_used(traj, load, kept), blocks_total)
    free = blocks_total - used

    ts_start_ns = TS_ORIGIN_NS + np.rint(traj.step_start_us * 1000.0).astype(np.int64)
    cycle_us = traj.step_cycle_us[kept]
    cpu_us = scheduler_cpu_us(counts, prefill_tokens + decode_tokens, np.random.default_rng(seeds["cpu"]))
    cpu_us = np.minimum(cpu_us, np.floor(0.9 * cycle_us)).astype(np.int64)  # ends inside its own cycle

    steps = pd.DataFrame(
        {
            "experiment_id": exp_id,
            "model": model.trace_name,
            "workload": workload.name,
            "tp": np.full(nk, model.tp, dtype=np.int64),
            "step.id": kept.astype(np.int64),
            "step.ts_start_ns": ts_start_ns[kept],
            "step.ts_end_ns": ts_start_ns[kept] + cpu_us * 1000,
            "step.duration_us": cpu_us,
            "queue.running_depth": counts,
            "queue.waiting_depth": waiting.astype(np.int64),
            "batch.num_prefill_reqs": n_prefill,
            "batch.num_decode_reqs": n_decode,
            "batch.scheduled_tokens": prefill_tokens + decode_tokens,
            "batch.prefill_tokens": prefill_tokens,
            "batch.decode_tokens": decode_tokens,
            "batch.num_finished": finished_at[kept].astype(np.int64),
            "batch.num_preempted": traj.step_preemptions[kept].astype(np.int64),
            "kv.usage_gpu_ratio": used / blocks_total,
            "kv.blocks_total_gpu": np.full(nk, blocks_total, dtype=np.int64),
            "kv.blocks_free_gpu": free.astype(np.int64),
        },
        columns=list(STEP_COLUMNS),
    )
    requests = pd.DataFrame(
        {
            "experiment_id": exp_id,
            "step.id": kept[step_of_row].astype(np.int32),
            "progress": prog.astype(np.int32),
            "new_tokens": new.astype(np.int32),
            "input_len": inl.astype(np.int32),
            "output_len": outl.astype(np.int32),
        },
        columns=list(REQUEST_COLUMNS),
    )

    # calibration figures and the oracle's error on this experiment's targets
    pair = np.flatnonzero(np.diff(kept) == 1)
    target_us = np.diff(ts_start_ns[kept])[pair] / 1000.0
    noiseless = server.hidden.cycle_time_us_csr(np.r_[0, np.cumsum(counts)], prog, new, inl, outl)
    oracle_us = (
        noiseless + server.scheduling_processing_us + server.preemption_processing_us * traj.step_preemptions[kept]
    )[pair]
    ape = np.abs(oracle_us - target_us) / target_us
    m = result.metrics.summary
    summary = {
        "experiment_id": exp_id,
        "model": model.trace_name,
        "tp": model.tp,
        "workload": workload.name,
        "stages": [list(s) for s in spec.stages],
        "simulated_steps": int(n_steps),
        "sampled_steps": int(nk),
        "request_rows": int(len(requests)),
        "cycle_pairs": int(len(pair)),
        # pairs whose target also holds engine idle time (the next step waited for arrivals)
        "idle_pairs": int((~traj.next_contiguous[kept[pair]]).sum()),
        "mean_cycle_us": float(target_us.mean()) if len(pair) else None,
        "mean_cycle_all_steps_us": float(traj.step_cycle_us.mean()),
        "mean_decode_tokens": float(decode_tokens.mean()) if nk else None,
        "mean_decode_tokens_pairs": float(decode_tokens[pair].mean()) if len(pair) else None,
        "oracle_mape": float(ape.mean()) if len(pair) else None,
        "oracle_ape_sum": float(ape.sum()),
        "requests": int(result.requests.n),
        "successes": int(m.successes),
        "failures": int(m.failures),
        "preemptions": int(result.total_preemptions),
        "e2e_mean_s": m.e2e_mean_s,
        "ttft_mean_s": m.ttft_mean_s,
        "tpot_mean_s": m.tpot_mean_s,
        "simulate_s": round(sim_s, 2),
    }
    return ExperimentData(steps=steps, requests=requests, summary=summary)
