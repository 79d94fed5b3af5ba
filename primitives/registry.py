"""The physics primitives, each defined once as a sympy expression.

Two layers, both declarative:

* ``FEATURES`` reduce per-request quantities over a batch (a sum, a count or a max of
  a sympy expression in the BLIS ``Request`` fields, optionally only over requests
  in one phase). Real traces carry some of them as aggregates (``aggregate=True``).
* ``PRIMITIVES`` are sympy expressions of features and named deployment constants
  (``Deployment.constants``); they are the GP terminals, each with its unit.

The Python evaluator (``primitives.compute``) lambdifies these expressions, and the
Go generator (``translate_go``) prints the very same expressions, so the two can not
drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

# --- Per-request fields, as BLIS's Request offers them -------------------------
PROGRESS = sp.Symbol("progress", nonnegative=True)  # ProgressIndex: tokens already in the KV cache
NEW_TOKENS = sp.Symbol("new_tokens", nonnegative=True)  # NumNewTokens: tokens computed this step
INPUT_LEN = sp.Symbol("input_len", nonnegative=True)  # len(InputTokens)
OUTPUT_LEN = sp.Symbol("output_len", nonnegative=True)  # len(OutputTokens): tokens generated so far
REQUEST_FIELDS = (PROGRESS, NEW_TOKENS, INPUT_LEN, OUTPUT_LEN)
# Go field behind each per-request symbol (used by the Go generator).
REQUEST_GO_FIELDS = {
    "progress": "float64(r.ProgressIndex)",
    "new_tokens": "float64(r.NumNewTokens)",
    "input_len": "float64(len(r.InputTokens))",
    "output_len": "float64(len(r.OutputTokens))",
}

# A request is in prefill while part of its prompt is not yet in the KV cache.
IS_PREFILL = sp.StrictLessThan(PROGRESS, INPUT_LEN)
PHASES = {"prefill": IS_PREFILL, "decode": sp.Not(IS_PREFILL)}


@dataclass(frozen=True)
class Feature:
    """A batch reduction of a per-request quantity."""

    name: str
    unit: str
    per_request: sp.Expr
    reduce: str  # "sum" or "max"
    phase: str | None  # None: every request; else a key of PHASES
    aggregate: bool  # real step traces carry it as an aggregate column
    doc: str

    @property
    def symbol(self) -> sp.Symbol:
        return sp.Symbol(self.name, nonnegative=True)


FEATURES: tuple[Feature, ...] = (
    Feature("prefill_tokens", "tokens", NEW_TOKENS, "sum", "prefill", True, "prompt tokens computed this step"),
    Feature("decode_tokens", "tokens", NEW_TOKENS, "sum", "decode", True, "tokens decoded this step"),
    Feature("num_prefill_reqs", "requests", sp.Integer(1), "sum", "prefill", True, "requests in prefill"),
    Feature("num_decode_reqs", "requests", sp.Integer(1), "sum", "decode", True, "requests decoding"),
    Feature(
        "kv_tokens",
        "tokens",
        PROGRESS + NEW_TOKENS,
        "sum",
        None,
        True,
        "KV-cache tokens the batch holds once this step has run",
    ),
    Feature("max_kv_tokens", "tokens", PROGRESS + NEW_TOKENS, "max", None, False, "longest context in the batch"),
    Feature(
        "attention_work",
        "token^2",
        NEW_TOKENS * (PROGRESS + NEW_TOKENS / 2),
        "sum",
        None,
        False,
        "query-key pairs of causal attention: sum of new*(kv + new/2)",
    ),
)
FEATURE_BY_NAME = {f.name: f for f in FEATURES}
AGGREGATE_FEATURES = frozenset(f.name for f in FEATURES if f.aggregate)
ALL_FEATURES = frozenset(FEATURE_BY_NAME)

# --- Deployment constants (names of Deployment.constants) ----------------------
CONSTANT_UNITS = {
    "weight_bytes_per_gpu": "bytes",
    "active_params_per_gpu": "params",
    "kv_bytes_per_token_per_gpu": "bytes/token",
    "attn_flops_per_token_pair_per_gpu": "flop/token^2",
    "allreduce_bytes_per_token": "bytes/token",
    "hbm_bytes_per_us": "bytes/us",
    "dense_flops_per_us": "flop/us",
    "nvlink_bytes_per_us": "bytes/us",
    "n_layers": "layers",
    "tp": "GPUs",
    "moe_topk_ratio": "ratio",
}
C = {name: sp.Symbol(name, positive=True) for name in CONSTANT_UNITS}
# Lookups in the deployment's measured-kernel tables (``primitives.kernels``): the
# numpy evaluator binds them to the deployment's tables, the Go generator embeds them.
KERNEL_ARITY = {"kernel_gemm_us": 1, "kernel_decode_attention_us": 2, "kernel_prefill_attention_us": 1}
K = {name: sp.Function(name) for name in KERNEL_ARITY}
F = {f.name: f.symbol for f in FEATURES}

_total_tokens = F["prefill_tokens"] + F["decode_tokens"]
_tp_gt_1 = sp.Piecewise((1, sp.StrictGreaterThan(C["tp"], 1)), (0, True))


@dataclass(frozen=True)
class Primitive:
    """A GP terminal: a named, unit-carrying expression of features and constants."""

    name: str
    unit: str
    expr: sp.Expr
    doc: str

    @property
    def features(self) -> frozenset[str]:
        return frozenset(s.name for s in self.expr.free_symbols if s.name in FEATURE_BY_NAME)

    @property
    def constants(self) -> frozenset[str]:
        return frozenset(s.name for s in self.expr.free_symbols if s.name in CONSTANT_UNITS)

    @property
    def kernels(self) -> frozenset[str]:
        """The measured-kernel lookups the expression calls."""
        return frozenset(f.func.__name__ for f in self.expr.atoms(sp.Function) if f.func.__name__ in KERNEL_ARITY)

    @property
    def needs_per_request(self) -> bool:
        return not self.features <= AGGREGATE_FEATURES


PRIMITIVES: tuple[Primitive, ...] = (
    Primitive("prefill_tokens", "tokens", F["prefill_tokens"], "prompt tokens computed this step"),
    Primitive("decode_tokens", "tokens", F["decode_tokens"], "tokens decoded this step"),
    Primitive("num_prefill_reqs", "requests", F["num_prefill_reqs"], "requests in prefill"),
    Primitive("num_decode_reqs", "requests", F["num_decode_reqs"], "requests decoding"),
    Primitive("batch_size", "requests", F["num_prefill_reqs"] + F["num_decode_reqs"], "requests in the batch"),
    Primitive("kv_tokens", "tokens", F["kv_tokens"], "sum of KV tokens over the batch"),
    Primitive("max_kv_tokens", "tokens", F["max_kv_tokens"], "longest context in the batch"),
    Primitive("attention_work", "token^2", F["attention_work"], "sum of new*(kv + new/2)"),
    Primitive(
        "weight_time_us",
        "us",
        C["weight_bytes_per_gpu"] / C["hbm_bytes_per_us"],
        "streaming every weight a GPU holds from HBM once",
    ),
    Primitive(
        "matmul_time_us",
        "us",
        2 * C["active_params_per_gpu"] * _total_tokens / C["dense_flops_per_us"],
        "dense matmul FLOPs of the batch's tokens at peak BF16",
    ),
    Primitive(
        "attention_time_us",
        "us",
        C["attn_flops_per_token_pair_per_gpu"] * F["attention_work"] / C["dense_flops_per_us"],
        "attention FLOPs (QK and PV) at peak BF16",
    ),
    Primitive(
        "kv_io_time_us",
        "us",
        C["kv_bytes_per_token_per_gpu"] * (F["kv_tokens"] + _total_tokens) / C["hbm_bytes_per_us"],
        "reading the batch's KV cache and writing the new tokens' K and V",
    ),
    Primitive(
        "allreduce_time_us",
        "us",
        2 * (C["tp"] - 1) / C["tp"] * C["allreduce_bytes_per_token"] * _total_tokens / C["nvlink_bytes_per_us"],
        "ring all-reduce bytes of two all-reduces per layer over NVLink (zero at TP1)",
    ),
    Primitive(
        "allreduce_calls",
        "calls",
        2 * C["n_layers"] * _tp_gt_1,
        "all-reduce launches per step, latency-bound at decode (zero at TP1)",
    ),
    Primitive(
        "gemm_time_us",
        "us",
        K["kernel_gemm_us"](_total_tokens),
        "measured matmul time of every projection of every layer at m = the step's tokens (MoE: top-k routing)",
    ),
    Primitive(
        "decode_attention_time_us",
        "us",
        K["kernel_decode_attention_us"](
            F["num_decode_reqs"], (F["kv_tokens"] - F["prefill_tokens"]) / sp.Max(F["num_decode_reqs"], 1)
        ),
        "measured decode attention of the step's decode requests, every layer, at their mean context: the"
        " batch's KV tokens but this step's prefill chunks (prefill requests' cached prefixes are read too)",
    ),
    Primitive(
        "prefill_attention_time_us",
        "us",
        F["num_prefill_reqs"]
        * K["kernel_prefill_attention_us"](F["prefill_tokens"] / sp.Max(F["num_prefill_reqs"], 1)),
        "measured causal prefill attention of each prefill chunk (mean chunk length), every layer",
    ),
    Primitive("n_layers", "layers", C["n_layers"], "transformer layers"),
    Primitive("tp", "GPUs", C["tp"], "tensor-parallel degree"),
    Primitive("moe_topk_ratio", "ratio", C["moe_topk_ratio"], "experts per token over experts (1 for dense)"),
    Primitive(
        "moe_touched_fraction",
        "ratio",
        1 - (1 - C["moe_topk_ratio"]) ** sp.Max(_total_tokens, 1),
        "expected fraction of experts a batch of n tokens touches (1 for dense)",
    ),
)
PRIMITIVE_BY_NAME = {p.name: p for p in PRIMITIVES}


def supported_primitives(available_features: frozenset[str] | set[str]) -> list[str]:
    """Primitives computable from the given features, in registry order."""
    return [p.name for p in PRIMITIVES if p.features <= set(available_features)]
