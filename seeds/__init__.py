"""Known step-time models, injected into the first population.

Each seed is a DEAP prefix string over operators and primitive names. Coefficients
are not written: the search fits one non-negative coefficient per additive term and
an intercept (``fitness.scoring``), so ``add(prefill_tokens, decode_tokens)`` *is*
BLIS's blackbox ``b0 + b1*prefill + b2*decode``.
"""

from __future__ import annotations

import re

SEEDS: dict[str, str] = {
    # BLIS blackbox: three coefficients per model (here: shared, which is its weakness)
    "blis_blackbox": "add(prefill_tokens, decode_tokens)",
    # Roofline: a step is bound by compute or by memory traffic, whichever is larger
    "roofline": "max(add(matmul_time_us, attention_time_us), add(weight_time_us, kv_io_time_us))",
    "roofline_aggregate": "max(matmul_time_us, add(weight_time_us, kv_io_time_us))",
    # BLIS "trained physics" style: a sum of physically motivated basis terms (weights,
    # KV traffic, compute, all-reduce bytes and launches, per-layer and per-request-per-layer
    # kernel costs)
    "trained_physics": (
        "add(add(add(weight_time_us, kv_io_time_us), add(matmul_time_us, attention_time_us)),"
        " add(add(allreduce_time_us, allreduce_calls), add(n_layers, mul(batch_size, n_layers))))"
    ),
    "trained_physics_aggregate": (
        "add(add(add(weight_time_us, kv_io_time_us), matmul_time_us),"
        " add(add(allreduce_time_us, allreduce_calls), add(n_layers, mul(batch_size, n_layers))))"
    ),
    # Measured kernels: the step's matmuls, decode and prefill attention at their measured
    # times, plus all-reduce launches and a per-step CPU cost (the intercept)
    "measured_kernels": (
        "add(add(gemm_time_us, decode_attention_time_us), add(prefill_attention_time_us, allreduce_calls))"
    ),
    "measured_kernels_roofline": (
        "add(max(gemm_time_us, weight_time_us), add(add(decode_attention_time_us, prefill_attention_time_us),"
        " allreduce_calls))"
    ),
    # Measured matmuls and KV traffic at HBM bandwidth, plus the costs that grow with depth
    # and TP, not with work: per-layer kernels (norms, activations, launches) and all-reduce latency
    "measured_gemm_overheads": "add(add(gemm_time_us, kv_io_time_us), add(n_layers, allreduce_calls))",
    # The same with vLLM's CPU side: a per-request cost (input preparation, sampling,
    # detokenisation, ~20 µs each) and a per-step cost that grows with the TP ranks to sync
    "measured_gemm_cpu": "add(add(gemm_time_us, kv_io_time_us), add(batch_size, tp))",
    # MoE-aware weight streaming: only the experts a batch touches are read
    "moe_weights": "add(mul(weight_time_us, moe_touched_fraction), add(kv_io_time_us, allreduce_calls))",
}


def seed_terminals(text: str) -> set[str]:
    """Identifiers in a seed that are not operators."""
    from primitives.language import OPERATORS

    return {t for t in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text) if t not in OPERATORS}


def seeds_for(primitive_names: list[str]) -> dict[str, str]:
    """The seeds whose terminals are all available in this run."""
    avail = set(primitive_names)
    return {name: text for name, text in SEEDS.items() if seed_terminals(text) <= avail}
