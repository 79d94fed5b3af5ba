"""The hidden physics: the emulator's own step-time model of vLLM on H100.

Written independently of the project's primitives (``primitives.registry`` /
``primitives.compute`` are deliberately not used; only ``primitives.deployment``
supplies architecture facts), so that a search that recovers it has learnt something
real about the structure, not echoed its own basis functions. Per layer and per GPU:

- weight streaming from HBM: the dense weights, or for MoE the attention weights plus
  only the experts the batch's tokens touch (exact expectation under uniform top-k
  routing: ``E * (1 - (1 - k/E) ** T)`` experts for ``T`` tokens);
- matmul FLOPs with an efficiency that saturates with tokens (``mfu * n/(n+n_half)``,
  per expert for MoE), combined with the weight stream as a roofline ``max``;
- attention per request: ``max(KV-read time, attention FLOP time)`` plus a per-request
  kernel overhead (block-table walk, split-K reduction);
- two all-reduces per layer at TP > 1: latency + ring bytes / NVLink bandwidth;
- a fixed kernel-launch cost per layer (plus a routing cost for MoE);

then once per step: the LM head for the tokens that are sampled, a fixed sampler /
input-preparation cost, and a CPU critical path growing per request and per token.
Scheduling is asynchronous, so ``cycle = max(GPU time, CPU critical path) + gap``; the
emulated server (``fitness.emulator.server``) multiplies it by lognormal noise
(``noise_sigma``, 3 % by default, seeded).

The constants are calibrated on the published figures: about 20 ms mean cycle for
Llama-2-70B TP4 general at ~66 decode tokens per step, 15.7 ms for CodeLlama-34B TP2
general at ~53; per-token times of 7.2 ms (Llama-2-7B at ~9 running) to 16.6 ms (~83
running), 18.6-22 ms Llama-2-70B, 14.8-17 ms CodeLlama-34B, 19.2-20.5 ms Mixtral TP2.
With these constants the GPU side binds for all four deployments; the CPU path only
matters for much smaller models or far larger batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from primitives.deployment import Deployment


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
            mm_us = (
                2.0
                * (a.attn_params_per_gpu * (tokens + h) + a.expert_params_per_gpu * (k * tokens + touched * h))
                / flops_rate
            )
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
