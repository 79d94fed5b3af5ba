"""The deployment constants as sympy expressions of the deployment's facts.

Each constant the primitives read (``registry.CONSTANT_UNITS``) is defined here once,
over the facts a HuggingFace ``config.json``, a GPU datasheet and the TP degree give.
``Deployment.constants`` evaluates these expressions exactly (rational arithmetic, one
rounding to float64 at the end, as the former integer code did), and the Go export
prints the very same expressions, so a backend computes them at construction from
whatever model, GPU and TP the simulator names (``translate_go.blis_deployment``).
"""

from __future__ import annotations

from functools import lru_cache

import sympy as sp

from .registry import CONSTANT_UNITS

# --- facts: name -> unit ---------------------------------------------------------
MODEL_FACTS = {
    "hidden_size": "dims",
    "intermediate_size": "dims",
    "n_layers": "layers",
    "n_heads": "heads",
    "n_kv_heads": "heads",
    "head_dim": "dims",
    "vocab_size": "tokens",
    "n_experts": "experts",  # 1 for dense models
    "experts_per_tok": "experts",  # 1 for dense models
    "dtype_bytes": "bytes/param",
    "tied_embeddings": "0/1",  # tie_word_embeddings
}
GPU_FACTS = {
    "dense_flops_per_s": "flop/s",
    "hbm_bytes_per_s": "bytes/s",
    "nvlink_bytes_per_s": "bytes/s",
}
DEPLOYMENT_FACTS = {"tp_degree": "GPUs"}
FACT_UNITS = {**MODEL_FACTS, **GPU_FACTS, **DEPLOYMENT_FACTS}
X = {name: sp.Symbol(f"fact_{name}", positive=True) for name in FACT_UNITS}

_h, _i, _L = X["hidden_size"], X["intermediate_size"], X["n_layers"]
_heads, _kv, _d = X["n_heads"], X["n_kv_heads"], X["head_dim"]
_e, _k, _tp = X["n_experts"], X["experts_per_tok"], X["tp_degree"]
_is_moe = sp.StrictGreaterThan(_e, 1)

ATTENTION_PARAMS_PER_LAYER = 2 * _h * _heads * _d + 2 * _h * _kv * _d  # Q and O, K and V
EXPERT_PARAMS = 3 * _h * _i  # one gated MLP (one expert for MoE)
ROUTER_PARAMS = sp.Piecewise((_h * _e, _is_moe), (0, True))
MLP_PARAMS_PER_LAYER = _e * EXPERT_PARAMS + ROUTER_PARAMS
EMBEDDING_PARAMS = (2 - X["tied_embeddings"]) * X["vocab_size"] * _h
TOTAL_PARAMS = _L * (ATTENTION_PARAMS_PER_LAYER + MLP_PARAMS_PER_LAYER) + EMBEDDING_PARAMS + (2 * _L + 1) * _h
# Parameters one token multiplies through in the layers (top-k experts for MoE).
ACTIVE_MATMUL_PARAMS = _L * (ATTENTION_PARAMS_PER_LAYER + _k * EXPERT_PARAMS + ROUTER_PARAMS)
KV_BYTES_PER_TOKEN = 2 * _L * _kv * _d * X["dtype_bytes"]  # K and V of every layer, all GPUs

CONSTANT_FORMULAS: dict[str, sp.Expr] = {
    "weight_bytes_per_gpu": TOTAL_PARAMS * X["dtype_bytes"] / _tp,
    "active_params_per_gpu": ACTIVE_MATMUL_PARAMS / _tp,
    "kv_bytes_per_token_per_gpu": KV_BYTES_PER_TOKEN / _tp,
    "attn_flops_per_token_pair_per_gpu": 4 * _L * _heads * _d / _tp,
    "allreduce_bytes_per_token": 2 * _L * _h * X["dtype_bytes"],
    "hbm_bytes_per_us": X["hbm_bytes_per_s"] / 10**6,
    "dense_flops_per_us": X["dense_flops_per_s"] / 10**6,
    "nvlink_bytes_per_us": X["nvlink_bytes_per_s"] / 10**6,
    "n_layers": _L,
    "tp": _tp,
    "moe_topk_ratio": _k / _e,
}
assert set(CONSTANT_FORMULAS) == set(CONSTANT_UNITS), "every deployment constant needs a formula"


def _exact(value: float | int) -> sp.Rational:
    return sp.Integer(value) if isinstance(value, int) else sp.Rational(float(value))


@lru_cache(maxsize=256)
def _evaluate(items: tuple[tuple[str, float | int], ...]) -> tuple[tuple[str, float], ...]:
    subs = {X[name]: _exact(value) for name, value in items}
    return tuple((name, float(expr.xreplace(subs))) for name, expr in CONSTANT_FORMULAS.items())


def evaluate_constants(facts: dict[str, float | int]) -> dict[str, float]:
    """Every deployment constant for FACTS (all of ``FACT_UNITS``), computed exactly."""
    missing = sorted(set(FACT_UNITS) - set(facts))
    if missing:
        raise KeyError(f"deployment facts missing: {missing}")
    return dict(_evaluate(tuple(sorted((k, facts[k]) for k in FACT_UNITS))))


__all__ = ["CONSTANT_FORMULAS", "DEPLOYMENT_FACTS", "FACT_UNITS", "GPU_FACTS", "MODEL_FACTS", "X", "evaluate_constants"]
