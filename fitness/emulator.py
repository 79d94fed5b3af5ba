"""A reference emulator of vLLM on H100: the hidden physics behind the embedded default data.

The project ships a synthetic step-trace dataset (``primitives/data/embedded``) so that a
search runs without the withheld real traces. This module makes it:

* **Serving** is the project's own closed-loop simulation (``fitness.sim.simulator``: the
  inference-perf load generator and the vLLM V1 scheduler with chunked prefill, prefix
  caching and preemption), run on the 16 experiments of the real study: 4 models
  (Llama-2-7B TP1, Llama-2-70B TP4, CodeLlama-34B TP2, Mixtral-8x7B TP2) x 4 workloads
  (general, codegen, roleplay, reasoning).
* **Step time** comes from a hidden physics model of its *own* (``EmulatorPhysics``),
  written independently of the project's primitives (``primitives.registry`` /
  ``primitives.compute`` are deliberately not used; only ``primitives.deployment``
  supplies architecture facts). A search that recovers it has learnt something real
  about the structure, not echoed its own basis functions. Per layer and per GPU:

  - weight streaming from HBM: the dense weights, or for MoE the attention weights
    plus only the experts the batch's tokens touch (exact expectation under uniform
    top-k routing: ``E * (1 - (1 - k/E) ** T)`` experts for ``T`` tokens);
  - matmul FLOPs with an efficiency that saturates with tokens (``mfu * n/(n+n_half)``,
    per expert for MoE), combined with the weight stream as a roofline ``max``;
  - attention per request: ``max(KV-read time, attention FLOP time)`` plus a
    per-request kernel overhead (block-table walk, split-K reduction);
  - two all-reduces per layer at TP > 1: latency + ring bytes / NVLink bandwidth;
  - a fixed kernel-launch cost per layer (plus a routing cost for MoE);

  then once per step: the LM head for the tokens that are sampled, a fixed sampler /
  input-preparation cost, and a CPU critical path growing per request and per token.
  Scheduling is asynchronous, so ``cycle = max(GPU time, CPU critical path) + gap``,
  times multiplicative lognormal noise (``noise_sigma``, 3 % by default, seeded).

  The constants are calibrated on the published figures: about 20 ms mean cycle for
  Llama-2-70B TP4 general at ~66 decode tokens per step, 15.7 ms for CodeLlama-34B
  TP2 general at ~53; per-token times of 7.2 ms (Llama-2-7B at ~9 running) to 16.6 ms
  (~83 running), 18.6-22 ms Llama-2-70B, 14.8-17 ms CodeLlama-34B, 19.2-20.5 ms
  Mixtral TP2.

* **Output** mirrors the real step traces (``synthetic_step_traces.parquet``, same flat schema and
  names) from a 10 % Bernoulli sample of steps, plus the full per-request detail of
  every sampled step (``synthetic_step_requests.parquet``) and ``metadata.json`` (generator
  version, seed, noise sigma, row counts and the *noise floor*: the step MAPE that an
  oracle knowing the noiseless physics gets on the shipped cycle-time targets).

The workloads mirror the real experiments' inputs (``results/config.yaml`` of each
run, hard-coded below: shared-prefix shape and load stages), but **every stage's
duration is scaled by** ``DURATION_SCALE`` (0.5) to keep the shipped data small; rates
and prompt shapes are unchanged. (So the reasoning runs build a shorter backlog than the
real ones: at seed 0 only Llama-2-7B, bound by its KV cache, loses requests to the
300 s client timeout and preempts; the other three run saturated without collapsing.)

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
* ``kv.blocks_free_gpu``: capacity (``Deployment.kv_capacity_tokens(0.9)``) minus the
  distinct blocks the batch holds after the step (``ceil(context/16)`` per request,
  prompt blocks shared through the prefix cache counted once per group/user).

With these constants the GPU side binds for all four deployments; the CPU path only
matters for much smaller models or far larger batches.

Regenerate with ``python -m fitness.emulator --out primitives/data/embedded --seed 0``
(deterministic: the same seed gives identical rows).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from primitives.deployment import KV_BLOCK_TOKENS, Deployment, DeploymentResolver
from primitives.data.roots import default_data_dir
from primitives.errors import InputError

GENERATOR_VERSION = "1.0.0"
DEFAULT_SEED = 0
DEFAULT_SAMPLE_FRACTION = 0.10  # the real tracer kept about 10 % of steps
DURATION_SCALE = 0.5  # every load stage runs for this fraction of its real duration
GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_DATA_DIR = default_data_dir()
STEP_TRACES_FILE = "synthetic_step_traces.parquet"
STEP_REQUESTS_FILE = "synthetic_step_requests.parquet"
METADATA_FILE = "metadata.json"

# ---------------------------------------------------------------------------
# The experiments (inputs of the real runs, read once from results/config.yaml)


@dataclass(frozen=True)
class Workload:
    """inference-perf shared-prefix data and constant-rate load stages."""

    name: str
    num_groups: int
    num_prompts_per_group: int
    system_prompt_len: int
    question_len: int
    output_len: int
    stages: tuple[tuple[float, float], ...]  # (rate req/s, duration s) at full length

    def scaled_stages(self, scale: float = DURATION_SCALE) -> tuple[tuple[float, float], ...]:
        return tuple((rate, duration * scale) for rate, duration in self.stages)


# vLLM server limits, identical in every run (exp-config.yaml)
MAX_NUM_BATCHED_TOKENS = 2048
MAX_NUM_SEQS = 128
MAX_MODEL_LEN = 4096
CLIENT_TIMEOUT_S = 300.0  # aiohttp's default total timeout in inference-perf

WORKLOADS: dict[str, Workload] = {
    "general": Workload("general", 10, 10, 100, 447, 248, ((8.0, 600.0), (20.0, 600.0))),
    "codegen": Workload("codegen", 10, 10, 100, 466, 247, ((5.0, 600.0), (10.0, 600.0))),
    "roleplay": Workload("roleplay", 10, 10, 150, 600, 251, ((6.0, 1200.0),)),
    "reasoning": Workload("reasoning", 10, 10, 100, 934, 1448, ((4.0, 1200.0),)),
}


@dataclass(frozen=True)
class ServedModel:
    trace_name: str  # the name the real step traces use
    hf_name: str
    tp: int


SERVED_MODELS: tuple[ServedModel, ...] = (
    ServedModel("llama-2-7b", "meta-llama/Llama-2-7b-hf", 1),
    ServedModel("llama-2-70b", "meta-llama/Llama-2-70b-hf", 4),
    ServedModel("codellama-34b", "codellama/CodeLlama-34b-Instruct-hf", 2),
    ServedModel("mixtral-8x7b-v0-1", "mistralai/Mixtral-8x7B-v0.1", 2),
)


def experiment_id(model: ServedModel, workload: Workload) -> str:
    return f"synthetic-{model.trace_name}-tp{model.tp}-{workload.name}"


def all_experiments() -> list[tuple[ServedModel, Workload]]:
    return [(m, w) for m in SERVED_MODELS for w in WORKLOADS.values()]


# ---------------------------------------------------------------------------
# The hidden physics


@dataclass(frozen=True)
class EmulatorPhysics:
    """Hardware-efficiency and overhead constants of the hidden step-time model.

    Units are in the names. The defaults are the calibrated ones (see module doc).
    """

    hbm_efficiency: float = 0.90  # achieved fraction of HBM bandwidth for streaming reads
    mfu_max: float = 0.75  # matmul efficiency reached by large GEMMs
    mfu_half_tokens: float = 64.0  # rows at which a GEMM reaches half of mfu_max
    attention_flops_efficiency: float = 0.45  # FlashAttention fraction of peak
    attention_request_overhead_us: float = 0.12  # per request per layer (block table, split-K)
    launch_us_per_layer: float = 14.0  # kernel launches / graph nodes per decoder layer
    moe_routing_us_per_layer: float = 8.0  # top-k, permute and un-permute kernels
    allreduce_base_latency_us: float = 4.0  # per all-reduce, plus ...
    allreduce_latency_us_per_peer: float = 6.0  # ... per extra rank
    nvlink_efficiency: float = 0.70  # achieved fraction of per-direction NVLink bandwidth
    sampler_fixed_us: float = 850.0  # sampler, logits processing, input staging
    sampler_us_per_request: float = 1.0
    cpu_fixed_us: float = 900.0  # CPU critical path of one engine step (async scheduling)
    cpu_us_per_request: float = 22.0
    cpu_us_per_token: float = 0.15
    gap_us: float = 250.0  # idle gap between two consecutive steps
    noise_sigma: float = 0.03  # multiplicative lognormal noise of each cycle


@dataclass(frozen=True)
class _Arch:
    """Per-GPU sizes the physics needs, derived once from a Deployment."""

    n_layers: int
    tp: int
    hidden: int
    dtype_bytes: int
    attn_params_per_gpu: float  # per layer (q, k, v, o), this GPU's shard
    expert_params_per_gpu: float  # per layer, one gated MLP (one expert for MoE)
    router_params: float  # per layer (replicated)
    n_experts: int
    experts_per_tok: int
    lm_head_params_per_gpu: float
    kv_bytes_per_token_per_layer_per_gpu: float
    attn_flops_per_pair_per_layer_per_gpu: float  # QK^T and PV for one (query, key) pair
    hbm_bytes_per_us: float
    flops_per_us: float
    nvlink_bytes_per_us: float  # per direction

    @classmethod
    def of(cls, dep: Deployment) -> "_Arch":
        m, g, tp = dep.model, dep.gpu, dep.tp
        return cls(
            n_layers=m.n_layers,
            tp=tp,
            hidden=m.hidden_size,
            dtype_bytes=m.dtype_bytes,
            attn_params_per_gpu=m.attention_params_per_layer / tp,
            expert_params_per_gpu=m.expert_params / tp,
            router_params=float(m.hidden_size * m.n_experts) if m.is_moe else 0.0,
            n_experts=m.n_experts,
            experts_per_tok=m.experts_per_tok,
            lm_head_params_per_gpu=m.vocab_size * m.hidden_size / tp,
            kv_bytes_per_token_per_layer_per_gpu=2.0 * m.n_kv_heads * m.head_dim * m.dtype_bytes / tp,
            attn_flops_per_pair_per_layer_per_gpu=4.0 * m.n_heads * m.head_dim / tp,
            hbm_bytes_per_us=g.hbm_bytes_per_s / 1e6,
            flops_per_us=g.dense_flops_per_s / 1e6,
            nvlink_bytes_per_us=g.nvlink_bytes_per_s / 2.0 / 1e6,
        )


def _segment_sum(values: np.ndarray, indptr: np.ndarray) -> np.ndarray:
    """Sum of ``values[indptr[i]:indptr[i+1]]`` for every segment (empty -> 0)."""
    csum = np.concatenate(([0.0], np.cumsum(values, dtype=np.float64)))
    return csum[indptr[1:]] - csum[indptr[:-1]]


class HiddenPhysics:
    """The noiseless step-time model of one deployment (vectorised over steps)."""

    def __init__(self, deployment: Deployment, physics: EmulatorPhysics | None = None):
        self.deployment = deployment
        self.physics = physics or EmulatorPhysics()
        self.arch = _Arch.of(deployment)

    # All inputs: per-request int arrays of many steps, grouped by CSR ``indptr``.
    def cycle_time_us_csr(self, indptr, progress, new_tokens, input_len, output_len) -> np.ndarray:
        """Noiseless cycle time (µs) of each step of a CSR batch list."""
        p, a = self.physics, self.arch
        indptr = np.asarray(indptr, dtype=np.int64)
        progress = np.asarray(progress, dtype=np.float64)
        new = np.asarray(new_tokens, dtype=np.float64)
        inp = np.asarray(input_len, dtype=np.float64)
        n_steps = len(indptr) - 1
        ones = np.ones_like(new)

        tokens = _segment_sum(new, indptr)  # T: tokens through the layers this step
        n_reqs = _segment_sum(ones, indptr)
        # requests that sample a token this step: decodes, and prefills finishing their prompt
        samples = (progress + new >= inp).astype(np.float64)
        n_samples = _segment_sum(samples, indptr)

        # -- linear layers: roofline max(weight stream, matmul) per layer ---------------
        flops_rate = a.flops_per_us * p.mfu_max
        hbm_rate = a.hbm_bytes_per_us * p.hbm_efficiency
        h = p.mfu_half_tokens
        if a.n_experts > 1:
            k, e = a.experts_per_tok, a.n_experts
            touched = e * (1.0 - (1.0 - k / e) ** tokens)  # expected experts hit by T tokens
            weight_bytes = (a.attn_params_per_gpu + a.router_params + touched * a.expert_params_per_gpu) * a.dtype_bytes
            # GEMM time with saturating efficiency: 2 P (n + n_half) / (peak mfu), summed
            # over the attention projections (n = T) and every touched expert (sum n = kT)
            mm_us = 2.0 * (
                a.attn_params_per_gpu * (tokens + h) + a.expert_params_per_gpu * (k * tokens + touched * h)
            ) / flops_rate
            moe_us = p.moe_routing_us_per_layer
        else:
            weight_bytes = np.full(n_steps, (a.attn_params_per_gpu + a.expert_params_per_gpu) * a.dtype_bytes)
            mm_us = 2.0 * (a.attn_params_per_gpu + a.expert_params_per_gpu) * (tokens + h) / flops_rate
            moe_us = 0.0
        linear_us = np.maximum(weight_bytes / hbm_rate, mm_us)
        linear_us = np.where(tokens > 0, linear_us, 0.0)

        # -- attention, per request: max(KV read, FLOPs) + per-request overhead ---------
        ctx = progress + new  # keys each query attends to, at most
        kv_read_us = ctx * a.kv_bytes_per_token_per_layer_per_gpu / hbm_rate
        pairs = new * (progress + (new + 1.0) / 2.0)  # causal (query, key) pairs
        attn_flop_us = pairs * a.attn_flops_per_pair_per_layer_per_gpu / (a.flops_per_us * p.attention_flops_efficiency)
        attn_req_us = np.maximum(kv_read_us, attn_flop_us) + p.attention_request_overhead_us
        attention_us = _segment_sum(attn_req_us, indptr)

        # -- tensor-parallel all-reduce: two per layer (after attention and after MLP) ---
        if a.tp > 1:
            latency = p.allreduce_base_latency_us + p.allreduce_latency_us_per_peer * (a.tp - 1)
            ring_bytes = 2.0 * (a.tp - 1) / a.tp * tokens * a.hidden * a.dtype_bytes
            allreduce_us = 2.0 * (latency + ring_bytes / (a.nvlink_bytes_per_us * p.nvlink_efficiency))
        else:
            allreduce_us = np.zeros(n_steps)

        per_layer_us = linear_us + attention_us + allreduce_us + p.launch_us_per_layer + moe_us
        layers_us = a.n_layers * per_layer_us

        # -- once per step: LM head for the sampled rows, sampler ------------------------
        head_bytes = a.lm_head_params_per_gpu * a.dtype_bytes
        head_us = np.maximum(head_bytes / hbm_rate, 2.0 * a.lm_head_params_per_gpu * (n_samples + h) / flops_rate)
        if a.tp > 1:  # logits are gathered across ranks
            head_us = head_us + p.allreduce_base_latency_us + p.allreduce_latency_us_per_peer * (a.tp - 1)
        sampler_us = p.sampler_fixed_us + p.sampler_us_per_request * n_samples
        gpu_us = layers_us + head_us + sampler_us

        cpu_us = p.cpu_fixed_us + p.cpu_us_per_request * n_reqs + p.cpu_us_per_token * tokens
        cycle_us = np.maximum(gpu_us, cpu_us) + p.gap_us
        return np.where(n_reqs > 0, cycle_us, 0.0)

    def cycle_time_us(self, progress, new_tokens, input_len, output_len) -> float:
        """Noiseless cycle time (µs) of one batch."""
        n = len(progress)
        return float(self.cycle_time_us_csr(np.array([0, n]), progress, new_tokens, input_len, output_len)[0])


def expected_noise_floor_mape(sigma: float) -> float:
    """MAPE of the noiseless physics against cycles with lognormal noise of SIGMA.

    ``E|1 - exp(-sigma Z)| = exp(sigma^2 / 2) (2 Phi(sigma) - 1)`` (about 0.8 sigma); idle
    gaps and other non-step time in the targets only add to it.
    """
    from math import erf, exp, sqrt

    return exp(sigma * sigma / 2.0) * erf(sigma / sqrt(2.0))


# ---------------------------------------------------------------------------
# The emulated server: the hidden physics as a LatencyModel of fitness.sim.simulator


@dataclass(frozen=True)
class ServerOverheads:
    """The emulated server's non-step latencies (µs), as ``fitness.sim.simulator`` reads them."""

    queueing_base_us: float = 2500.0  # HTTP + tokenisation, arrival -> scheduler queue
    queueing_per_input_token_us: float = 1.0
    output_token_processing_us: float = 300.0  # detokenise + SSE, engine -> client
    scheduling_processing_us: float = 0.0  # already inside the cycle (CPU path and gap)
    preemption_processing_us: float = 150.0  # freeing blocks, requeueing, per preemption


class EmulatedVLLM:
    """Duck-typed ``fitness.sim.simulator.LatencyModel``: hidden physics plus seeded noise.

    ``step_time_us`` draws one lognormal factor per call from its own generator, so a
    run is deterministic for a seed (the simulator calls it once per step, in order).
    """

    def __init__(self, deployment: Deployment, physics: EmulatorPhysics | None = None,
                 overheads: ServerOverheads | None = None, seed: int | np.random.SeedSequence = 0):
        self.hidden = HiddenPhysics(deployment, physics)
        self.physics = self.hidden.physics
        o = overheads or ServerOverheads()
        self.overheads = o
        self.queueing_base_us = o.queueing_base_us
        self.queueing_per_input_token_us = o.queueing_per_input_token_us
        self.output_token_processing_us = o.output_token_processing_us
        self.scheduling_processing_us = o.scheduling_processing_us
        self.preemption_processing_us = o.preemption_processing_us
        self._rng = np.random.default_rng(seed)
        self._indptr = np.zeros(2, dtype=np.int64)

    @property
    def noise_sigma(self) -> float:
        """Lognormal sigma of the cycle noise (the noise floor is about 0.8 sigma MAPE)."""
        return self.physics.noise_sigma

    def noiseless_step_time_us(self, progress, new_tokens, input_len, output_len) -> float:
        self._indptr[1] = len(new_tokens)
        return float(self.hidden.cycle_time_us_csr(self._indptr, progress, new_tokens, input_len, output_len)[0])

    def step_time_us(self, progress, new_tokens, input_len, output_len) -> float:
        base = self.noiseless_step_time_us(progress, new_tokens, input_len, output_len)
        sigma = self.physics.noise_sigma
        return base * float(np.exp(sigma * self._rng.standard_normal())) if sigma > 0 else base

    def queueing_time_us(self, input_len) -> np.ndarray:
        return self.queueing_base_us + self.queueing_per_input_token_us * np.asarray(input_len, dtype=np.float64)


# ---------------------------------------------------------------------------
# Scheduler CPU time (step.duration_us): a distractor with the real traces' shape


def scheduler_cpu_us(running: np.ndarray, scheduled_tokens: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The tracer's ``step.duration_us``: the scheduler's own Python time, not the step.

    Tens to hundreds of µs growing with the running requests, plus (as in the real
    traces, where the median jumps from ~0.3 ms to ~5 ms above ~60 running requests)
    occasional millisecond-long pauses whose odds grow with the live request objects.
    """
    running = np.asarray(running, dtype=np.float64)
    base = (40.0 + 6.5 * running + 0.03 * np.asarray(scheduled_tokens, dtype=np.float64))
    base = base * np.exp(0.35 * rng.standard_normal(len(running)))
    p_pause = 0.8 / (1.0 + np.exp(-(running - 60.0) / 8.0))
    pause = (rng.random(len(running)) < p_pause) * rng.exponential(5000.0, len(running))
    return np.maximum(np.rint(base + pause), 1.0)


# ---------------------------------------------------------------------------
# One experiment: simulate, sample 10 % of steps, build the flat rows


STEP_COLUMNS = (
    "experiment_id", "model", "workload", "tp", "step.id", "step.ts_start_ns", "step.ts_end_ns",
    "step.duration_us", "queue.running_depth", "queue.waiting_depth", "batch.num_prefill_reqs",
    "batch.num_decode_reqs", "batch.scheduled_tokens", "batch.prefill_tokens", "batch.decode_tokens",
    "batch.num_finished", "batch.num_preempted", "kv.usage_gpu_ratio", "kv.blocks_total_gpu",
    "kv.blocks_free_gpu",
)
REQUEST_COLUMNS = ("experiment_id", "step.id", "progress", "new_tokens", "input_len", "output_len")
TS_ORIGIN_NS = 10_000_000_000_000  # a monotonic-clock origin, like the real traces'


def experiment_spec(model: ServedModel, workload: Workload, duration_scale: float = DURATION_SCALE):
    from primitives.data.experiments import ExperimentSpec

    return ExperimentSpec(
        name=experiment_id(model, workload),
        model=model.hf_name,
        tp=model.tp,
        stages=workload.scaled_stages(duration_scale),
        num_groups=workload.num_groups,
        num_prompts_per_group=workload.num_prompts_per_group,
        system_prompt_len=workload.system_prompt_len,
        question_len=workload.question_len,
        output_len=workload.output_len,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        request_timeout_s=CLIENT_TIMEOUT_S,
    )


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


def _waiting_depth(traj, status: np.ndarray, kept_steps: np.ndarray) -> np.ndarray:
    """Requests queued at the scheduler after each kept step was scheduled.

    A request waits from its enqueue until its first admission (or its client-side abort),
    and again between a preemption and its re-admission.
    """
    from fitness.sim.simulator import ABORTED, REJECTED

    start = traj.step_start_us
    n_steps = len(start)
    enq = traj.send_us + traj.queueing_us
    # first wait: [first step starting at/after enqueue, admission step)
    ok = np.isfinite(enq) & (status != REJECTED)
    first = np.searchsorted(start, enq[ok], side="left")
    end = traj.admit_step[ok].copy()
    never = end < 0
    deadline = np.searchsorted(start, traj.send_us[ok] + CLIENT_TIMEOUT_S * 1e6, side="left")
    end[never] = np.where(status[ok][never] == ABORTED, deadline[never], n_steps)
    diff = np.zeros(n_steps + 1, dtype=np.int64)
    np.add.at(diff, np.minimum(first, n_steps), 1)
    np.add.at(diff, np.minimum(np.maximum(end, first), n_steps), -1)
    # re-waits after preemption: a request's progress falls between two of its rows
    if traj.step_preemptions.sum() > 0:
        req = traj.batch_request
        step = traj.batch_step
        order = np.lexsort((step, req))
        r, s = req[order], step[order]
        p, n = traj.batch_progress[order], traj.batch_new_tokens[order]
        same = r[1:] == r[:-1]
        fell = same & (p[1:] < p[:-1] + n[:-1])
        np.add.at(diff, s[:-1][fell] + 1, 1)
        np.add.at(diff, s[1:][fell], -1)
    depth = np.cumsum(diff)[:n_steps]
    return depth[kept_steps]


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


def generate_experiment(model: ServedModel, workload: Workload, seed: int = DEFAULT_SEED, index: int = 0,
                        physics: EmulatorPhysics | None = None, duration_scale: float = DURATION_SCALE,
                        sample_fraction: float = DEFAULT_SAMPLE_FRACTION) -> ExperimentData:
    """Simulate one experiment and return its sampled flat rows and per-request detail."""
    import pandas as pd

    from fitness.sim.loadgen import build_load
    from fitness.sim.simulator import simulate

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
    waiting = _waiting_depth(traj, status, kept)
    blocks_total = result.kv_capacity_blocks
    used = np.minimum(_kv_blocks_used(traj, load, kept), blocks_total)
    free = blocks_total - used

    ts_start_ns = TS_ORIGIN_NS + np.rint(traj.step_start_us * 1000.0).astype(np.int64)
    cycle_us = traj.step_cycle_us[kept]
    cpu_us = scheduler_cpu_us(counts, prefill_tokens + decode_tokens, np.random.default_rng(seeds["cpu"]))
    cpu_us = np.minimum(cpu_us, np.floor(0.9 * cycle_us)).astype(np.int64)  # ends inside its own cycle

    steps = pd.DataFrame({
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
    }, columns=list(STEP_COLUMNS))
    requests = pd.DataFrame({
        "experiment_id": exp_id,
        "step.id": kept[step_of_row].astype(np.int32),
        "progress": prog.astype(np.int32),
        "new_tokens": new.astype(np.int32),
        "input_len": inl.astype(np.int32),
        "output_len": outl.astype(np.int32),
    }, columns=list(REQUEST_COLUMNS))

    # calibration figures and the oracle's error on this experiment's targets
    pair = np.flatnonzero(np.diff(kept) == 1)
    target_us = np.diff(ts_start_ns[kept])[pair] / 1000.0
    noiseless = server.hidden.cycle_time_us_csr(np.r_[0, np.cumsum(counts)], prog, new, inl, outl)
    oracle_us = (noiseless + server.scheduling_processing_us
                 + server.preemption_processing_us * traj.step_preemptions[kept])[pair]
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


# ---------------------------------------------------------------------------
# The whole dataset


def _write_parquet(df, path: Path, delta_columns: tuple[str, ...] = ()) -> None:
    """zstd Parquet, one row group, no pandas index; integer detail columns delta-encoded."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(df, preserve_index=False)
    encodings = {c: "DELTA_BINARY_PACKED" for c in delta_columns}
    pq.write_table(
        table, path, compression="zstd", compression_level=19, row_group_size=max(len(df), 1),
        use_dictionary=[c for c in df.columns if c not in encodings], column_encoding=encodings or None,
        write_statistics=False,
    )


def simulator_fingerprint() -> str:
    """Digest of the serving code the data depends on (regenerate when it changes)."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in ("simulator.py", "loadgen.py", "emulator.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


def _frame_digest(df) -> str:
    import pandas as pd

    return hashlib.sha256(pd.util.hash_pandas_object(df, index=False).values.tobytes()).hexdigest()[:16]


def generate(out_dir: Path | str = DEFAULT_DATA_DIR, seed: int = DEFAULT_SEED, jobs: int = 2,
             physics: EmulatorPhysics | None = None, duration_scale: float = DURATION_SCALE,
             sample_fraction: float = DEFAULT_SAMPLE_FRACTION, experiments: list[str] | None = None,
             verbose: bool = True) -> dict:
    """Simulate every experiment and write the three files to OUT_DIR; returns the metadata."""
    import pandas as pd
    from joblib import Parallel, delayed

    physics = physics or EmulatorPhysics()
    todo = [(i, m, w) for i, (m, w) in enumerate(all_experiments())
            if experiments is None or experiment_id(m, w) in experiments or w.name in experiments
            or m.trace_name in experiments]
    if not todo:
        raise InputError("--experiments", "experiments", "no experiment matches; expected ids such as "
                         f"{experiment_id(SERVED_MODELS[0], WORKLOADS['general'])}, model names or workloads")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # biggest first so two workers finish together
    order = sorted(todo, key=lambda t: -sum(r * d * t[2].output_len for r, d in t[2].stages))
    parts = Parallel(n_jobs=jobs, backend="loky")(
        delayed(generate_experiment)(m, w, seed, i, physics, duration_scale, sample_fraction) for i, m, w in order
    )
    parts = sorted(parts, key=lambda p: p.summary["experiment_id"])
    steps = pd.concat([p.steps for p in parts], ignore_index=True)
    requests = pd.concat([p.requests for p in parts], ignore_index=True)
    _write_parquet(steps, out_dir / STEP_TRACES_FILE, ("step.id", "step.ts_start_ns", "step.ts_end_ns"))
    _write_parquet(requests, out_dir / STEP_REQUESTS_FILE, ("step.id", "progress", "new_tokens", "input_len", "output_len"))
    elapsed = time.perf_counter() - t0

    pairs = sum(p.summary["cycle_pairs"] for p in parts)
    ape_sum = sum(p.summary.pop("oracle_ape_sum") for p in parts)
    sim_seconds = {p.summary["experiment_id"]: p.summary.pop("simulate_s") for p in parts}  # not stored: varies
    metadata = {
        "generator": "fitness.emulator",
        "generator_version": GENERATOR_VERSION,
        "seed": int(seed),
        "sources_sha256": simulator_fingerprint(),  # fitness/simulator.py, loadgen.py, emulator.py
        "command": f"python -m fitness.emulator --out <dir> --seed {seed}",
        "noise_sigma": physics.noise_sigma,
        "noise_floor_mape": ape_sum / pairs if pairs else None,
        "noise_floor_mape_expected": expected_noise_floor_mape(physics.noise_sigma),
        "noise_floor_note": (
            "step MAPE of an oracle that knows the noiseless hidden physics, over every "
            "cycle-time target (consecutive sampled step ids) of the shipped data; no step-time "
            "model can expect to beat it"
        ),
        "sample_fraction": sample_fraction,
        "duration_scale": duration_scale,
        "gpu": "H100 SXM",
        "physics": asdict(physics),
        "server_overheads": asdict(ServerOverheads()),
        "files": {
            STEP_TRACES_FILE: {"rows": int(len(steps)), "sha256_rows": _frame_digest(steps),
                               "bytes": (out_dir / STEP_TRACES_FILE).stat().st_size},
            STEP_REQUESTS_FILE: {"rows": int(len(requests)), "sha256_rows": _frame_digest(requests),
                                 "bytes": (out_dir / STEP_REQUESTS_FILE).stat().st_size},
        },
        "cycle_pairs": int(pairs),
        "experiments": [p.summary for p in parts],
    }
    (out_dir / METADATA_FILE).write_text(json.dumps(metadata, indent=1, sort_keys=False) + "\n")
    if verbose:
        _print_report(metadata, elapsed, sim_seconds)
    metadata["_elapsed_s"] = elapsed
    return metadata


def _print_report(meta: dict, elapsed: float, sim_seconds: dict[str, float]) -> None:
    print(f"{'experiment':44s} {'steps':>7s} {'rows':>6s} {'pairs':>5s} {'cycle ms':>8s} {'decode':>6s} "
          f"{'oracle':>6s} {'ok/fail':>11s} {'preempt':>7s} {'sim s':>6s}")
    for e in meta["experiments"]:
        cyc = e["mean_cycle_us"] / 1e3 if e["mean_cycle_us"] else float("nan")
        print(f"{e['experiment_id']:44s} {e['simulated_steps']:7d} {e['sampled_steps']:6d} {e['cycle_pairs']:5d} "
              f"{cyc:8.2f} {e['mean_decode_tokens'] or 0:6.1f} {100 * (e['oracle_mape'] or 0):5.2f}% "
              f"{e['successes']:5d}/{e['failures']:<5d} {e['preemptions']:7d} {sim_seconds[e['experiment_id']]:6.1f}")
    f = meta["files"]
    print(f"rows: {f[STEP_TRACES_FILE]['rows']} steps ({f[STEP_TRACES_FILE]['bytes'] / 1e6:.2f} MB), "
          f"{f[STEP_REQUESTS_FILE]['rows']} request rows ({f[STEP_REQUESTS_FILE]['bytes'] / 1e6:.2f} MB); "
          f"{meta['cycle_pairs']} cycle pairs; noise floor MAPE {100 * meta['noise_floor_mape']:.2f}% "
          f"(sigma {meta['noise_sigma']}); {elapsed:.0f} s")


def load_metadata(data_dir: Path | str = DEFAULT_DATA_DIR) -> dict:
    """The metadata of a generated dataset (``metadata.json``)."""
    path = Path(data_dir) / METADATA_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(path, None, "no metadata.json here; regenerate with python -m fitness.emulator") from None
    except json.JSONDecodeError as exc:
        raise InputError(path, None, f"not valid JSON (line {exc.lineno}: {exc.msg})") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fitness.emulator",
        description="Regenerate the embedded synthetic step-trace dataset (deterministic for a seed).",
    )
    parser.add_argument("--out", default=str(DEFAULT_DATA_DIR), help="output directory (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="master seed (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=2, help="parallel experiments (default: %(default)s)")
    parser.add_argument("--duration-scale", type=float, default=DURATION_SCALE,
                        help="fraction of each load stage's real duration (default: %(default)s)")
    parser.add_argument("--noise-sigma", type=float, default=EmulatorPhysics().noise_sigma,
                        help="lognormal sigma of the cycle noise (default: %(default)s)")
    parser.add_argument("--experiments", nargs="*", default=None,
                        help="only these experiment ids, model names or workloads (default: all 16)")
    args = parser.parse_args(argv)
    try:
        if not 0.0 < args.duration_scale <= 1.0:
            raise InputError("--duration-scale", None, f"expected a fraction in (0, 1], got {args.duration_scale}")
        if not 0.0 <= args.noise_sigma < 1.0:
            raise InputError("--noise-sigma", None, f"expected a sigma in [0, 1), got {args.noise_sigma}")
        if args.jobs < 1:
            raise InputError("--jobs", None, f"expected a positive number of jobs, got {args.jobs}")
        generate(args.out, args.seed, args.jobs, replace(EmulatorPhysics(), noise_sigma=args.noise_sigma),
                 args.duration_scale, experiments=args.experiments)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
